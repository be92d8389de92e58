"""The scheduler: one thread that owns the slots and the batch, fed by a bounded queue of requests.

Requests arrive from any thread (Scheduler.submit; the HTTP layer's event loop); the engine thread alone runs
device programs. Each turn of its loop:

  1. takes new requests from the inbox (a full queue refuses them at submit: QueueFull), drops cancelled ones;
  2. gives free slots to waiting requests, first come first served; a request takes the free slot whose cache
     holds the longest prefix of its prompt (the same system prompt, the earlier turns of a chat), and only the
     rest is prefilled (prefix reuse). Busy slots are kept packed as the first rows of the batch (a slot taken
     or freed out of place is swapped with the boundary row, its cache and history with it), so that a decode
     call runs only as many rows as are busy (rounded up to a compiled row count);
  3. runs prefill chunks (slots.SlotPrograms), about one chunk's tokens a turn, so a long prompt
     joins over several turns while the other slots keep decoding; the last chunks reached in a turn run
     together, several requests a call (SlotPrograms.admit), and each such request has its first token and
     decodes from the next call on;
  4. dispatches one decode call (K steps) for the busy slots, then hands each request its tokens from the
     call before (pipelined: the device runs call i+1 while the host reads call i's tokens, detokenizes them
     and answers; each call remembers which request held each row when it was dispatched, so rows freed or
     moved since are read right). A request that ends (end of generation, its token limit, a stop string,
     non-finite logits) or whose client has gone frees its slot at once. A row its request left before the
     device saw it end may go on decoding while it lies inside a call's rows: it writes only into its own row,
     past what the slot's history records, and its tokens are dropped.

Structured output: a request under a grammar (Request.constraint, jaxllm.structured) draws its first token under
its grammar's mask (admit_rows) and gives each token it draws to its Constraint. While such a request decodes,
nothing runs ahead: the turn reads the call in flight first, writes every row's next mask (put_masks; every token
for rows without a grammar) and dispatches the masked program of one step. A request whose grammar is complete
ends with "stop". With no such request decoding, the calls are the engine's own, pipelined, as above.
A request with logit biases (Request.logit_bias) has them written into its row at admission; while it decodes
the calls are the masked program too (which applies them), pipelined unless a grammar's row decodes beside it;
the masks are written then only where a grammar's may still be on the device (_masks_full).

What a request receives (its `emit` callback, on the engine thread): Delta events with the text that became
final and the token ids, then one Done event with the finish reason and token counts. The engine below knows
nothing of HTTP.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import queue
import sys
import threading
import time
import traceback
from typing import Any, Callable, Sequence

import numpy as np

from jaxllm.device_memory import explain, out_of_memory
from jaxllm.sampling import SamplingParams, full_mask
from jaxllm.serve.metrics import CompileCounter, Metrics
from jaxllm.serve.slots import FULL, GREEDY, WIDE, Prefill, SlotPrograms
from jaxllm.structured import GrammarCompiler
from jaxllm.text import SequenceOutput


class QueueFull(RuntimeError):
  """The scheduler's waiting queue is full: retry after `retry_after` seconds."""

  def __init__(self, waiting: int, retry_after: int, limit: int):
    said = f"{waiting} request is" if waiting == 1 else f"{waiting} requests are"
    super().__init__(f"the server is busy: {said} already waiting for a slot (at most {max(limit, 0)}); retry later")
    self.retry_after = retry_after


@dataclasses.dataclass
class Delta:
  """New output of a request: the text that became final (may be empty) and the new token ids; with
  Request.logprobs, per new id (log-probability, [(id, log-probability)] best first); with
  Request.prompt_logprobs, once before any token, the same for prompt tokens 1, 2, ... (token 0 has none)."""
  text: str
  ids: list[int]
  logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
  prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclasses.dataclass
class Done:
  """A request's end. finish_reason: "stop" (end of generation or a stop string), "length" (max_tokens or the
  context), "error" (non-finite logits or a failure: `error` says which), "cancelled" (client gone or shutdown)."""
  finish_reason: str
  prompt_tokens: int
  completion_tokens: int
  reused_tokens: int = 0
  error: str | None = None


