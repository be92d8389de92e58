"""Chunked prefill equals one-shot prefill; prefill from a nonzero start appends to the cache; the engine
reuses the cache of an earlier turn; the context-limit contract holds on every kernel path."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxllm
from jaxllm import Engine, Sampler, SamplingParams, create_cache, extend, sequence_logits
from jaxllm.kernels import prefill_attention_blocked, prefill_attention_reference
from tiny import numpy_forward

CHUNK = 16
ON_GPU = jax.default_backend() == "gpu"


@pytest.fixture(autouse=True)
def _exact_on_gpu():
  """The equalities below hold to float32 rounding: on the GPU run them in f32 with full-precision dots
  (XLA's GPU dots default to TF32 for f32, and the engine to bf16)."""
  with jax.default_matmul_precision("highest"):
    yield


F32 = dict(dtype=jnp.float32)


def _rel(a, b):
  return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model(request, tiny_models):
  config, weights, tok = jaxllm.load(tiny_models[request.param], quant="none", dtype=jnp.float32, progress=False)
  return tiny_models[request.param], config, weights, tok


@functools.cache
def _logits_fn(config):
  """sequence_logits compiled (run op by op, each op of the forward compiled by itself for each new length: 25 s a
  case on the GPU suite's H100), one function a model, so that a length compiled once serves every test."""
  return jax.jit(lambda w, c, t, p: sequence_logits(config, w, c, t, p))


def _one_shot_logits(config, weights, tokens, s=128):
  """All tokens in one sequence_logits call."""
  cache = create_cache(config, 1, s, jnp.float32)
  out, _ = _logits_fn(config)(weights, cache, np.asarray([tokens], np.int32), np.zeros((1,), np.int32))
  return np.asarray(out[0])


def _chunked_logits(config, weights, tokens, start_tokens=(), s=128):
  """Logits of `tokens` run in chunks of CHUNK after `start_tokens` (also run in chunks), each chunk one
  sequence_logits call from its start position: every chunk attends to the cache the earlier ones wrote."""
  cache = create_cache(config, 1, s, jnp.float32)
  step = _logits_fn(config)
  rows, pos = [], 0
  for seq, keep in ((list(start_tokens), False), (list(tokens), True)):
    for i in range(0, len(seq), CHUNK):
      piece = seq[i:i + CHUNK]
      out, cache = step(weights, cache, np.asarray([piece], np.int32), np.asarray([pos], np.int32))
      pos += len(piece)
      if keep:
        rows.append(np.asarray(out[0]))
  return np.concatenate(rows)


@pytest.mark.parametrize("n", [1, CHUNK - 1, CHUNK, CHUNK + 1, int(3.5 * CHUNK)])
def test_chunked_equals_one_shot(model, n):
  _, config, weights, _ = model
  rng = np.random.default_rng(n)
  tokens = [int(t) for t in rng.integers(0, config.vocab_size, n)]
  full = _one_shot_logits(config, weights, tokens)
  assert _rel(_chunked_logits(config, weights, tokens), full) < 1e-5


@pytest.mark.parametrize("n", [1, CHUNK + 1, int(3.5 * CHUNK)])
def test_prefill_from_a_nonzero_start(model, n):
  """Tokens run from start 13 after 13 earlier ones equal running all of them at once."""
  path, config, weights, _ = model
  rng = np.random.default_rng(100 + n)
  before = [int(t) for t in rng.integers(0, config.vocab_size, 13)]
  tokens = [int(t) for t in rng.integers(0, config.vocab_size, n)]
  got = _chunked_logits(config, weights, tokens, before)
  assert _rel(got, _one_shot_logits(config, weights, before + tokens)[13:]) < 1e-5
  assert _rel(got, numpy_forward(path, before + tokens)[13:]) < 1e-5


def test_extend_carries_each_rows_last_hidden(model):
  """Rows of different lengths: extend returns each row's hidden state at its own last token, and keeps
  the carried one for a row with no tokens in this chunk."""
  _, config, weights, _ = model
  cache = create_cache(config, 3, 64, jnp.float32)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (3, 8)), jnp.int32)
  carried = jnp.full((3, config.d_model), 7.0)
  lengths = jnp.asarray([8, 3, 0], jnp.int32)
  _, last = extend(config, weights, cache, tokens, lengths, jnp.zeros((3,), jnp.int32), carried)
  from jaxllm.model import forward
  hidden, _ = forward(config, weights, create_cache(config, 3, 64, jnp.float32), tokens, jnp.zeros((3,), jnp.int32))
  np.testing.assert_allclose(np.asarray(last[0]), np.asarray(hidden[0, 7]), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(last[1]), np.asarray(hidden[1, 2]), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(last[2]), 7.0)


