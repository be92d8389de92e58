"""The server's grouped admission: the last prefill chunks of several requests in one call (SlotPrograms.admit,
serve.rows.admit_rows), each row the same as its request admitted alone, the other rows untouched.

The tiny model in float32, 8 slots, prefill chunks of 64 tokens (buckets 16, 32, 64): the admit programs take 1, 2
or 4 requests of 16 tokens, 1 or 2 of 32, one of 64 (R x bucket at most a chunk).
"""
from __future__ import annotations

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tiny import write_tiny_model

from jaxllm import Engine, GGUFFile, SamplingParams
from jaxllm.serve.scheduler import Delta, Done, Request, Scheduler
from jaxllm.serve.slots import SlotPrograms
from jaxllm.weights import load_weights

SLOTS, CHUNK, CONTEXT = 8, 64, 192
F32 = dict(dtype=jnp.float32, cache_dtype=jnp.float32)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  gf = GGUFFile(write_tiny_model(tmp_path_factory.mktemp("admit") / "tiny.gguf", "qwen2", context=256))
  return gf.config, load_weights(gf, progress=False), gf


def _engine(model, tokenizer=None, chunk: int = CHUNK, context: int = CONTEXT) -> Engine:
  config, weights, _ = model
  return Engine(config, weights, tokenizer, max_context=context, prefill_chunk=chunk, **F32)


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
  return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def test_admit_sizes_and_how_ready_requests_are_grouped(model):
  engine = _engine(model)
  programs = SlotPrograms(engine, SLOTS, wide_top_k=True, admit_group=4)
  assert programs.buckets == [16, 32, 64]
  assert programs.admit_sizes == [(1, 16), (2, 16), (4, 16), (1, 32), (2, 32), (1, 64)]
  assert SlotPrograms(engine, SLOTS, admit_group=7).admit_sizes == programs.admit_sizes      # rounded down to 4
  assert SlotPrograms(engine, SLOTS, admit_group=1).admit_sizes == [(1, 16), (1, 32), (1, 64)]
  assert SlotPrograms(engine, 2, admit_group=8).admit_sizes == [(1, 16), (2, 16), (1, 32), (2, 32), (1, 64)]
  for bad in (0, -1, 2.0, True):
    with pytest.raises(ValueError, match="admit_group"):
      SlotPrograms(engine, SLOTS, admit_group=bad)

  v = engine.config.vocab_size
  wide = SamplingParams(temperature=1.0, top_k=200)

  def job(slot, n, params=SamplingParams()):
    return programs.plan(slot, _prompt(slot, n, v), 0, params, 0, CONTEXT, ())
  # Last-chunk buckets 16 16 16 16 | 16 32 | 16 | 64 | 16, a wide one of 16 among them: the wide one alone, then
  # four of 16, two (their largest bucket 32), the next two alone (a group with the 64 would be 128 tokens), the
  # last alone.
  jobs = [job(0, 3), job(1, 16), job(2, 1), job(3, 9), job(4, 5), job(5, 20), job(6, 2), job(7, 40)]
  jobs.insert(2, job(0, 4, wide))
  jobs.append(job(1, 8))
  groups = programs.groups(jobs)
  assert [[j.slot for j in g] for g in groups] == [[0], [0, 1, 2, 3], [4, 5], [6], [7], [1]]
  assert groups[0][0] is jobs[2] and groups[1][2] is jobs[3]
  assert [len(g) for g in programs.groups(jobs[3:6])] == [2, 1]          # no padding rows: 3 = 2 + 1
  # ADMIT_TOKENS caps a group's tokens below a large chunk: 1024 at most.
  big = SlotPrograms(_engine(model, chunk=4096, context=2048), SLOTS, admit_group=8)
  assert [(r, b) for r, b in big.admit_sizes if r > 1] == [(r, b) for b in (16, 32, 64, 128) for r in (2, 4, 8)] + \
      [(2, 256), (4, 256), (2, 512)]


def _tokens(firsts) -> list[int]:
  """SlotPrograms.admit's first tokens, each group's [R] array in turn, as one list."""
  return [int(t) for first in firsts for t in np.asarray(first)]


