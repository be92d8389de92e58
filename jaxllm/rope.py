"""Rotary position embedding (RoPE): the frequencies, the angles of positions, and the rotation of q and k.

Shared by the model's layers (jaxllm/model.py) and the fused kernels (jaxllm/kernels/fused.py), which take
the frequencies and position scale as arguments. Dh is the head dim; "normal" and "neox" are the two ways
a head's dims are paired (apply_rope).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.config import Config


def rope_inv_freq(config: Config, rope_freqs: jax.Array | None) -> jax.Array:
  """[Dh/2] f32 frequencies: position p (divided by rope_scale under linear scaling) turns by p * inv_freq."""
  half = config.head_dim // 2
  inv_freq = config.rope_base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / config.head_dim)
  return inv_freq if rope_freqs is None else inv_freq / rope_freqs


def llama3_rope_freqs(config: Config, factor: float = 8.0, low_freq_factor: float = 1.0,
                      high_freq_factor: float = 4.0, original_context: int = 8192) -> jax.Array:
  """[Dh/2] f32 divisors of Llama 3.1's RoPE scaling, as a GGUF's rope_freqs.weight holds them (llama.cpp's
  convert_hf_to_gguf.py computes the same from the model's rope_scaling): 1 for the high frequencies, `factor`
  for wavelengths beyond original_context / low_freq_factor, a smooth blend between."""
  half = config.head_dim // 2
  freq = config.rope_base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / config.head_dim)
  wavelen = 2 * jnp.pi / freq
  smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
  blend = 1.0 / ((1 - smooth) / factor + smooth)
  return jnp.where(wavelen < original_context / high_freq_factor, 1.0,
                   jnp.where(wavelen > original_context / low_freq_factor, factor, blend)).astype(jnp.float32)


def rope_position_scale(config: Config) -> float:
  """What positions are divided by before they turn (linear RoPE scaling; 1 for none)."""
  return config.rope_scale if config.rope_scaling == "linear" else 1.0


def rope_angles(config: Config, positions: jax.Array, rope_freqs: jax.Array | None) -> jax.Array:
  """Rotation angles [..., Dh/2] for integer positions [...]."""
  inv_freq = rope_inv_freq(config, rope_freqs)
  pos = positions.astype(jnp.float32)
  if config.rope_scaling == "linear":
    pos = pos / rope_position_scale(config)
  return pos[..., None] * inv_freq


def apply_rope(x: jax.Array, angles: jax.Array, style: str) -> jax.Array:
  """Rotates x [B, T, N, Dh] by angles [B, T, Dh/2].

  "normal" rotates adjacent pairs (x[2i], x[2i+1]) (llama's GGUF layout); "neox" rotates
  (x[i], x[i + Dh/2]) (qwen2/qwen3).
  """
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  xf = x.astype(jnp.float32)
  if style == "neox":
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  else:
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)
  return out.astype(x.dtype)