@pytest.mark.parametrize("kernels", ["xla", "ffi"])
def test_engine_chunked_prefill_equals_one_chunk(model, kernels):
  """The engine's chunked prefill (chunk 32, prompt 3.5 chunks) gives the tokens one big chunk gives."""
  _, config, weights, tok = model
  prompt = [int(t) for t in np.random.default_rng(5).integers(0, config.vocab_size, 112)]
  small = Engine(config, weights, tok, max_context=160, kernels=kernels, prefill_chunk=32, **F32)
  big = Engine(config, weights, tok, max_context=160, kernels=kernels, prefill_chunk=128, **F32)
  a = small.generate(prompt, 12, ignore_eos=True)
  assert a.ids == big.generate(prompt, 12, ignore_eos=True).ids
  assert [k for k in small.executables() if k[0] == "extend"] == [("extend", 1, 32)]
  assert ("prefill", 1, 16, True) in small.executables()          # the last 16 tokens: a bucket of 16 < 32
  rs = small.generate_batch([prompt, prompt[:20], prompt[:3]], 6, ignore_eos=True)
  assert [r.ids for r in rs] == [small.generate(p, 6, ignore_eos=True).ids for p in (prompt, prompt[:20], prompt[:3])]


def test_reuse_cache_prefills_only_the_new_tokens(model):
  """A second turn that starts with the first turn's prompt and answer reuses their keys, and its output
  equals a run of the whole history from scratch."""
  _, config, weights, tok = model
  engine = Engine(config, weights, tok, max_context=160, prefill_chunk=CHUNK, **F32)
  turn1 = [int(t) for t in np.random.default_rng(9).integers(0, config.vocab_size, 40)]
  first = engine.generate(turn1, 10, ignore_eos=True, reuse_cache=True)
  assert first.reused_tokens == 0
  turn2 = turn1 + first.ids + [5, 6, 7, 8, 9]
  second = engine.generate(turn2, 10, ignore_eos=True, reuse_cache=True)
  assert second.reused_tokens == len(turn1) + len(first.ids) - 1    # the last answer token was never written
  fresh = Engine(config, weights, tok, max_context=160, prefill_chunk=CHUNK, **F32).generate(turn2, 10,
                                                                                             ignore_eos=True)
  assert second.ids == fresh.ids
  third = engine.generate([1, 2, 3] + turn2, 4, ignore_eos=True, reuse_cache=True)   # no common prefix
  assert third.reused_tokens == 0


def test_blocked_prefill_attention_matches_reference():
  rng = np.random.default_rng(0)
  for (b, t, h, g, s, d), starts, block in [((2, 37, 4, 2, 300, 16), [0, 200], 64), ((1, 5, 6, 3, 9, 8), [4], 4),
                                            ((3, 16, 2, 1, 40, 32), [0, 24, 30], 512)]:
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, b, g, s, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, b, g, s, d)), jnp.float32)
    st = jnp.asarray(starts, jnp.int32)
    ref = prefill_attention_reference(q, k, v, 1, st)
    got = prefill_attention_blocked(q, k, v, 1, st, block=block)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


# ---- the context-limit contract --------------------------------------------------------------------

@pytest.mark.parametrize("kernels", ["xla", "ffi"])
def test_full_sequence_stops_advancing_on_every_path(tiny_models, kernels):
  """max_context 32, prompts of 30 and 2 tokens, 20 new tokens: (context, length), never an error."""
  config, weights, tok = jaxllm.load(tiny_models["qwen2"], progress=False, **F32)
  engine = Engine(config, weights, tok, max_context=32, kernels=kernels, **F32)
  prompts = [list(range(3, 33)), [5, 6]]
  got = engine.generate_batch(prompts, 20, ignore_eos=True)
  assert [(r.finish_reason, len(r.ids)) for r in got] == [("context", 3), ("length", 20)]
  assert [r.ids for r in got] == [r.ids for r in Engine(config, weights, tok, max_context=32, kernels="xla", **F32)
                                  .generate_batch(prompts, 20, ignore_eos=True)]