def _random_state(programs: SlotPrograms, seed: int):
  """The programs' state with every cache row random and distinct (what an admission must not touch)."""
  rng = np.random.default_rng(seed)
  cache = programs.state.cache
  k, v = (jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in (cache.k, cache.v))
  tokens = jnp.asarray(rng.integers(0, 100, programs.state.tokens.shape), jnp.int32)
  return dataclasses.replace(programs.state, cache=dataclasses.replace(cache, k=k, v=v), tokens=tokens)


def test_rows_admitted_together_equal_each_admitted_alone(model):
  """Four requests' last chunks in one call (slots 5, 0, 3, 6; one continuing after a full chunk, from position
  64): each admitted row (cache, first token, position, limit, sampler) equals its request admitted alone into
  the same state, and the four other rows stay exactly as they were."""
  engine = _engine(model)
  v = engine.config.vocab_size
  together, alone = SlotPrograms(engine, SLOTS, admit_group=4), SlotPrograms(engine, SLOTS, admit_group=1)
  start = jax.device_get(_random_state(together, 0))       # host arrays: each use puts a copy (calls donate it)
  specs = [(5, 12, SamplingParams()), (0, CHUNK + 9, SamplingParams(temperature=0.9, top_p=0.9, seed=11)),
           (3, 1, SamplingParams(repeat_penalty=1.3)), (6, 16, SamplingParams(temperature=1.2, seed=3))]

  def jobs(programs):
    out = [programs.plan(slot, _prompt(10 + slot, n, v), 0, params, 7, CONTEXT - 1 - slot, ())
           for slot, n, params in specs]
    for job in out:
      while job.remaining > 1:
        programs.extend_step(job)
    return out
  together.state = jax.device_put(start)
  both = jobs(together)
  groups = together.groups(both)
  assert [len(g) for g in groups] == [4]
  first = _tokens(together.admit(groups))
  got = jax.device_get(together.state)
  rows = [slot for slot, _, _ in specs]
  for i, (slot, _, _) in enumerate(specs):
    alone.state = jax.device_put(start)
    one = jobs(alone)[i]
    assert _tokens(alone.admit([[one]])) == [first[i]]
    want = jax.device_get(alone.state)
    np.testing.assert_allclose(got.cache.k[:, slot], want.cache.k[:, slot], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.cache.v[:, slot], want.cache.v[:, slot], rtol=1e-5, atol=1e-5)
    for name in ("tokens", "pos", "done", "limit", "eog"):
      np.testing.assert_array_equal(getattr(got, name)[slot], getattr(want, name)[slot], err_msg=name)
    for a, b in zip(jax.tree.leaves(got.sampler), jax.tree.leaves(want.sampler)):
      np.testing.assert_array_equal(a[slot], b[slot])
  assert got.pos[rows].tolist() == [12, CHUNK + 9, 1, 16] and not got.done[rows].any()
  before = start
  untouched = [s for s in range(SLOTS) if s not in rows]
  for name in ("k", "v"):
    np.testing.assert_array_equal(getattr(got.cache, name)[:, untouched], getattr(before.cache, name)[:, untouched])
  np.testing.assert_array_equal(got.tokens[untouched], before.tokens[untouched])


def test_a_burst_is_admitted_several_a_call_and_each_request_equals_alone(model):
  """Twelve requests submitted at once to 8 slots admitting up to 4 a call (prompts of 1-150 tokens: up to 3
  chunks; greedy, seeded sampling, penalties): admission calls of several requests happen, every request gives
  the tokens it gives alone (Engine.generate), and nothing compiles while serving."""
  config, weights, gf = model
  from jaxllm import Tokenizer
  tok = Tokenizer(gf.metadata)
  scheduler = Scheduler(_engine(model, tok), slots=SLOTS, admit_group=4)
  ref = _engine(model, tok)
  rng = np.random.default_rng(1)
  cases = []
  for i in range(12):
    n = int(rng.integers(1, 150)) if i % 3 == 0 else int(rng.integers(1, 30))
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95),
              SamplingParams(temperature=0.7, repeat_penalty=1.2, presence_penalty=0.5)][i % 3]
    cases.append((_prompt(100 + i, n, config.vocab_size), int(rng.integers(1, 12)), params, 1000 + i))
  events = [[] for _ in cases]
  finished = threading.Semaphore(0)

  def emit(i):
    def on(event):
      events[i].append(event)
      if isinstance(event, Done):
        finished.release()
    return on
  from jaxllm.serve.metrics import CompileCounter
  for i, (prompt, max_tokens, params, seed) in enumerate(cases):
    scheduler.submit(Request(prompt, max_tokens, emit(i), params, seed, ignore_eos=True))
  scheduler.start()                      # compiles every program, then takes the twelve at once
  ready = CompileCounter.count()
  try:
    for _ in cases:
      assert finished.acquire(timeout=120), "a request did not finish"
  finally:
    scheduler.stop()
  assert CompileCounter.count() == ready
  assert max(scheduler.metrics.admit_calls) > 1, scheduler.metrics.admit_calls
  assert sum(r * n for r, n in scheduler.metrics.admit_calls.items()) == len(cases)
  for (prompt, max_tokens, params, seed), got in zip(cases, events):
    ids = [t for e in got if isinstance(e, Delta) for t in e.ids]
    assert got[-1].finish_reason == "length" and ids == ref.generate(prompt, max_tokens, params, seed=seed,
                                                                      ignore_eos=True).ids


