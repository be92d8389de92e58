"""Quantized linear: y[M, N] = x[M, K] @ dequantize(w)[N, K].T, for W8A16 (jaxllm.quant.Linear) and the GGUF
file's own blocks (jaxllm.quant.LowBit: 4/5-bit; jaxllm.quant.Q6K).

The weight may be one layer of a stacked [L, N, K] array; `layer` (a Python int) picks it, so the FFI
kernel can address the layer inside the stacked buffer without XLA copying it out. A stack whose layers are
held in different ways (jaxllm.quant.Mixed) runs a layer's pieces one after another.

linear() is where the matmul's path is chosen: the FFI kernel (jaxllm/kernels/ffi.py, bindings only) for
the weights it takes and up to max_m() / lowbit_max_m() rows of x, the reference otherwise.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import tuning
from jaxllm.kernels import ffi, select
from jaxllm.quant import Q6K, Linear, LowBit, Mixed, MixedAt

# Rows of x the matmul kernel takes per backend; larger M (prefill chunks) uses XLA's dot on dequantized
# weights. GPU: M <= 4 runs the GEMV kernels, 5-64 rows of bf16 the tensor-core kernel (ffi/w8a16_mma.cuh:
# the weights read once for the whole batch; XLA's dot wrote a bf16 copy of them each call); f32 x keeps the
# GEMV kernels' tiles of 4 rows. CPU (SmolLM2 shapes, 2 cores): 30-40% faster than XLA's dot at M = 32, even
# at 64, 1.8-2.2x slower at 128.
MAX_M = {"gpu": 64, "cpu": 32}
# The low-bit and Q6_K CPU kernels (the file's own blocks) against XLA's dot on the layer dequantized per
# call: set from bench/cpu_gemv.py --prefill (docs/results/2026-12-02-cpu-prefill.md).
LOWBIT_MAX_M = {"cpu": 32}


def max_m() -> int:
  """Rows of x the FFI matmul takes on the default backend."""
  return MAX_M.get(jax.default_backend(), 16)


def lowbit_max_m() -> int:
  """Rows of x the low-bit and Q6_K kernels take on the default backend (LOWBIT_MAX_M)."""
  return LOWBIT_MAX_M.get(jax.default_backend(), max_m())


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
    if not (isinstance(lin, Linear) and not lin.quantized):
      # A layer of a stack (the unrolled layers): its dequantization waits for x. Nothing else ties it to its
      # layer, and XLA is free to run every layer's first and hold them all (on the CPU with unrolled layers the
      # 0.5B shape's prefill held all 24 layers' at once; the 7B bench's peak on the GPU had about that much, 13 GB,
      # beyond weights and cache). The barrier goes before the layer's slice, which then stays inside the
      # dequantization's fusion. The GPU compiler removes barriers after scheduling; the CPU's before (its default,
      # scanned layers, holds one layer's anyway).
      x, lin = jax.lax.optimization_barrier((x, lin))
    lin = jax.tree.map(lambda a: a[layer], lin)
  w = lin.dequantize(x.dtype)                                                   # [N, K]
  # f32 activations are the float reference: full precision on the GPU too (its default for f32 is TF32).
  precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
  return jnp.einsum("...k,nk->...n", x, w, preferred_element_type=jnp.float32,
                    precision=precision).astype(x.dtype)


def linear(x: jax.Array, lin: Linear | LowBit | Q6K | Mixed | MixedAt, layer: int | None = None, *,
           kernels: str = "xla") -> jax.Array:
  """Quantized matmul through the selected implementation (see jaxllm.kernels): the FFI kernels where
  they take the weight (LowBit and Q6K: the CPU's) and M (the rows of x) is at most max_m() (lowbit_max_m()),
  the reference otherwise (XLA's dot on dequantized weights, faster there); a Mixed stack piece by piece."""
  if isinstance(lin, (Mixed, MixedAt)):
    return _mixed(x, lin, layer, lambda x, part, j: linear(x, part, j, kernels=kernels))
  if not select.uses_ffi(kernels) or "matmul" not in select.ffi_ops():
    return linear_reference(x, lin, layer)
  m = int(np.prod(x.shape[:-1])) if x.ndim > 1 else 1
  if isinstance(lin, (LowBit, Q6K)):
    if not ffi.lowbit_supported() or m > lowbit_max_m():
      return linear_reference(x, lin, layer)
    matmul = ffi.lowbit_matmul if isinstance(lin, LowBit) else ffi.q6k_matmul
    return matmul(x, lin, layer)
  if lin.quantized and m <= max_m():
    k = x.shape[-1]
    measured = x.dtype == jnp.bfloat16 and lin.scale.shape[-1] * tuning.GROUP == k   # the tensor-core kernel's
    return ffi.w8a16_matmul(x, lin, layer, mma=tuning.choice(lin.w.shape[-2], k, m) if measured else -1)
  return linear_reference(x, lin, layer)
