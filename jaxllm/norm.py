"""RMSNorm, shared by the model's layers and the fused kernels' references (a leaf: it imports no jaxllm module)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  """x [..., D] * rsqrt(mean(x^2) + eps) * w [D], computed in f32."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w