def test_a_turn_runs_about_one_chunk_of_prompt_tokens(model):
  """Scheduler._prefill, the device calls recorded: full chunks and last chunks count against one chunk's tokens a
  turn (64), first come first served, and the last chunks a turn reaches are admitted together. Every admit call
  is dispatched first; then each group's first tokens are read (waiting for that call only) and handed to its
  requests before the next group's are read."""
  from jaxllm.serve.scheduler import _Running
  scheduler = Scheduler(_engine(model), slots=SLOTS, admit_group=4)
  real, calls = scheduler.programs, []

  class First:                          # a group's first tokens on the "device": 100 + slot, reading recorded
    def __init__(self, slots):
      self.slots = slots

    def __array__(self, dtype=None, copy=None):
      calls.append(("read", self.slots))
      return np.asarray([100 + s for s in self.slots], np.int32)

  class Recording:                      # the programs' planning, the device calls recorded instead of run
    groups = real.groups

    def extend_step(self, job):
      calls.append(("extend", job.slot, job.chunks.pop(0)[1]))

    def admit(self, groups):
      calls.append(("admit", [[job.slot for job in group] for group in groups]))
      for job in (job for group in groups for job in group):
        job.chunks.pop(0)
      return [First([job.slot for job in group]) for group in groups]
  scheduler.programs = Recording()
  scheduler._admitted = lambda run, token: calls.append(("first", scheduler._running.index(run), token))
  v = scheduler.engine.config.vocab_size
  for slot, n in enumerate([150, 30, 30, 30, 10]):   # chunks: 64 64 22 | 30 | 30 | 30 | 10
    job = real.plan(slot, _prompt(slot, n, v), 0, SamplingParams(), 0, CONTEXT - 1, ())
    scheduler._running[slot] = _Running(Request(job.chunks[0][0][0].tolist(), 4, lambda e: None), None, job, 0)
  turns = []
  for _ in range(4):
    calls.clear()
    scheduler._prefill()
    turns.append(list(calls))
  assert turns == [[("extend", 0, 64)], [("extend", 0, 64)],
                   [("admit", [[0, 1], [2]]), ("read", [0, 1]), ("first", 0, 100), ("first", 1, 101),
                    ("read", [2]), ("first", 2, 102)],
                   [("admit", [[3, 4]]), ("read", [3, 4]), ("first", 3, 103), ("first", 4, 104)]]
  assert scheduler.metrics.admit_calls == {2: 2, 1: 1}


class _Allowed:
  """A stand-in for a grammar's Constraint: the same token mask every step (ids 40-49), never complete."""

  def __init__(self, vocab: int):
    from jaxllm.sampling import mask_words
    bits = np.zeros((1, mask_words(vocab) * 32), bool)
    bits[0, 40:50] = True
    self.mask = np.packbits(bits, axis=1, bitorder="little").view("<u4").astype(np.uint32)[0]
    self.complete, self.error = False, None

  def advance(self, token: int) -> None:
    assert 40 <= token < 50