@dataclasses.dataclass(eq=False)
class Request:
  """One sequence to generate: a prompt's ids and how to sample and stop. `emit` receives Delta and Done events
  on the engine thread and must not block. logprobs: None, or how many alternatives (0-20) to report with each
  new token's log-probability; prompt_logprobs: report the prompt's too. max_tokens 0 (with prompt_logprobs)
  scores the prompt and generates nothing."""
  prompt: list[int]
  max_tokens: int
  emit: Callable[[Delta | Done], None]
  params: SamplingParams = SamplingParams()
  seed: int = 0
  stop: Sequence[str] = ()
  ignore_eos: bool = False
  logprobs: int | None = None
  prompt_logprobs: bool = False
  constraint: Any = None               # a jaxllm.structured.Constraint: the output follows its grammar
  logit_bias: dict[int, float] | None = None   # {token id: bias in [-100, 100]} added to the logits
  id: int = dataclasses.field(default_factory=itertools.count().__next__)
  submitted: float = dataclasses.field(default_factory=time.perf_counter)
  cancelled: bool = False


@dataclasses.dataclass(eq=False)
class _Running:
  """A request in a slot: prefilling (job set) or decoding."""
  request: Request
  output: SequenceOutput
  job: Prefill | None
  reused: int
  generated: list[int] = dataclasses.field(default_factory=list)   # every token sampled, the last EOS included
  first: float | None = None


_FINISH = {"eos": "stop", "stop": "stop", "grammar": "stop", "length": "length", "context": "length",
           "error": "error"}


