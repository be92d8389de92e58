"""Sampling on the device: greedy, temperature, top-k, top-p, in the order HF transformers applies them."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """temperature 0 means greedy; top_k 0 means off; top_p 1 means off. Static: one compile per setting."""
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
            and self.temperature >= 0):
      raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
    if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
      raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
    if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0 or self.top_k == 1


def sample(logits: jax.Array, key: jax.Array, params: SamplingParams) -> jax.Array:
  """Draws one token per row.

  Args:
    logits: [B, V] float32.
    key: a PRNG key.
  Returns:
    [B] int32 token ids.
  """
  if params.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  x = logits / params.temperature
  if params.top_k > 0:
    k = min(params.top_k, x.shape[-1])
    kth = jax.lax.top_k(x, k)[0][..., -1:]
    x = jnp.where(x < kth, -jnp.inf, x)
  if params.top_p < 1:
    desc = -jnp.sort(-x, axis=-1)                                   # [B, V] descending
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs                     # mass strictly above each token
    cutoff = jnp.min(jnp.where(before < params.top_p, desc, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where(x < cutoff, -jnp.inf, x)
  return jax.random.categorical(key, x, axis=-1).astype(jnp.int32)