def _assert_same_events(got: list, want: list, name: str) -> None:
  """The same events: texts, ids, finish reasons and counts exactly; log-probabilities (a row's cache computed in a
  batch of 4 or alone: f32 rounding apart) to 1e-5, with the same alternatives."""
  assert [type(e) for e in got] == [type(e) for e in want], name
  for g, w in zip(got, want):
    if isinstance(g, Done):
      assert g == w, name
      continue
    assert (g.text, g.ids) == (w.text, w.ids), name
    for field in ("logprobs", "prompt_logprobs"):
      a, b = getattr(g, field), getattr(w, field)
      assert (a is None) == (b is None), (name, field)
      for (lp_a, top_a), (lp_b, top_b) in zip(a or [], b or []):
        assert [i for i, _ in top_a] == [i for i, _ in top_b], (name, field)
        np.testing.assert_allclose([lp_a] + [x for _, x in top_a], [lp_b] + [x for _, x in top_b], atol=1e-5)
      assert len(a or []) == len(b or []), (name, field)


def test_a_mixed_turn_admitted_in_groups_gives_what_one_a_call_gives(model):
  """One turn's requests of every kind (max_tokens 0 with the prompt's logprobs, logprobs, one token, a grammar's
  mask, a logit bias, two continuing from a slot's cache, a wide top_k): each request's events with 4 a call are
  its events with 1 a call, nothing compiles while serving, and the reused prefixes are the same."""
  from jaxllm import Tokenizer
  from jaxllm.serve.metrics import CompileCounter
  config, _, gf = model
  engine = _engine(model, Tokenizer(gf.metadata))       # one engine: the second scheduler's programs are compiled
  v = config.vocab_size
  base = _prompt(1, 40, v)

  def run(group: int):
    scheduler = Scheduler(engine, slots=SLOTS, admit_group=group, wide_top_k=True)
    events, finished = {}, threading.Semaphore(0)

    def submit(name, request):
      def on(event):
        events.setdefault(name, []).append(event)
        if isinstance(event, Done):
          finished.release()
      request.emit = on
      scheduler.submit(request)
    scheduler.start()
    ready = CompileCounter.count()
    try:
      for i in range(3):                     # slots whose caches hold prefixes of the next turn's prompts
        submit(f"history{i}", Request(base[:20 + i] + _prompt(50 + i, 5, v), 3, None, ignore_eos=True))
      for _ in range(3):
        assert finished.acquire(timeout=120)
      mixed = {
          "scored": Request(_prompt(2, 9, v), 0, None, prompt_logprobs=True, logprobs=2),
          "logprobs": Request(_prompt(3, 12, v), 4, None, SamplingParams(temperature=0.8), 9, prompt_logprobs=True,
                              logprobs=3, ignore_eos=True),
          "one": Request(_prompt(4, 5, v), 1, None, ignore_eos=True),
          "grammar": Request(_prompt(5, 7, v), 6, None, SamplingParams(temperature=1.0), 3,
                             constraint=_Allowed(v), ignore_eos=True),
          "bias": Request(_prompt(6, 3, v), 5, None, logit_bias={7: 100.0}, ignore_eos=True),
          "reuse0": Request(base[:22] + _prompt(60, 3, v), 5, None, ignore_eos=True),
          "reuse1": Request(base[:21] + _prompt(61, 8, v), 5, None, SamplingParams(temperature=0.7, repeat_penalty=1.3),
                            4, ignore_eos=True),
          "wide": Request(_prompt(7, 6, v), 4, None, SamplingParams(temperature=1.0, top_k=200), 8, ignore_eos=True),
      }
      for name, request in mixed.items():
        submit(name, request)
      for _ in mixed:
        assert finished.acquire(timeout=120)
    finally:
      scheduler.stop()
    assert CompileCounter.count() == ready
    return events, dict(scheduler.metrics.admit_calls), scheduler.metrics.reused_tokens

  grouped, calls4, reused4 = run(4)
  alone, calls1, reused1 = run(1)
  assert max(calls4) > 1 and set(calls1) == {1} and reused4 == reused1 > 0
  assert grouped.keys() == alone.keys()
  for name in grouped:
    _assert_same_events(grouped[name], alone[name], name)
  assert all(40 <= t < 50 for e in grouped["grammar"] if isinstance(e, Delta) for t in e.ids)
  assert [t for e in grouped["bias"] if isinstance(e, Delta) for t in e.ids] == [7] * 5
