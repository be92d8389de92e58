"""Prefill and the decode step as pure functions over a DecodeState pytree.

These are what the engine compiles (donating the state) and what users call inside their own `jit`,
`vmap` or `scan`. Every per-step value (next token, write/RoPE position, visible length = position + 1,
PRNG key) lives in the state on the device, so the compiled step is the same every call.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxllm.cache import KVCache
from jaxllm.config import Config
from jaxllm.model import Weights, forward, logits
from jaxllm.sampling import SamplingParams, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  """Everything a decode step reads and writes.

  cache: KVCache [L, B, G, S, Dh].
  tokens: [B] int32, the last sampled token of each sequence (the next step's input).
  pos: [B] int32, where that token will be written: the number of tokens already in the cache; it is
    also the token's RoPE position, and pos + 1 is the visible length of its attention.
  key: PRNG key (uint32 [2]) for sampling.
  """
  cache: KVCache
  tokens: jax.Array
  pos: jax.Array
  key: jax.Array


def _last_hidden(hidden: jax.Array, lengths: jax.Array) -> jax.Array:
  """hidden [B, T, D] at each sequence's last real token, lengths [B] -> [B, D]."""
  return hidden[jnp.arange(hidden.shape[0]), lengths - 1]


def prefill(config: Config, weights: Weights, cache: KVCache, tokens: jax.Array, lengths: jax.Array,
            key: jax.Array, params: SamplingParams = SamplingParams(), *,
            kernels: str = "xla") -> DecodeState:
  """Runs the prompts from cache position 0 and samples each sequence's first new token.

  Args:
    cache: KVCache with max_len >= T (its old contents are overwritten or masked).
    tokens: [B, T] int32 prompts, right-padded to a common (bucketed) length T.
    lengths: [B] int32 real prompt lengths, 1 <= lengths[b] <= T.
    key: PRNG key.
  Returns:
    DecodeState ready for decode_step: tokens = first sampled tokens, pos = lengths.
  """
  start = jnp.zeros((tokens.shape[0],), jnp.int32)
  hidden, cache = forward(config, weights, cache, tokens, start, kernels=kernels)
  last = logits(weights, _last_hidden(hidden, lengths), cache.k.dtype, kernels=kernels)  # [B, V]
  key, sub = jax.random.split(key)
  return DecodeState(cache=cache, tokens=sample(last, sub, params), pos=lengths.astype(jnp.int32),
                     key=key)


def decode_step(config: Config, weights: Weights, state: DecodeState,
                params: SamplingParams = SamplingParams(), *, kernels: str = "xla") -> DecodeState:
  """Runs each sequence's last token and samples the next one."""
  hidden, cache = forward(config, weights, state.cache, state.tokens[:, None], state.pos, kernels=kernels)
  step_logits = logits(weights, hidden[:, 0], cache.k.dtype, kernels=kernels)          # [B, V]
  key, sub = jax.random.split(state.key)
  return DecodeState(cache=cache, tokens=sample(step_logits, sub, params), pos=state.pos + 1, key=key)


def sequence_logits(config: Config, weights: Weights, cache: KVCache, tokens: jax.Array,
                    start: jax.Array, *, kernels: str = "xla") -> tuple[jax.Array, KVCache]:
  """Logits [B, T, V] f32 of every position of tokens [B, T] written from cache position start [B]."""
  hidden, cache = forward(config, weights, cache, tokens, start, kernels=kernels)
  return logits(weights, hidden, cache.k.dtype, kernels=kernels), cache
