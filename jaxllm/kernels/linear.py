"""Quantized linear: y[M, N] = x[M, K] @ dequantize(w)[N, K].T, for W8A16 (jaxllm.quant.Linear) and the GGUF
file's own blocks (jaxllm.quant.LowBit: 4/5-bit; jaxllm.quant.Q6K).

The weight may be one layer of a stacked [L, N, K] array; `layer` (a Python int) picks it, so the FFI
kernel can address the layer inside the stacked buffer without XLA copying it out. A stack whose layers are
held in different ways (jaxllm.quant.Mixed) runs a layer's pieces one after another.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.quant import Q6K, Linear, LowBit, Mixed, MixedAt


def _mixed(x: jax.Array, lin: Mixed | MixedAt, layer: int | None, one) -> jax.Array:
  """A Mixed stack's layer: each piece through one(x, weight, index), the rows concatenated. MixedAt (a traced
  layer): lax.switch over the kinds of layer the stack has, each branch slicing its pieces' layers out."""
  if isinstance(lin, Mixed):
    return jnp.concatenate([one(x, part, j) for part, j in lin.pieces(layer)], axis=-1)
  mixed = lin.mixed
  kinds = sorted({tuple(p for p, _ in pieces) for pieces in mixed.layout})
  kind_of = jnp.asarray([kinds.index(tuple(p for p, _ in pieces)) for pieces in mixed.layout], jnp.int32)
  index = [jnp.asarray([dict(pieces).get(p, 0) for pieces in mixed.layout], jnp.int32)
           for p in range(len(mixed.parts))]

  def branch(kind):
    def run(x):
      outs = []
      for p in kind:
        part = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index[p][lin.layer], keepdims=True),
                            mixed.parts[p])
        outs.append(one(x, part, 0))
      return jnp.concatenate(outs, axis=-1)
    return run
  return jax.lax.switch(kind_of[lin.layer], [branch(k) for k in kinds], x)


def linear_reference(x: jax.Array, lin: Linear | LowBit | Q6K | Mixed | MixedAt,
                     layer: int | None = None) -> jax.Array:
  """Pure-jnp quantized matmul.

  Args:
    x: [..., K] activations (bf16/f16/f32).
    lin: weight [N, K] or [L, N, K]: Linear (int8 with scale [.., N, K // group], or float with no scale)
      or LowBit.
    layer: index into L when the weight is stacked.
  Returns:
    [..., N] in x.dtype; accumulation in f32.
  """
  if isinstance(lin, (Mixed, MixedAt)):
    return _mixed(x, lin, layer, linear_reference)
  if layer is not None:
    lin = jax.tree.map(lambda a: a[layer], lin)
  w = lin.dequantize(x.dtype)                                                   # [N, K]
  # f32 activations are the float reference: full precision on the GPU too (its default for f32 is TF32).
  precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
  return jnp.einsum("...k,nk->...n", x, w, preferred_element_type=jnp.float32,
                    precision=precision).astype(x.dtype)


def linear(x: jax.Array, lin: Linear | LowBit | Q6K | Mixed | MixedAt, layer: int | None = None, *,
           kernels: str = "xla") -> jax.Array:
  """Quantized matmul through the selected implementation (see jaxllm.kernels): the FFI kernels where
  they take the weight (LowBit and Q6K: the CPU's), the reference otherwise; a Mixed stack piece by piece."""
  from jaxllm.kernels import ffi, select
  if isinstance(lin, (Mixed, MixedAt)):
    return _mixed(x, lin, layer, lambda x, part, j: linear(x, part, j, kernels=kernels))
  if not select.uses_ffi(kernels) or "matmul" not in select.ffi_ops():
    return linear_reference(x, lin, layer)
  if isinstance(lin, LowBit):
    return ffi.lowbit_matmul(x, lin, layer) if ffi.lowbit_supported() else linear_reference(x, lin, layer)
  if isinstance(lin, Q6K):
    return ffi.q6k_matmul(x, lin, layer) if ffi.lowbit_supported() else linear_reference(x, lin, layer)
  if lin.quantized:
    return ffi.w8a16_matmul(x, lin, layer)
  return linear_reference(x, lin, layer)
