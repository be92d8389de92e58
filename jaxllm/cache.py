"""The preallocated KV cache: fixed shape for the whole generation, so compiled steps never change."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxllm.config import Config


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Keys and values of every layer.

  k, v: [L, B, G, S, Dh] in the activation dtype. Position s of sequence b holds the key of that
  sequence's token s once it has been run; positions past a sequence's length hold stale values that
  attention masks out.
  """
  k: jax.Array
  v: jax.Array

  @property
  def batch(self) -> int:
    return self.k.shape[1]

  @property
  def max_len(self) -> int:
    return self.k.shape[3]


def create_cache(config: Config, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
  """An empty cache for `batch` sequences of up to `max_len` tokens."""
  if batch < 1 or max_len < 1:
    raise ValueError(f"cache needs batch >= 1 and max_len >= 1, got batch={batch}, max_len={max_len}")
  shape = (config.n_layers, batch, config.n_kv_heads, max_len, config.head_dim)
  return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
