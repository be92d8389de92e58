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

  k, v: [L, B, G, S, Dh] in the cache dtype (bf16 by default: half the memory and half the bytes decode
  attention reads; llama.cpp keeps f16). Position s of sequence b holds the key of that sequence's token s
  once it has been run; positions past a sequence's length hold stale values that attention masks out.
  compute: the activation dtype the model runs in with this cache (static: matmul inputs, q, outputs).
  """
  k: jax.Array
  v: jax.Array
  compute: str = dataclasses.field(default="", metadata=dict(static=True))

  @property
  def compute_dtype(self):
    """The activation dtype (the cache's own dtype when none was given)."""
    return jnp.dtype(self.compute) if self.compute else self.k.dtype

  @property
  def batch(self) -> int:
    """The cache's rows (sequences it holds); a decode step may run on its first B of them (decode.DecodeState),
    so this is not always the step's batch."""
    return self.k.shape[1]

  @property
  def max_len(self) -> int:
    return self.k.shape[3]


def cache_bytes(config: Config, batch: int, max_len: int, dtype) -> int:
  """Bytes of a cache for `batch` sequences of `max_len` tokens (keys and values of every layer)."""
  return 2 * config.n_layers * batch * config.n_kv_heads * max_len * config.head_dim * jnp.dtype(dtype).itemsize


def memory_available() -> int | None:
  """Bytes the default device can still allocate (the GPU's limit minus what is in use; on the CPU the
  host's available memory), or None where it cannot be told."""
  stats = jax.devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def check_fits(config: Config, batch: int, max_len: int, dtype) -> None:
  """Raises ValueError, before anything is allocated, when the cache cannot fit in the device's memory."""
  need = cache_bytes(config, batch, max_len, dtype)
  free = memory_available()
  if free is not None and need > free:
    raise ValueError(f"a KV cache of {max_len} tokens x batch {batch} needs {need / 2**30:.2f} GiB "
                     f"({config.n_layers} layers x {config.n_kv_heads} kv heads x {config.head_dim} dims x 2 x "
                     f"{jnp.dtype(dtype).itemsize} bytes per token), but the device has {free / 2**30:.2f} GiB free: "
                     "use a smaller context (--max-context) or batch")


def create_cache(config: Config, batch: int, max_len: int, dtype=jnp.float32, cache_dtype=None) -> KVCache:
  """An empty cache for `batch` sequences of up to `max_len` tokens.

  dtype: the activation dtype; cache_dtype: what keys and values are stored in (default: dtype).
  """
  if batch < 1 or max_len < 1:
    raise ValueError(f"cache needs batch >= 1 and max_len >= 1, got batch={batch}, max_len={max_len}")
  cache_dtype = cache_dtype or dtype
  check_fits(config, batch, max_len, cache_dtype)
  shape = (config.n_layers, batch, config.n_kv_heads, max_len, config.head_dim)
  return KVCache(k=jnp.zeros(shape, cache_dtype), v=jnp.zeros(shape, cache_dtype),
                 compute=jnp.dtype(dtype).name if jnp.dtype(dtype) != jnp.dtype(cache_dtype) else "")
