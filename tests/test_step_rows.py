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
The server's decode call on 2 of its 4 slots (SlotPrograms.decode) then equals what it gave when it cut those
rows' cache out and wrote it back.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tiny import write_tiny_model

from jaxllm import Engine, GGUFFile
from jaxllm.cache import create_cache
from jaxllm.decode import MAX_EOG, NO_EOG, DecodeState, decode_step
from jaxllm.kernels import ffi
from jaxllm.load import default_dtype
from jaxllm.presets import preset
from jaxllm.sampling import Sampler, SamplingParams, full_mask
from jaxllm.serve import rows
from jaxllm.serve.slots import _ENGINE_MODE, FULL, GREEDY, WIDE, SlotPrograms
from jaxllm.weights import load_weights, random_weights

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


def _decode_rows_cutting_the_cache(step, count: int, k: int, masked: bool, wide: bool, weights, state, block):
  """serve.rows.decode_rows as it was until 2026-12-07: rows [0, count) of every per-row value and of the cache
  cut out of the state, stepped, and written back (two copies of those cache rows a call)."""
  s = state.sampler
  kept = (s.mask, s.bias_ids, s.bias_values)
  if not masked:
    state = rows._with_mask(state, None)
  cut = rows._with_wide(rows._by_row(lambda a, axis: jax.lax.slice_in_dim(a, 0, count, axis=axis), state), wide)
  if k == 1:
    cut = step(weights, cut)
    block = cut.tokens[None]
  else:
    cut, block = step(weights, cut, block)
  out = rows._put_rows(state, cut, 0)
  return (out if masked else rows._with_mask(out, *kept)), block


def test_server_decode_call_on_fewer_rows_equals_the_rows_cut_out(tmp_path):
  """4 slots, a greedy request in slot 0 and a sampled one under a token mask and logit biases in slot 1, the free
  slots 2 and 3 holding random cache rows and values: three decode calls on rows [0, 2) (greedy: 8 steps a call;
  masked: one step under the masks; sampled unmasked) give the tokens and the whole state, bit for bit, that the
  call cutting those rows' cache out and back gave, and leave rows 2 and 3 as they were."""
  gf = GGUFFile(write_tiny_model(tmp_path / "tiny.gguf", "qwen2", context=256))
  engine = Engine(gf.config, load_weights(gf, progress=False), None, max_context=128, prefill_chunk=32,
                  dtype=jnp.float32, cache_dtype=jnp.float32)
  v = gf.config.vocab_size
  programs = SlotPrograms(engine, 4)
  rng = np.random.default_rng(8)
  cache = programs.state.cache
  k, vv = (jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in (cache.k, cache.v))
  programs.state = dataclasses.replace(programs.state, cache=dataclasses.replace(cache, k=k, v=vv),
                                       tokens=jnp.asarray(rng.integers(0, v, 4), jnp.int32))
  mask = full_mask(1, v)[0] & rng.integers(0, 2 ** 32, full_mask(1, v).shape[1], dtype=np.uint32)
  jobs = [programs.plan(0, list(rng.integers(0, v, 40)), 0, SamplingParams(), 0, 120, ()),
          programs.plan(1, list(rng.integers(0, v, 9)), 0, SamplingParams(temperature=0.9, top_p=0.9, seed=4), 0,
                        120, (), mask=mask, bias={3: 5.0, 7: -100.0})]
  for job in jobs:
    while job.remaining > 1:
      programs.extend_step(job)
  programs.admit(programs.groups(jobs))
  masks = full_mask(4, v)
  masks[1] = mask
  programs.put_masks(masks)
  start = jax.device_get(programs.state)
  for mode, masked in ((GREEDY, False), (FULL, True), (FULL, False)):
    calls = programs._tokens_per_call(2, masked)
    programs.state = jax.device_put(start)
    got_tokens = [np.asarray(programs.decode(2, mode, masked)) for _ in range(3)]
    got = jax.device_get(programs.state)
    step, _, _ = engine.decode_program(2, _ENGINE_MODE[mode], calls, masked)
    old = jax.jit(functools.partial(_decode_rows_cutting_the_cache, step, 2, calls, masked, mode == WIDE),
                  donate_argnums=(1, 2))
    state, want_tokens = jax.device_put(start), []
    for _ in range(3):
      state, block = old(engine.weights, state, jnp.zeros((calls, 2), jnp.int32))
      want_tokens.append(np.asarray(block))
    want = jax.device_get(state)
    np.testing.assert_array_equal(np.stack(got_tokens), np.stack(want_tokens), err_msg=str((mode, masked)))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(a, b, err_msg=str((mode, masked)))
    for name in ("k", "v"):
      np.testing.assert_array_equal(getattr(got.cache, name)[:, 2:], getattr(start.cache, name)[:, 2:])
    assert (got.pos[:2] > start.pos[:2]).all() and (got.pos[2:] == start.pos[2:]).all(), (mode, masked)
    if masked:   # the row under the mask drew allowed tokens only
      drawn = np.stack(got_tokens)[:, 0, 1]
      assert all((mask[t // 32] >> (t % 32)) & 1 for t in drawn), drawn


@pytest.mark.skipif(ON_GPU, reason="reads the CPU's compiled program (on the GPU the batch-1 ffi step may be the fused "
                    "layers call, which takes the cache whole)")
def test_the_scanned_step_copies_only_its_rows_of_a_layer():
  """With scanned layers each layer's attention reads a copy of the layer's cache (the kernel takes a static
  layer): of the step's B rows, never of all N rows of the cache (a copy growing with the server's slots)."""
  config, weights = _model("w8a16")
  b, n = 1, 3
  state = jax.device_put(_state(config, b, n, False))
  step = jax.jit(functools.partial(decode_step, config, kernels="ffi", layers="scan", greedy_only=True,
                                   penalties=False), donate_argnums=1)
  hlo = step.lower(weights, state).compile().as_text()
  _, _, g, s, dh = state.cache.k.shape
  slices = [line for line in hlo.splitlines() if "dynamic-slice(" in line and f",{g},{s},{dh}]" in line]
  assert slices, "no slice of a layer's cache found: the test no longer sees the scanned attention's input"
  assert all(f"[1,{b},{g},{s},{dh}]" in line for line in slices), slices
