"""W8A16 linear: y[M, N] = x[M, K] @ (w[N, K] * scale[N, K / group]).T.

The weight may be one layer of a stacked [L, N, K] array; `layer` (a Python int) picks it, so the FFI
kernel can address the layer inside the stacked buffer without XLA copying it out.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.quant import Linear


def linear_reference(x: jax.Array, lin: Linear, layer: int | None = None) -> jax.Array:
  """Pure-jnp W8A16 matmul.

  Args:
    x: [..., K] activations (bf16/f16/f32).
    lin: weight [N, K] or [L, N, K] (int8 with scale [.., N, K // group], or float with no scale).
    layer: index into L when the weight is stacked.
  Returns:
    [..., N] in x.dtype; accumulation in f32.
  """
  if layer is not None:
    lin = Linear(w=lin.w[layer], scale=None if lin.scale is None else lin.scale[layer])
  w = lin.dequantize(x.dtype)                                                   # [N, K]
  return jnp.einsum("...k,nk->...n", x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def linear(x: jax.Array, lin: Linear, layer: int | None = None, *, kernels: str = "xla") -> jax.Array:
  """W8A16 matmul through the selected implementation (see jaxllm.kernels)."""
  from jaxllm.kernels import ffi, select
  if select.uses_ffi(kernels) and lin.quantized and "matmul" in select.ffi_ops():
    return ffi.w8a16_matmul(x, lin, layer)
  return linear_reference(x, lin, layer)
