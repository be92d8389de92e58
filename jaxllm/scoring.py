"""Scoring: log-likelihood of given continuations under teacher forcing, batched (the common eval use)."""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.cache import create_cache
from jaxllm.config import Config
from jaxllm.model import Weights, forward, logits


LOGIT_CHUNK = 128   # positions whose logits exist at once: [B, LOGIT_CHUNK, V] f32, not [B, T, V]


def continuation_logprobs(config: Config, weights: Weights, tokens: jax.Array, prompt_lens: jax.Array,
                          total_lens: jax.Array, *, kernels: str = "xla", dtype=jnp.float32,
                          chunk: int = LOGIT_CHUNK) -> jax.Array:
  """Sum of log p(token) over each sequence's continuation, teacher-forced. Pure: jit/vmap as you like.

  The logits are made `chunk` positions at a time and reduced at once, so memory stays at
  [B, chunk, V] whatever T (a 151936-token vocabulary over 4096 positions would be 2.5 GB per sequence).
  Args:
    tokens: [B, T] int32, prompt then continuation, right-padded.
    prompt_lens: [B] prompt lengths (>= 1); total_lens: [B] prompt + continuation lengths (<= T).
  Returns:
    [B] float32 log-likelihoods of tokens[b, prompt_lens[b]:total_lens[b]].
  """
  b, t = tokens.shape
  cache = create_cache(config, b, t, dtype)
  hidden, _ = forward(config, weights, cache, tokens, jnp.zeros((b,), jnp.int32), kernels=kernels)   # [B, T, D]
  n = -(-(t - 1) // chunk) * chunk                                             # positions 0..T-2 predict 1..T-1
  h = jnp.pad(hidden[:, :t - 1], ((0, 0), (0, n - (t - 1)), (0, 0)))            # [B, n, D]
  targets = jnp.pad(tokens[:, 1:], ((0, 0), (0, n - (t - 1))))                  # [B, n]
  j = jnp.arange(n)[None, :]                                                   # predicts token j + 1
  mask = (j + 1 >= prompt_lens[:, None]) & (j + 1 < total_lens[:, None])

  def piece(args):
    hc, tc, mc = args                                                          # [B, C, D], [B, C], [B, C]
    lc = logits(weights, hc, dtype, kernels=kernels)                           # [B, C, V]
    picked = jnp.take_along_axis(lc, tc[..., None], axis=-1)[..., 0] - jax.nn.logsumexp(lc, axis=-1)
    return jnp.sum(jnp.where(mc, picked, 0.0), axis=-1)                        # [B]

  def split(a):
    return jnp.moveaxis(a.reshape(b, n // chunk, chunk, *a.shape[2:]), 1, 0)
  return jnp.sum(jax.lax.map(piece, (split(h), split(targets), split(mask))), axis=0)


@functools.partial(jax.jit, static_argnames=("config", "kernels", "dtype"))
def _scores_jit(config, weights, tokens, prompt_lens, total_lens, kernels, dtype):
  return continuation_logprobs(config, weights, tokens, prompt_lens, total_lens, kernels=kernels, dtype=dtype)


def score(config: Config, weights: Weights, prompts: Sequence[Sequence[int]],
          continuations: Sequence[Sequence[int]], *, kernels: str = "xla", dtype=jnp.float32) -> np.ndarray:
  """Log-likelihood of each continuation given its prompt, as float32 [len(prompts)].

  Pads to a power-of-two length so different batches reuse compiled code.
  """
  if len(prompts) != len(continuations) or not prompts:
    raise ValueError(f"need as many prompts as continuations (>= 1), got {len(prompts)} and {len(continuations)}")
  for p, c in zip(prompts, continuations):
    if len(p) < 1 or len(c) < 1:
      raise ValueError(f"every prompt and continuation needs >= 1 token, got {len(p)} and {len(c)}")
  totals = [len(p) + len(c) for p, c in zip(prompts, continuations)]
  t = 16
  while t < max(totals):
    t *= 2
  tokens = np.zeros((len(prompts), t), np.int32)
  for i, (p, c) in enumerate(zip(prompts, continuations)):
    tokens[i, :totals[i]] = list(p) + list(c)
  out = _scores_jit(config, weights, jnp.asarray(tokens), jnp.asarray([len(p) for p in prompts], jnp.int32),
                    jnp.asarray(totals, jnp.int32), kernels, dtype)
  return np.asarray(out)
