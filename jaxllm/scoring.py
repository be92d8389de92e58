"""Scoring: log-likelihood of given continuations under teacher forcing, batched (the common eval use)."""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.cache import create_cache
from jaxllm.config import Config
from jaxllm.decode import sequence_logits
from jaxllm.model import Weights


def continuation_logprobs(config: Config, weights: Weights, tokens: jax.Array, prompt_lens: jax.Array,
                          total_lens: jax.Array, *, kernels: str = "xla", dtype=jnp.float32) -> jax.Array:
  """Sum of log p(token) over each sequence's continuation, teacher-forced. Pure: jit/vmap as you like.

  Args:
    tokens: [B, T] int32, prompt then continuation, right-padded.
    prompt_lens: [B] prompt lengths (>= 1); total_lens: [B] prompt + continuation lengths (<= T).
  Returns:
    [B] float32 log-likelihoods of tokens[b, prompt_lens[b]:total_lens[b]].
  """
  b, t = tokens.shape
  cache = create_cache(config, b, t, dtype)
  logits, _ = sequence_logits(config, weights, cache, tokens, jnp.zeros((b,), jnp.int32), kernels=kernels)
  logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)                            # [B, T-1, V]
  picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]      # [B, T-1]
  j = jnp.arange(t - 1)[None, :]                                                # predicts token j + 1
  mask = (j + 1 >= prompt_lens[:, None]) & (j + 1 < total_lens[:, None])
  return jnp.sum(jnp.where(mask, picked, 0.0), axis=-1)


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
