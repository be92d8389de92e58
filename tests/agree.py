"""Greedy tokens of two runs compared where exact equality is not the platform's truth.

On the CPU (f32, the same kernels at every batch size and path) two runs meant to agree give the same tokens,
and the tests assert that. On the GPU (bf16) different paths (the fused step, the unfused kernels, XLA's dots)
round differently, so there the rule is tolerance-aware: every token of each run must be the argmax of an
independent path's logits (the prefill program over that run's own history), or within `spread` of the logits'
range below it, the repeat penalty applied as jaxllm.sampling applies it. Two runs may then part at a near tie,
and every later token of both is still checked.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxllm
from jaxllm.sampling import SamplingParams


def same_or_near_tie(engine, prompt: list[int], got: list[int], want: list[int], spread: float = 0.02,
                     params: SamplingParams = SamplingParams()) -> None:
  """Asserts got == want on the CPU; on the GPU, equal lengths and every token of both near the argmax."""
  if jax.default_backend() == "cpu":
    assert got == want
    return
  assert len(got) == len(want), (len(got), len(want))
  assert params.greedy, "the rule is the argmax's: greedy runs only"
  assert params.presence_penalty == 0 and params.frequency_penalty == 0, "only the repeat penalty is emulated"
  for ids in (got, want):
    _near_argmax(engine, prompt, ids, spread, params)


def _near_argmax(engine, prompt: list[int], ids: list[int], spread: float, params: SamplingParams) -> None:
  if not ids:
    return
  seq = list(prompt) + list(ids[:-1])
  cache = jaxllm.create_cache(engine.config, 1, len(seq), engine.dtype)
  logits, _ = jaxllm.sequence_logits(engine.config, engine.weights, cache, jnp.asarray([seq], jnp.int32),
                                     jnp.zeros((1,), jnp.int32))
  rows = np.asarray(logits[0, len(prompt) - 1:], np.float64)   # [len(ids), V]: row j predicts ids[j]
  for j, tok in enumerate(ids):
    row = rows[j]
    if params.repeat_penalty != 1.0 and params.repeat_last_n > 0:   # llama.cpp's, the prompt included
      seen = np.unique((list(prompt) + list(ids[:j]))[-params.repeat_last_n:])
      row = row.copy()
      row[seen] = np.where(row[seen] > 0, row[seen] / params.repeat_penalty, row[seen] * params.repeat_penalty)
    gap = row.max() - row[tok]
    assert gap <= spread * (row.max() - row.min()), (j, tok, int(row.argmax()), gap, row.max() - row.min())