def test_done_rows_write_nothing_past_the_cache(tiny_models):
  """Driving decode_step past the end: the full row stops (pos, token, cache unchanged), the other goes on."""
  config, weights, _ = jaxllm.load(tiny_models["llama"], progress=False, **F32)
  s = 12
  tokens = jnp.asarray([[1] * 10, [2, 3] + [0] * 8], jnp.int32)
  state = jaxllm.prefill(config, weights, create_cache(config, 2, s), tokens, jnp.asarray([10, 2], jnp.int32),
                         Sampler.create(SamplingParams(), 2))
  step = jax.jit(lambda st: jaxllm.decode_step(config, weights, st))
  for _ in range(2):
    state = step(state)
  assert np.asarray(state.pos).tolist() == [12, 4] and np.asarray(state.done).tolist() == [True, False]
  frozen = (np.asarray(state.cache.k), np.asarray(state.tokens)[0])
  for _ in range(5):
    state = step(state)
  assert np.asarray(state.pos).tolist() == [12, 9]
  np.testing.assert_array_equal(np.asarray(state.cache.k)[:, 0], frozen[0][:, 0])   # row 0 untouched
  assert int(state.tokens[0]) == frozen[1]


def test_limit_and_eog_stop_rows_on_the_device(tiny_models):
  config, weights, tok = jaxllm.load(tiny_models["qwen2"], progress=False, **F32)
  tokens = jnp.asarray([[5, 6, 7], [8, 9, 10]], jnp.int32)
  state = jaxllm.prefill(config, weights, create_cache(config, 2, 64), tokens, jnp.asarray([3, 3], jnp.int32),
                         Sampler.create(SamplingParams(), 2), limit=jnp.asarray([5, 64], jnp.int32))
  first = int(state.tokens[1])
  eog = jaxllm.eog_table([first], 2)                  # row 1's first token ends it at once
  state2 = jaxllm.prefill(config, weights, create_cache(config, 2, 64), tokens, jnp.asarray([3, 3], jnp.int32),
                          Sampler.create(SamplingParams(), 2), eog=jnp.asarray(eog))
  assert bool(state2.done[1])
  for _ in range(4):
    state = jaxllm.decode_step(config, weights, state)
  assert np.asarray(state.pos).tolist() == [5, 7] and np.asarray(state.done).tolist() == [True, False]


def test_nonfinite_logits_end_a_sequence_with_an_error(tiny_models):
  config, weights, tok = jaxllm.load(tiny_models["qwen2"], progress=False, **F32)
  import dataclasses
  bad = dataclasses.replace(weights, out_norm=weights.out_norm.at[3].set(jnp.nan))
  for kernels in ("xla", "ffi"):
    r = Engine(config, bad, tok, max_context=32, kernels=kernels, **F32).generate([5, 6, 7], 5, ignore_eos=True)
    assert r.finish_reason == "error" and "not finite" in r.error and r.ids == []


def test_sampling_settings_do_not_recompile(tiny_models):
  """Requests with other sampling settings run on the executables the first one compiled; penalties, which
  the sampled step leaves out while no row has one, compile one more step once, which then serves every
  penalized setting."""
  config, weights, tok = jaxllm.load(tiny_models["llama"], progress=False, **F32)
  engine = Engine(config, weights, tok, max_context=64, **F32)
  p1 = SamplingParams(temperature=0.7, top_p=0.9, seed=1)
  p2 = SamplingParams(temperature=1.2, top_k=20, min_p=0.05, seed=2)
  pen1 = SamplingParams(temperature=1.2, top_k=20, min_p=0.05, repeat_penalty=1.3, presence_penalty=0.5, seed=2)
  pen2 = SamplingParams(temperature=0.9, top_p=0.8, frequency_penalty=0.3, seed=3)
  engine.generate([5, 6, 7], 8, p1, ignore_eos=True)
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, secs, **kw: compiles.append(event) if "backend_compile" in event else None)

  def run_without_compiling(prompt, params):
    before, n = engine.executables(), len(compiles)
    out = engine.generate(prompt, 8, params, ignore_eos=True)
    assert engine.executables() == before and len(compiles) == n, (before, engine.executables(), compiles)
    assert len(out.ids) == 8
    return out

  run_without_compiling([9, 10, 11, 12], p2)
  before = engine.executables()
  engine.generate([9, 10, 11, 12], 8, pen1, ignore_eos=True)
  assert len(engine.executables()) > len(before)        # the penalized step, once
  run_without_compiling([9, 10, 11, 12], pen2)
  mixed = engine.generate_batch([[5, 6, 7], [9, 10]], 8, [p1, pen1], ignore_eos=True)
  assert mixed[0].ids == run_without_compiling([5, 6, 7], p1).ids   # a row's draw: the same in either step
