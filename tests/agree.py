"""Greedy tokens of two runs compared where exact equality is not the platform's truth.

On the CPU (f32, the same kernels at every batch size and path) two runs meant to agree give the same tokens,
and the tests assert that. On the GPU (bf16) different paths (the fused step, the unfused kernels, XLA's dots)
round differently, so there the rule is tolerance-aware: two runs may part only where the choice was a near
tie, the two tokens' logits at the first difference within `spread` of the logits' range, by an independent
path (the prefill program over the agreed tokens, penalties applied as jaxllm.sampling applies them).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxllm


def same_or_near_tie(engine, prompt: list[int], got: list[int], want: list[int], spread: float = 0.02,
                     repeat_penalty: float = 1.0, window: int = 64) -> None:
  """Asserts got == want on the CPU; on the GPU, equal lengths and a near tie at the first difference."""
  if jax.default_backend() == "cpu" or got == want:
    assert got == want
    return
  assert len(got) == len(want), (len(got), len(want))
  i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
  seq = list(prompt) + list(want[:i])
  cache = jaxllm.create_cache(engine.config, 1, len(seq), engine.dtype)
  logits, _ = jaxllm.sequence_logits(engine.config, engine.weights, cache, jnp.asarray([seq], jnp.int32),
                                     jnp.zeros((1,), jnp.int32))
  row = np.asarray(logits[0, -1], np.float64)
  if repeat_penalty != 1.0:   # llama.cpp's repeat penalty over the last `window` tokens, the prompt included
    seen = np.unique(seq[-window:])
    row[seen] = np.where(row[seen] > 0, row[seen] / repeat_penalty, row[seen] * repeat_penalty)
  gap = abs(row[got[i]] - row[want[i]])
  assert gap <= spread * (row.max() - row.min()), (i, got[i], want[i], gap, row.max() - row.min())
