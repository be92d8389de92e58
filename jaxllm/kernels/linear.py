"""Quantized linear: y[M, N] = x[M, K] @ dequantize(w)[N, K].T, for W8A16 (jaxllm.quant.Linear) and the GGUF
file's own 4/5-bit blocks (jaxllm.quant.LowBit).

The weight may be one layer of a stacked [L, N, K] array; `layer` (a Python int) picks it, so the FFI
kernel can address the layer inside the stacked buffer without XLA copying it out.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.quant import Linear, LowBit


def linear_reference(x: jax.Array, lin: Linear | LowBit, layer: int | None = None) -> jax.Array:
  """Pure-jnp quantized matmul.

  Args:
    x: [..., K] activations (bf16/f16/f32).
    lin: weight [N, K] or [L, N, K]: Linear (int8 with scale [.., N, K // group], or float with no scale)
      or LowBit.
    layer: index into L when the weight is stacked.
  Returns:
    [..., N] in x.dtype; accumulation in f32.
  """
  if layer is not None:
    lin = jax.tree.map(lambda a: a[layer], lin)
  w = lin.dequantize(x.dtype)                                                   # [N, K]
  return jnp.einsum("...k,nk->...n", x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def linear(x: jax.Array, lin: Linear | LowBit, layer: int | None = None, *, kernels: str = "xla") -> jax.Array:
  """Quantized matmul through the selected implementation (see jaxllm.kernels): the FFI kernels where
  they take the weight (LowBit: the CPU's), the reference otherwise."""
  from jaxllm.kernels import ffi, select
  if not select.uses_ffi(kernels) or "matmul" not in select.ffi_ops():
    return linear_reference(x, lin, layer)
  if isinstance(lin, LowBit):
    return ffi.lowbit_matmul(x, lin, layer) if ffi.lowbit_supported() else linear_reference(x, lin, layer)
  if lin.quantized:
    return ffi.w8a16_matmul(x, lin, layer)
  return linear_reference(x, lin, layer)