class Scheduler:
  """Continuous batching over SlotPrograms: `slots` requests decode together; up to `max_waiting` wait.

  Args:
    engine: a loaded jaxllm Engine (its max_context is each slot's context).
    slots: N, requests decoded at once (the batch of the one decode step).
    max_waiting: requests queued beyond the slots before submit refuses (QueueFull).
    prefix_reuse: continue from a free slot's cache when it holds the start of the prompt.
    wide_top_k: take requests whose top_k is above sampling.MAX_TOP_K (compiles the wide step's programs
      too: start-up takes longer; a batch with such a request decodes in them, sorting the vocabulary).
    admit_group: requests whose last prefill chunks one call runs at most (SlotPrograms; None:
      slots.ADMIT_GROUP).
  """

  def __init__(self, engine, slots: int = 4, max_waiting: int = 64, prefix_reuse: bool = True,
               metrics: Metrics | None = None, wide_top_k: bool = False, admit_group: int | None = None):
    if not isinstance(max_waiting, int) or max_waiting < 0:
      raise ValueError(f"max_waiting must be an integer >= 0, got {max_waiting!r}")
    self.engine, self.max_waiting, self.prefix_reuse = engine, max_waiting, prefix_reuse
    self.programs = SlotPrograms(engine, slots, wide_top_k, admit_group)
    self.slots = slots
    self.metrics = metrics or Metrics()
    CompileCounter.count()                 # installs the counter: start-up's compiles are counted too
    self.metrics.slots_total = slots
    self._inbox: queue.SimpleQueue = queue.SimpleQueue()
    self._queued = 0                       # submitted and not yet in a slot (inbox + waiting)
    self._masks_full = True                # the device's token masks allow every token in every row
    self._lock = threading.Lock()
    self._waiting: collections.deque[Request] = collections.deque()
    self._running: list[_Running | None] = [None] * slots
    self._history: list[list[int]] = [[] for _ in range(slots)]    # per slot: the tokens its cache holds
    self._used: list[float] = [0.0] * slots                         # per slot: when it was last freed
    self._stop = threading.Event()
    self._dead: str | None = None          # why the engine thread stopped on its own (_failed_turn), for submit
    self._thread: threading.Thread | None = None
    # The decode call in flight: its tokens (on their way to the host) and the request of each row at dispatch.
    self._pending: tuple | None = None
    self.tokenizer = engine.tokenizer
    # Grammars over the model's vocabulary (response_format); None, with the reason, where they cannot be made.
    self.grammars: GrammarCompiler | None = None
    self.grammars_error: str | None = "the model has no tokenizer" if engine.tokenizer is None else None
    try:
      if engine.tokenizer is not None:
        self.grammars = GrammarCompiler(engine.tokenizer, engine.config.vocab_size)
    except (ImportError, ValueError) as e:
      self.grammars_error = str(e)

  # ---- any thread ----------------------------------------------------------------------------

  def start(self) -> None:
    """Compiles every program serving runs, then starts the engine thread."""
    self.programs.warmup()
    self._thread = threading.Thread(target=self._loop, name="jaxllm-scheduler", daemon=True)
    self._thread.start()

  def submit(self, request: Request) -> None:
    """Queues a request; raises QueueFull when max_waiting requests already wait for a slot, ValueError for a
    top_k above MAX_TOP_K where the scheduler was made without wide_top_k."""
    if self._stop.is_set():
      raise RuntimeError(self._dead or "the server is shutting down")
    self.programs.check(request.params)
    with self._lock:
      free = self._free_slots()           # queued requests up to the free slots are about to take one
      if self._queued >= self.max_waiting + free:
        raise QueueFull(max(self._queued - free, 0), retry_after=max(1, self._queued // max(self.slots, 1)),
                        limit=self.max_waiting)
      self._queued += 1
    self.metrics.waiting = self._queued
    self._inbox.put(request)

  def cancel(self, request: Request) -> None:
    """Ends a request (its client has gone): its slot is freed at the engine thread's next turn."""
    request.cancelled = True
    self._inbox.put(None)

  def stop(self, timeout: float = 30.0) -> None:
    """Cancels every request in flight (each gets Done "cancelled") and ends the engine thread."""
    self._stop.set()
    self._inbox.put(None)
    if self._thread is not None:
      self._thread.join(timeout)

  def _free_slots(self) -> int:
    return sum(r is None for r in self._running)

  # ---- the engine thread ---------------------------------------------------------------------

  def _loop(self) -> None:
    while not self._stop.is_set():
      busy = any(r is not None for r in self._running) or self._waiting or self._pending is not None
      self._take_inbox(block=not busy)
      if self._stop.is_set():
        break
      try:
        self._turn()
      except Exception as e:  # a failed program: its requests end with the error, the server goes on
        self._failed_turn(e)
    self._fail_all(self._dead or "the server is shutting down", reason="cancelled")
    while True:
      try:
        item = self._inbox.get_nowait()
      except queue.Empty:
        break
      if item is not None:
        item.emit(Done("cancelled", len(item.prompt), 0, error="the server is shutting down"))

  def _failed_turn(self, error: Exception) -> None:
    """A program failed: its requests end with the error (the device out of memory as one line, jaxllm.device_memory;
    anything else with its traceback on stderr) and the slots' state is made anew. Where even that fails (the
    device still full), the engine thread stops, and every later submit raises why (the app answers 503)."""
    if out_of_memory(error):
      error = explain(error)
      print(f"[jaxllm] error: {error}", file=sys.stderr, flush=True)
    else:
      traceback.print_exc(file=sys.stderr)
    try:
      self._fail_all(f"{type(error).__name__}: {error}".splitlines()[0][:300])
    except Exception as again:  # no new state: the requests have ended, the server cannot serve more
      again = explain(again) if out_of_memory(again) else again
      self._dead = f"the server's engine stopped: {type(again).__name__}: {again}".splitlines()[0][:400]
      print(f"[jaxllm] error: {self._dead}", file=sys.stderr, flush=True)
      self._stop.set()

  def _take_inbox(self, block: bool) -> None:
    try:
      item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
      while True:
        if item is not None:
          self._waiting.append(item)
        item = self._inbox.get_nowait()
    except queue.Empty:
      pass

  def _turn(self) -> None:
    self._drop_cancelled()
    self._admit()
    self._prefill()
    previous, self._pending = self._pending, None
    if previous is not None and self._constrained():
      # A row under a grammar needs the call in flight's tokens for its next mask: nothing runs ahead.
      self._collect(*previous)
      previous = None
    if any(r is not None and r.job is None for r in self._running):
      self._pending = self._dispatch()
    if previous is not None:
      self._collect(*previous)
    self._update_gauges()

  def _update_gauges(self) -> None:
    m = self.metrics
    m.running = sum(r is not None for r in self._running)
    m.slots_used = m.running
    m.waiting = self._queued

  def _dequeued(self) -> None:
    """A request left the queue (for a slot, or cancelled)."""
    with self._lock:
      self._queued -= 1

  def _drop_cancelled(self) -> None:
    for request in [r for r in self._waiting if r.cancelled]:
      self._waiting.remove(request)
      self._dequeued()
      self._finish_request(request, Done("cancelled", len(request.prompt), 0))
    for run in [r for r in self._running if r is not None and r.request.cancelled]:
      self._release(run, Done("cancelled", len(run.request.prompt), len(run.generated), run.reused))

  def _reusable(self, slot: int, prompt: Sequence[int]) -> int:
    n = 0
    for a, b in zip(self._history[slot], prompt):
      if a != b:
        break
      n += 1
    return min(n, len(prompt) - 1)

  def _admit(self) -> None:
    while self._waiting and self._free_slots():
      request = self._waiting.popleft()
      self._dequeued()
      busy = self._busy()
      free = range(busy, self.slots)
      reuse = {s: self._reusable(s, request.prompt) if self.prefix_reuse else 0 for s in free}
      best = max(free, key=lambda s: (reuse[s], -self._used[s]))
      start, slot = reuse[best], busy
      self._swap(best, slot)
      self._history[slot] = []                        # being rewritten
      p = request.prompt
      limit = min(self.engine.max_context, len(p) + request.max_tokens - 1)
      eog = () if request.ignore_eos or self.tokenizer is None else self.tokenizer.eog_ids
      mask = None if request.constraint is None else request.constraint.mask
      self._masks_full = self._masks_full and mask is None      # admission writes the row's first mask
      try:
        job = self.programs.plan(slot, p, start, request.params, request.seed, limit, eog, mask, request.logit_bias)
      except Exception as e:   # values the programs refuse (past the HTTP checks): this request ends, the rest go on
        self._finish_request(request, Done("error", len(p), 0, error=f"{type(e).__name__}: {e}".splitlines()[0][:300]))
        continue
      out = SequenceOutput(list(p), min(request.max_tokens, self.engine.max_context - len(p) + 1),
                           request.max_tokens, self.tokenizer, request.stop, frozenset(eog))
      self._running[slot] = _Running(request, out, job, start)
      self.metrics.prompt_tokens += len(p)
      self.metrics.reused_tokens += start

  def _prefill(self) -> None:
    """Runs prefill chunks, first come first served, until about one chunk's tokens have run this turn: full
    chunks one a call, then the last chunks reached this turn together (SlotPrograms.admit: several requests a
    call, every call dispatched first); each group's requests then have their first tokens as soon as the group's
    call is done, while the later groups' calls run."""
    budget = self.engine.prefill_chunk
    jobs = sorted((r for r in self._running if r is not None and r.job is not None), key=lambda r: r.request.id)
    ready = []
    for run in jobs:
      while run.job.remaining > 1 and budget > 0:
        budget -= run.job.chunks[0][1]
        self.programs.extend_step(run.job)
      if run.job.remaining > 1 or budget <= 0:
        break
      budget -= run.job.chunks[0][1]
      ready.append(run)
    if not ready:
      return
    groups = self.programs.groups([run.job for run in ready])   # first come first served, wide ones first
    runs = {id(run.job): run for run in ready}
    for group, first in zip(groups, self.programs.admit(groups)):
      self.metrics.admit_calls[len(group)] = self.metrics.admit_calls.get(len(group), 0) + 1
      for job, token in zip(group, np.asarray(first).tolist()):   # waits for this group's call only
        run = runs[id(job)]
        run.job = None
        self._admitted(run, token)

  def _constrained(self) -> bool:
    """Whether some decoding request has a grammar."""
    return any(r is not None and r.job is None and r.request.constraint is not None for r in self._running)

  def _dispatch(self) -> tuple:
    """Dispatches a decode call for the busy rows: (its tokens on the device, the decoding request per row).
    With a request under a grammar or with logit biases decoding, the call is the masked step, after every
    row's mask is written (skipped for biases alone where the masks already allow every token)."""
    decoding = [r for r in self._running if r is not None and r.job is None]
    greedy = all(r.request.params.greedy and not r.request.params.penalized for r in decoding)
    mode = WIDE if any(r.request.params.wide_top_k for r in decoding) else FULL
    count = min(c for c in self.programs.counts if c >= self._busy())
    constrained = self._constrained()
    if constrained or any(r.request.logit_bias for r in decoding):
      if constrained or not self._masks_full:
        masks = full_mask(self.slots, self.engine.config.vocab_size)
        for slot, run in enumerate(self._running):
          if run is not None and run.job is None and run.request.constraint is not None:
            masks[slot] = run.request.constraint.mask
        self.programs.put_masks(masks)
        self._masks_full = not any(r is not None and r.request.constraint is not None for r in self._running)
      tokens = self.programs.decode(count, mode, masked=True)
    else:
      tokens = self.programs.decode(count, GREEDY if greedy else mode)
    self.metrics.decode_calls[count] = self.metrics.decode_calls.get(count, 0) + 1
    return tokens, [r if r is not None and r.job is None else None for r in self._running[:count]]

  def _collect(self, tokens, owners: list) -> None:
    """Hands a call's tokens to the requests that held its rows when it was dispatched, where still running."""
    tokens = np.asarray(tokens)                     # [steps, rows]
    live = {id(r) for r in self._running if r is not None}
    for column, run in enumerate(owners):
      if run is not None and id(run) in live:
        self._push(run, [int(t) for t in tokens[:, column]])

  def _busy(self) -> int:
    """Slots in use: they are rows [0, busy) (kept packed)."""
    busy = sum(r is not None for r in self._running)
    assert all(r is not None for r in self._running[:busy]), "busy slots are not packed"
    return busy

  def _swap(self, a: int, b: int) -> None:
    """Exchanges slots a and b: their device rows and what the host knows of them."""
    if a == b:
      return
    self.programs.swap(a, b)
    for table in (self._running, self._history, self._used):
      table[a], table[b] = table[b], table[a]
    for slot in (a, b):
      run = self._running[slot]
      if run is not None and run.job is not None:
        run.job.slot = slot

  def _admitted(self, run: _Running, token: int) -> None:
    """A request's prompt is in its slot and its first token sampled."""
    request = run.request
    if request.prompt_logprobs:
      p = request.prompt
      scores = self.programs.score(self._running.index(run), p[:-1], 0, p[1:])
      request.emit(Delta("", [], prompt_logprobs=[(lp, top[:request.logprobs or 0]) for lp, top in scores]))
    if request.max_tokens == 0:
      self.metrics.ttft.observe(time.perf_counter() - request.submitted)
      self._release(run, Done("length", len(request.prompt), 0, run.reused))
      return
    self._push(run, [token])

  def _push(self, run: _Running, tokens: list[int]) -> None:
    """Hands a slot's new tokens to its request; frees the slot when the request ends."""
    now = time.perf_counter()
    if run.first is None:
      run.first = now
      self.metrics.ttft.observe(now - run.request.submitted)
    out, text, before, count = run.output, [], len(run.output.ids), len(run.generated)
    grammar = run.request.constraint
    for t in tokens:
      if out.finish:
        break
      run.generated.append(t)
      text.append(out.push(t, (now - run.request.submitted) * 1e3))
      if grammar is not None and out.finish not in ("eos", "error"):
        grammar.advance(t)
        if grammar.complete or grammar.error is not None:
          text.append(out.end("grammar" if grammar.complete else "error", grammar.error))
    new_ids = out.ids[before:]
    self.metrics.generation_tokens += len(run.generated) - count
    logprobs = None
    if run.request.logprobs is not None and new_ids:
      # new_ids are generated[before:]; token i was sampled after input i - 1 (the prompt's last for i = 0).
      inputs = ([run.request.prompt[-1]] + run.generated)[before:before + len(new_ids)]
      scores = self.programs.score(self._running.index(run), inputs, len(run.request.prompt) - 1 + before, new_ids)
      logprobs = [(lp, top[:run.request.logprobs]) for lp, top in scores]
    if "".join(text) or new_ids:
      run.request.emit(Delta("".join(text), new_ids, logprobs))
    if out.finish:
      reason = _FINISH[out.finish]
      done = Done(reason, len(run.request.prompt), len(out.times), run.reused, out.error)
      if len(out.times) > 1:
        self.metrics.tpot.observe((now - run.first) / (len(out.times) - 1))
      self._release(run, done)

  def _release(self, run: _Running, done: Done) -> None:
    """Frees a request's slot; the last busy slot moves into its place, so busy slots stay packed."""
    slot = self._running.index(run)
    self._running[slot] = None
    self._used[slot] = time.perf_counter()
    # What the row's cache holds for sure: the prompt and every token sampled but the last (each is written by
    # the step after the one that sampled it). A slot freed mid-prefill holds nothing reusable.
    self._history[slot] = [] if run.job is not None else list(run.request.prompt) + run.generated[:-1]
    self._swap(slot, sum(r is not None for r in self._running))
    self._finish_request(run.request, done)

  def _finish_request(self, request: Request, done: Done) -> None:
    self.metrics.finished(done.finish_reason, time.perf_counter() - request.submitted)
    request.emit(done)

  def _fail_all(self, error: str, reason: str = "error") -> None:
    """Ends every request in a slot or waiting (a failed program, or shutdown); with an error the slots' state
    is made anew (a program that failed may have consumed its donated buffers)."""
    runs = [r for r in self._running if r is not None]
    self._running = [None] * self.slots
    self._pending = None
    self._history = [[] for _ in range(self.slots)]
    for run in runs:
      self._finish_request(run.request, Done(reason, len(run.request.prompt), len(run.generated), run.reused, error))
    while self._waiting:
      request = self._waiting.popleft()
      self._dequeued()
      self._finish_request(request, Done(reason, len(request.prompt), 0, error=error))
    if reason == "error":                  # last: if it fails, every request has its answer already
      self.programs.reset()
