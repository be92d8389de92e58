"""W8A16: int8 weights with one float32 scale per output channel, 16-bit (or f32) activations.

Why per output channel rather than per group: on the weights of SmolLM2-135M and Qwen2.5-Coder-0.5B the
per-channel scheme's relative weight error is within a small factor of per-group-128 (see
docs/quantization.md for the measured numbers), while it keeps the matmul a plain int8 dot with a single
multiply per output, which is what the decode kernels stream fastest.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Linear:
  """A linear layer's weight, y = x @ w.T (* scale).

  w: [..., N, K] int8 (quantized) or float (reference runs).
  scale: [..., N] float32, or None for float weights.
  """
  w: jax.Array
  scale: jax.Array | None = None

  @property
  def quantized(self) -> bool:
    return self.scale is not None

  def dequantize(self) -> jax.Array:
    """Float weight [..., N, K] in float32."""
    if self.scale is None:
      return self.w.astype(jnp.float32)
    return self.w.astype(jnp.float32) * self.scale[..., None]


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Symmetric per-output-channel int8.

  Args:
    w: [..., N, K] float.
  Returns:
    q: [..., N, K] int8 with q = round(w / scale), |q| <= 127.
    scale: [..., N] float32 = max|w| over K / 127 (1 for all-zero rows).
  """
  w = np.asarray(w, np.float32)
  amax = np.max(np.abs(w), axis=-1)
  scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
  q = np.clip(np.rint(w / scale[..., None]), -127, 127).astype(np.int8)
  return q, scale


def quantize_int8_grouped(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
  """Symmetric int8 with one scale per `group` consecutive inputs; used only to measure the choice above.

  Returns q [..., N, K] int8 and scale [..., N, K // group].
  """
  w = np.asarray(w, np.float32)
  *lead, n, k = w.shape
  if k % group:
    raise ValueError(f"K={k} is not a multiple of the group size {group}")
  g = w.reshape(*lead, n, k // group, group)
  q, scale = quantize_int8(g)
  return q.reshape(w.shape), scale
