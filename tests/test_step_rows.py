"""A decode step on the first B rows of a cache of N > B rows: what the server's decode call on `count` of its N
slots runs (serve.rows.decode_rows), the cache passed whole and never sliced.

Every kernel path reads and writes rows [0, B) of the cache in place: the step's tokens, positions, sampler and
cache rows are bit for bit those of the same step on the cache cut to its first B rows, and rows [B, N) (random
values) are left exactly as they were. A kernel that took the cache's strides from the batch instead of the
cache's own row count would read and write other rows: this test fails then.

The paths: "xla" (unrolled and scanned layers), "ffi-unfused", "ffi" (on the CPU the unfused FFI step, the
engine's "auto"; on the GPU the fused step's one layers call at batch 1, the fused attention block at 2-16 rows),
"ffi" scanned, and with the lab switch JAXLLM_FUSED_CPU=1 the CPU's fused handlers: the fused step (W8A16 weights)
and the fused attention block (float weights). The same parameters run the CUDA kernels on a GPU, plus the fused
step one FFI call per op (JAXLLM_LAYERS_CALL=0, GPU only: on the CPU that is the fused case again).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.cache import create_cache
from jaxllm.decode import MAX_EOG, NO_EOG, DecodeState, decode_step
from jaxllm.kernels import ffi
from jaxllm.load import default_dtype
from jaxllm.presets import preset
from jaxllm.sampling import Sampler, SamplingParams
from jaxllm.weights import random_weights

ON_GPU = jax.default_backend() == "gpu"
MAX_LEN, STEPS = 96, 3
# (kernels, layers, lab switches, weights' quant) per path; a path marked gpu runs only there.
PATHS = {
    "xla": ("xla", "unrolled", {}, "w8a16"),
    "xla-scan": ("xla", "scan", {}, "w8a16"),
    "ffi-unfused": ("ffi-unfused", "unrolled", {}, "w8a16"),
    "ffi": ("ffi", "unrolled", {}, "w8a16"),
    "ffi-scan": ("ffi", "scan", {}, "w8a16"),
    "ffi-fused": ("ffi", "unrolled", {"JAXLLM_FUSED_CPU": "1"}, "w8a16"),
    "ffi-block": ("ffi", "unrolled", {"JAXLLM_FUSED_CPU": "1"}, "none"),
    "ffi-per-op": ("ffi", "unrolled", {"JAXLLM_LAYERS_CALL": "0"}, "w8a16"),
}
GPU_ONLY = {"ffi-per-op"}
SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, repeat_penalty=1.2)


@functools.cache
def _model(quant: str):
  """SmolLM2-135M's geometry (head dim 64: the CUDA kernels take it), two layers, a 4096-token vocabulary, random
  weights."""
  config = preset("smollm2-135m").replace(n_layers=2, vocab_size=4096)
  return config, random_weights(config, seed=1, quant=quant, dtype=default_dtype())


def _state(config, b: int, n: int, sampled: bool) -> DecodeState:
  """Host arrays of a state of b rows over a cache of n rows, every cache value random (rows [b, n) too)."""
  rng = np.random.default_rng(7)
  cache = create_cache(config, n, MAX_LEN, default_dtype())
  k, v = (np.asarray(jnp.asarray(rng.standard_normal(a.shape), a.dtype)) for a in (cache.k, cache.v))
  history = [list(rng.integers(0, config.vocab_size, 8)) for _ in range(b)]
  sampler = Sampler.create(SAMPLED if sampled else SamplingParams(), b, seed=3, history=history,
                           vocab_size=config.vocab_size)
  return DecodeState(cache=dataclasses.replace(cache, k=k, v=v),
                     tokens=rng.integers(0, config.vocab_size, b).astype(np.int32),
                     pos=np.asarray([40, 9, 63][:b], np.int32), done=np.asarray([False, True, False][:b]),
                     limit=np.full((b,), MAX_LEN, np.int32), eog=np.full((b, MAX_EOG), NO_EOG, np.int32),
                     sampler=sampler)


def _cut(state: DecodeState, b: int) -> DecodeState:
  cache = dataclasses.replace(state.cache, k=state.cache.k[:, :b], v=state.cache.v[:, :b])
  return dataclasses.replace(state, cache=cache)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("b, n", [(1, 3), (3, 5)])
@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.gpu) if p in GPU_ONLY else p for p in PATHS])
def test_step_on_the_first_rows_of_a_larger_cache(lab_switches, path, b, n, sampled):
  kernels, layers, switches, quant = PATHS[path]
  if kernels != "xla" and ffi.unavailable_reason() is not None:
    pytest.skip(f"FFI kernels unavailable: {ffi.unavailable_reason()}")
  for name, value in switches.items():
    lab_switches.setenv(name, value)
  config, weights = _model(quant)
  flags = dict(greedy_only=True, penalties=False) if not sampled else dict(greedy_only=False, penalties=True)
  # The state donated, as the engine's and the server's programs do (the cache aliased through the step).
  step = jax.jit(functools.partial(decode_step, config, kernels=kernels, layers=layers, **flags), donate_argnums=1)
  start = _state(config, b, n, sampled)
  whole, cut = jax.device_put(start), jax.device_put(_cut(start, b))
  tokens = []
  for _ in range(STEPS):
    whole, cut = step(weights, whole), step(weights, cut)
    tokens.append(np.asarray(whole.tokens))
  whole, cut = jax.device_get(whole), jax.device_get(cut)
  for name in ("tokens", "pos", "done"):
    np.testing.assert_array_equal(getattr(whole, name), getattr(cut, name), err_msg=name)
  for got, want in zip(jax.tree.leaves(whole.sampler), jax.tree.leaves(cut.sampler)):
    np.testing.assert_array_equal(got, want)
  for name in ("k", "v"):
    got, want, before = (np.asarray(getattr(s.cache, name), np.float32) for s in (whole, cut, start))
    np.testing.assert_array_equal(got[:, :b], want, err_msg=f"{name}: rows [0, {b})")
    np.testing.assert_array_equal(got[:, b:], before[:, b:], err_msg=f"{name}: rows [{b}, {n}) changed")
    # Not vacuous: the active rows appended their keys and values, the done row (1) wrote nothing.
    assert not np.array_equal(got[:, 0, :, 40], before[:, 0, :, 40]), name
    if b > 1:
      np.testing.assert_array_equal(got[:, 1], before[:, 1], err_msg=f"{name}: the done row")
  assert whole.pos.tolist() == [40 + STEPS, 9, 63 + STEPS][:b]


def test_a_cache_of_fewer_rows_than_the_state_is_refused():
  config, weights = _model("w8a16")
  state = jax.device_put(_state(config, 3, 3, False))
  short = dataclasses.replace(state, cache=dataclasses.replace(state.cache, k=state.cache.k[:, :2],
                                                               v=state.cache.v[:, :2]))
  with pytest.raises(ValueError, match=r"at least the state's B = 3 rows, got \(2, 2, 3, 96, 64\)"):
    decode_step(config, weights, short)

