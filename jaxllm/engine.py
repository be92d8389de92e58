"""The runtime: the Engine, which owns the KV cache, runs the decode loop and each request's lifecycle.

The decode step donates its whole DecodeState, so every output aliases an input and buffer addresses
stay fixed from step to step: the condition for XLA to replay a recorded command buffer unchanged
(docs/cuda-graphs.md says what was measured about it). Sampling settings, seeds and stop conditions are
data in that state, so one executable serves every request of a batch size (two, where every row is
greedy: an argmax-only step). The loop is pipelined: call i+1 is dispatched before the tokens of call i
are read on the host, so the device never waits for the host; `pipelined=False` reads every token before
the next dispatch (the streaming baseline). A call is K decode steps (`tokens_per_call`, 8 by default)
whose tokens arrive together.

A request under a grammar (`constraints`: jaxllm.structured's Constraint per row) runs the masked programs
(its Sampler carries each row's token mask) one step a call, never ahead: each token goes to its row's
Constraint, whose next mask is written into the state before the next step.

Prompts run in chunks of `prefill_chunk` tokens (one executable per chunk size; the last chunk padded to
a power of two), each attending to what the cache already holds, so no intermediate grows with the
prompt beyond O(chunk x S). With `reuse_cache=True` a request whose prompt starts with the tokens the
cache already holds (an earlier turn of a chat, and its answer) prefills only the rest.

An Engine serves one request at a time: a second thread calling it while a request runs gets a
RuntimeError, and starting a request closes a stream the caller abandoned (its cache comes back).

Elsewhere: the compiled programs and their compilation in jaxllm/programs.py (Engine's base class), the
text side of a sequence (detokenizing, stop strings, GenerationResult) in jaxllm/text.py, the benchmarks'
timing loops in jaxllm/timing.py and the XLA-dump reading of the decode step in jaxllm/graphs.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import lab
from jaxllm.cache import KVCache, check_fits
from jaxllm.config import Config
from jaxllm.decode import DecodeState, eog_table
from jaxllm.model import Weights
from jaxllm.programs import Programs, _all_greedy, greedy_mode
from jaxllm.sampling import NONFINITE, Sampler, SamplingParams, full_mask, rows_of
from jaxllm.text import GenerationResult, SequenceOutput
from jaxllm.tokenizer import Tokenizer

__all__ = ["Engine", "GenerationResult", "TimingRun", "greedy_mode", "snapshot"]


def _snapshot(x: jax.Array) -> jax.Array:
  return jnp.copy(x)


# A copy of a call's tokens on the device, made before the next call donates them (the pipelined loop's).
snapshot = jax.jit(_snapshot)


@dataclasses.dataclass
class TimingRun:
  """A prefilled greedy request that a timing loop (jaxllm.timing) advances: Engine.timing_run's."""
  state: DecodeState     # the request's state: the loop replaces it with each step's
  step: Callable         # the compiled single step, step(weights, state) -> state (the state donated)


class Engine(Programs):
  """A loaded model plus its compiled prefill/decode executables and a reusable KV cache.

  Args:
    config, weights, tokenizer: the model (see jaxllm.load).
    max_context: cache length S (prompt + generated tokens must fit).
    kernels: "auto" | "ffi" | "xla" (see jaxllm.kernels); `self.kernels` is the path that runs.
    graphs_on: None = the JAXLLM_CUDA_GRAPHS default, True/False to force.
    dtype: activation dtype; default bf16 on GPU, f32 on CPU.
    cache_dtype: the KV cache's dtype; default the activation dtype. bf16 under f32 activations halves the
      cache's memory on the CPU (the FFI attention reads it as it is), but XLA's CPU scatter upcasts a
      bf16 array whole for each write, which makes prefill slower: not the default there.
    prefill_chunk: prompt tokens per prefill chunk (default per backend, programs.PREFILL_CHUNK).
    cache_executables: keep compiled executables on disk (jaxllm.executables) and load them on a later run
      instead of tracing and compiling again.
    tokens_per_call: decode steps per executable call (decode_steps): the host dispatches and reads once
      per that many tokens, which then arrive together; a stream may compute up to that many - 1 steps past
      the point where its caller stops reading. None (the default): programs.GPU_TOKENS_PER_CALL on the GPU,
      CPU_TOKENS_PER_CALL on the CPU, but 1 for an unfused step in an "unrolled" device loop
      (tokens_per_call_for says which).
    device_loop: how a call of several steps runs them (decode.decode_steps' loop): "unrolled" (K copies of
      the step in the program) or "while" (one copy in a while loop). None (the default): "unrolled" where the
      GPU runs the fused step, "while" elsewhere (loop_for says which: K unrolled CPU steps compile for ~20 s
      instead of ~3, K unrolled unfused GPU steps for tens of seconds).
    autotune: on the GPU, time the tensor-core matmul's configurations on the weights' W8A16 shapes once a card
      (in a child process, kept in the cache) and run the fastest for each at 5-32 rows (jaxllm.tuning); None:
      the JAXLLM_AUTOTUNE default (on; 0 turns it off).
    mesh: a one-axis mesh (jaxllm.parallel.make_mesh(N)) to run tensor parallel over its N devices: the
      weights are laid out over it (W8A16 or float), the KV cache split by KV head; None: one device.
  """

  def __init__(self, config: Config, weights: Weights, tokenizer: Tokenizer | None, max_context: int,
               kernels: str = "auto", graphs_on: bool | None = None, dtype=None, prefill_chunk: int | None = None,
               cache_executables: bool = False, cache_dtype=None, tokens_per_call: int | None = None,
               device_loop: str | None = None, mesh=None, autotune: bool | None = None):
    super().__init__(config, weights, max_context, kernels=kernels, graphs_on=graphs_on, dtype=dtype,
                     prefill_chunk=prefill_chunk, cache_executables=cache_executables, cache_dtype=cache_dtype,
                     tokens_per_call=tokens_per_call, device_loop=device_loop, mesh=mesh, autotune=autotune)
    self.tokenizer = tokenizer
    self._cache: KVCache | None = None
    self._history: list[list[int]] | None = None   # per row: the tokens whose keys the cache holds
    self._lock = threading.Lock()
    self._active: Iterator | None = None
    self._active_thread: threading.Thread | None = None
    self.last_reused: list[int] = []
    check_fits(config, 1, self.max_context, self.cache_dtype)

  def _take_cache(self, batch: int) -> KVCache:
    """The engine's cache for `batch` sequences (reused across calls; the old one is given up)."""
    cache, self._cache = self._cache, None
    if cache is None or cache.k.is_deleted() or cache.batch != batch:
      cache = None
      self._history = None
      cache = self.new_cache(batch)
    return cache

  def warmup(self, prompt_len: int, params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
             batch: int = 1, trial: bool = False, masked: bool = False) -> None:
    """Compiles what a request of this (longest) prompt length will run, outside any timing (masked: a
    request under a grammar).

    trial=True also runs a request through the same executables (token 0s, at most one full chunk plus
    the same last chunk, two new tokens) and throws it away, so what a first run costs beyond compiling
    (allocating the cache, first executions) is paid here too.
    """
    greedy = _all_greedy(params, batch)
    sizes = self._chunks(prompt_len)
    lookups = [functools.partial(self.extend_fn, batch, size) for size in sorted(set(sizes[:-1]))]
    lookups.append(functools.partial(self.prefill_fn, batch, sizes[-1], greedy, masked))
    lookups.append(functools.partial(self.step_fn, batch, greedy, masked=True) if masked else
                   functools.partial(self.advance_fn, batch, greedy))
    self.compile_programs(lookups)                  # the prefill and decode programs compiled at once
    if trial:
      n = prompt_len if len(sizes) == 1 else prompt_len - (len(sizes) - 2) * self.prefill_chunk
      n = min(n, self.max_context - 2)
      self.generate_batch([[0] * n] * batch, 2, params, ignore_eos=True,
                          constraints=[None] * batch if masked else None)
      self._history = None

  def compile_program(self, key: tuple, make: Callable[[], tuple]) -> Callable:
    """The program under key, compiled the first time: make() -> (fn, donated arguments, abstract arguments)
    runs only then (callers look programs up every step, and abstract arguments cost more than a small
    model's step to build). Compiled as the engine's own programs are: with its compiler options,
    command-buffer fallback and disk cache, counted in `built`. For programs built outside the engine over
    its weights (jaxllm.serve's slot programs); key's first item names them."""
    if key in self._exe:
      return self._exe[key]
    return self._build(key, *make())

  # ---- generation ----------------------------------------------------------------------------

  def check_prompt(self, prompt_ids: Sequence[int]) -> None:
    n = len(prompt_ids)
    if n == 0:
      raise ValueError("the prompt is empty: give at least one token")
    if n >= self.max_context:
      raise ValueError(f"the prompt has {n} tokens but the context holds {self.max_context} "
                       f"(--max-context): it must be shorter than the context to leave room to generate")
    bad = [t for t in prompt_ids if not (isinstance(t, (int, np.integer)) and 0 <= t < self.config.vocab_size)]
    if bad:
      raise ValueError(f"prompt token ids must be integers in [0, {self.config.vocab_size}), got {bad[:5]}")

  def _reusable(self, prompts: Sequence[Sequence[int]]) -> list[int]:
    """Per row, how many leading prompt tokens the cache already holds (at least one token is left to run)."""
    if self._history is None or len(self._history) != len(prompts) or self._cache is None:
      return [0] * len(prompts)
    out = []
    for hist, p in zip(self._history, prompts):
      n = 0
      for a, b in zip(hist, p):
        if a != b:
          break
        n += 1
      out.append(min(n, len(p) - 1))
    return out

  def _prefill(self, prompts: Sequence[Sequence[int]], sampler: Sampler, limits: np.ndarray, eog: np.ndarray,
               greedy: bool, reuse: bool, masked: bool = False) -> tuple[DecodeState, list[int]]:
    """Runs the prompts chunk by chunk (from what the cache already holds, with reuse); returns the state
    and, per row, how many prompt tokens were reused. masked: the sampler carries token masks."""
    b = len(prompts)
    starts = self._reusable(prompts) if reuse else [0] * b
    cache = self._take_cache(b)
    self._history = None                        # the cache is being rewritten
    new = [list(p[s:]) for p, s in zip(prompts, starts)]
    n = np.asarray([len(x) for x in new], np.int32)
    sizes = self._chunks(int(n.max()))
    last = jnp.zeros((b, self.config.d_model), jnp.float32)
    offset = 0
    for j, size in enumerate(sizes):
      tokens = np.zeros((b, size), np.int32)
      lengths = np.clip(n - offset, 0, size).astype(np.int32)
      for r in range(b):
        tokens[r, :lengths[r]] = new[r][offset:offset + lengths[r]]
      start = (np.asarray(starts, np.int32) + offset).astype(np.int32)
      if j < len(sizes) - 1:
        cache, last = self.extend_fn(b, size)(self.weights, cache, tokens, lengths, start, last)
      else:
        pos = (np.asarray(starts) + n).astype(np.int32)
        state = self.prefill_fn(b, size, greedy, masked)(self.weights, cache, tokens, lengths, start, last, pos,
                                                         sampler, limits, eog)
      offset += size
    return state, starts

  def _setup(self, prompts, max_tokens, params, seed, ignore_eos, constraints=None):
    """Host arrays for a request: sampler (with each row's first token mask where constraints are given: a
    Constraint or None per row), per-row token limits and end-of-generation tables."""
    b = len(prompts)
    rows = rows_of(params, b)
    sampler = Sampler.create(rows, b, seed, history=prompts, vocab_size=self.config.vocab_size,
                             masks=None if constraints is None else self._masks(constraints))
    limits = np.asarray([min(self.max_context, len(p) + max_tokens - 1) for p in prompts], np.int32)
    eog_ids = () if ignore_eos or self.tokenizer is None else self.tokenizer.eog_ids
    return sampler, limits, eog_table(eog_ids, b), greedy_mode(rows)

  def _masks(self, constraints) -> np.ndarray:
    """The rows' next token masks [B, ceil(V / 32)]: each Constraint's, every token for a row without one."""
    if not isinstance(constraints, (list, tuple)):
      raise ValueError(f"constraints must be a list of one Constraint or None per row, got {constraints!r}")
    masks = full_mask(len(constraints), self.config.vocab_size)
    for r, c in enumerate(constraints):
      if c is not None:
        masks[r] = c.mask
    return masks

  def stream_tokens(self, prompts: Sequence[Sequence[int]], max_tokens: int,
                    params: SamplingParams | Sequence[SamplingParams] = SamplingParams(), seed: int = 0,
                    pipelined: bool = True, ignore_eos: bool = False, reuse_cache: bool = False,
                    constraints: Sequence | None = None) -> Iterator[tuple[np.ndarray, float]]:
    """Yields (tokens [B], seconds since submission) for up to max_tokens decode positions: the
    prefill's token, then one per decode step, until every sequence is done on the device or the caller
    stops iterating. Pipelined: step i+1 is dispatched before token i is read. A token is NONFINITE (-1)
    where the model's logits were not finite. constraints: one jaxllm.structured.Constraint (or None) per row:
    each row draws under its grammar's mask, one step a call (never pipelined), its Constraint advanced by each
    token before it is yielded."""
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
      raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if not prompts:
      raise ValueError("no prompts given")
    for p in prompts:
      self.check_prompt(p)
    if constraints is not None and len(constraints) != len(prompts):
      raise ValueError(f"constraints must hold one Constraint or None per prompt ({len(prompts)}), "
                       f"got {len(constraints)}")
    sampler, limits, eog, greedy = self._setup(prompts, max_tokens, params, seed, ignore_eos, constraints)
    if not self._lock.acquire(blocking=False):
      raise RuntimeError("this Engine is running a request in another thread: an Engine serves one request at "
                         "a time (use one Engine per thread)")
    try:
      self._close_abandoned()
      if constraints is None:
        gen = self._stream(prompts, max_tokens, sampler, limits, eog, greedy, pipelined, reuse_cache)
      else:
        gen = self._stream_masked(prompts, max_tokens, sampler, limits, eog, greedy, reuse_cache, list(constraints))
      self._active, self._active_thread = gen, threading.current_thread()
    finally:
      self._lock.release()
    return self._guarded(gen)

  def _guarded(self, gen):
    """Runs a stream generator holding the engine's lock while it computes (not while it is suspended)."""
    try:
      while True:
        if not self._lock.acquire(blocking=False):
          raise RuntimeError("this Engine is running a request in another thread: an Engine serves one "
                             "request at a time (use one Engine per thread)")
        try:
          item = next(gen)
        except StopIteration:
          return
        finally:
          self._lock.release()
        yield item
    finally:
      gen.close()
      if self._active is gen:
        self._active = None

  def _close_abandoned(self) -> None:
    """A stream this thread (or a thread that has ended) stopped iterating without closing still holds the
    cache: close it. One that another live thread is still reading makes this request an error."""
    if self._active is None:
      return
    owner = self._active_thread
    if owner is not threading.current_thread() and owner.is_alive():
      raise RuntimeError("this Engine is running a request in another thread: an Engine serves one request at "
                         "a time (use one Engine per thread)")
    gen, self._active = self._active, None
    gen.close()

  def _stream(self, prompts, steps, sampler, limits, eog, greedy, pipelined, reuse):
    t0 = time.perf_counter()
    state, starts = self._prefill(prompts, sampler, limits, eog, greedy, reuse)
    self.last_reused = starts
    b = len(prompts)
    k = self.tokens_per_call_for(b)
    advance = self.advance_fn(b, greedy)
    # Tokens of each call on the device, in order: [B] or [K, B]. Pipelined, they are copied (snapshot)
    # before the next call donates them; otherwise they are read first and the call is the only dispatch.
    keep = snapshot if pipelined else (lambda x: x)
    # Each call's tokens are copied to the host as soon as the device has them (the copy queued behind the call
    # at dispatch), not once the host asks: the read then finds them there. Lab switch JAXLLM_READ_AHEAD=0: on asking.
    ahead = lab.switch("JAXLLM_READ_AHEAD", "1") != "0"

    def kept(tokens):
      tokens = keep(tokens)
      if ahead:
        tokens.copy_to_host_async()
      return tokens
    pending = [kept(state.tokens)]
    in_flight = 1                                         # tokens per row in pending
    read: list[np.ndarray] = []
    block = None
    # The device's stop rule (decode._stopped) followed on the host, from the tokens alone: a row is done after
    # an end-of-generation or NONFINITE token, or once it has its limit's tokens; when every row is, so is the
    # stream (the device would only repeat the done rows' last tokens).
    stoppers = [set(row.tolist()) | {NONFINITE} for row in eog]
    quota = [int(limits[r]) - len(p) + 1 for r, p in enumerate(prompts)]
    done = [False] * b
    try:
      while pending:
        if pipelined and len(read) + in_flight < steps:
          state, block, out = advance(state, block)      # dispatch ahead, then read the older tokens
          pending.append(kept(out))
          in_flight += k
        rows = np.asarray(pending.pop(0)).reshape(-1, b)
        in_flight -= len(rows)
        for tokens in rows[:steps - len(read)]:
          read.append(tokens)
          yield tokens, time.perf_counter() - t0
          done = [d or int(t) in stop or len(read) >= q for d, t, stop, q in zip(done, tokens, stoppers, quota)]
          if all(done):
            break
        if len(read) >= steps or all(done):
          break
        if not pipelined:
          state, block, out = advance(state, block)
          pending.append(kept(out))
          in_flight += k
    finally:
      self._keep(state, prompts, read)

  def _stream_masked(self, prompts, steps, sampler, limits, eog, greedy, reuse, constraints):
    """_stream for rows under grammars: one step a call and none ahead (a row's next mask needs the token it
    has just drawn). Each token goes to its row's Constraint before it is yielded; a row is done at an
    end-of-generation or NONFINITE token, its quota, or once its grammar is complete."""
    t0 = time.perf_counter()
    state, self.last_reused = self._prefill(prompts, sampler, limits, eog, greedy, reuse, masked=True)
    step = self.step_fn(len(prompts), greedy, masked=True)
    stoppers = [set(row.tolist()) | {NONFINITE} for row in eog]
    quota = [int(limits[r]) - len(p) + 1 for r, p in enumerate(prompts)]
    done = [False] * len(prompts)
    read: list[np.ndarray] = []
    try:
      while True:
        tokens = np.asarray(state.tokens)
        read.append(tokens)
        for r, c in enumerate(constraints):
          if c is not None and not done[r] and int(tokens[r]) not in stoppers[r]:
            c.advance(int(tokens[r]))
        yield tokens, time.perf_counter() - t0
        done = [d or int(t) in stop or len(read) >= q or (c is not None and (c.complete or c.error is not None))
                for d, t, stop, q, c in zip(done, tokens, stoppers, quota, constraints)]
        if all(done) or len(read) >= steps:
          break
        sampler = dataclasses.replace(state.sampler, mask=self._masks(constraints))
        state = step(self.weights, dataclasses.replace(state, sampler=sampler))
    finally:
      self._keep(state, prompts, read)

  def _keep(self, state: DecodeState, prompts, read: list[np.ndarray]) -> None:
    """Keeps a finished stream's cache and what it holds per row (the prompt and the tokens written)."""
    if any(a.is_deleted() for a in jax.tree.leaves(state)):
      # Interrupted (Ctrl-C) between a call that donated the state and the assignment of what it returned:
      # the buffers are gone, so is the cache; the next request starts from a new one.
      self._cache, self._history = None, None
      return
    pos = np.asarray(state.pos)
    gen = np.stack(read, axis=1) if read else np.zeros((len(prompts), 0), np.int32)
    self._history = [list(p) + [int(t) for t in gen[r, :max(0, pos[r] - len(p))]] for r, p in enumerate(prompts)]
    self._cache = state.cache

  def stream_ids(self, prompt_ids: Sequence[int], max_tokens: int, params: SamplingParams = SamplingParams(),
                 seed: int = 0, pipelined: bool = True, reuse_cache: bool = False) -> Iterator[tuple[int, float]]:
    """Yields (token id, seconds since the prompt was submitted) for up to max_tokens new tokens.

    The caller decides when to stop (EOS, stop strings) by ceasing to iterate. Generation also ends
    when the context is full.
    """
    for tokens, t in self.stream_tokens([prompt_ids], max_tokens, params, seed, pipelined, ignore_eos=True,
                                        reuse_cache=reuse_cache):
      yield int(tokens[0]), t

  @contextlib.contextmanager
  def timing_run(self, prompt_ids: Sequence[int], tokens: int, batch: int = 1) -> Iterator[TimingRun]:
    """A greedy request of `tokens` tokens for a timing loop (jaxllm.timing), prefilled, with the engine held:
    the loop advances run.state with run.step (or the calls of advance_fn(batch, True)); on leaving, the last
    state's cache goes back to the engine. batch: rows, each with the same prompt."""
    with self._lock:
      self.check_prompt(prompt_ids)
      prompts = [prompt_ids] * batch
      sampler, limits, eog, greedy = self._setup(prompts, tokens, SamplingParams(), 0, True)
      self._close_abandoned()
      state, _ = self._prefill(prompts, sampler, limits, eog, greedy, False)
      run = TimingRun(state, self.step_fn(batch, greedy))
      yield run
      self._cache, self._history = run.state.cache, None

  def generate(self, prompt_ids: Sequence[int], max_tokens: int = 32, params: SamplingParams = SamplingParams(),
               seed: int = 0, stop: Sequence[str] = (), ignore_eos: bool = False, pipelined: bool = True,
               on_text: Callable[[str], None] | None = None, reuse_cache: bool = False,
               constraint=None) -> GenerationResult:
    """Generates from token ids; `on_text` receives text as it becomes final (for streaming); constraint: a
    jaxllm.structured.Constraint the output follows (a grammar's)."""
    return self.generate_batch([prompt_ids], max_tokens, params, seed, stop, ignore_eos, pipelined,
                               on_text=None if on_text is None else (lambda b, piece: on_text(piece)),
                               reuse_cache=reuse_cache, constraints=None if constraint is None else [constraint])[0]

  def generate_batch(self, prompts: Sequence[Sequence[int]], max_tokens: int = 32,
                     params: SamplingParams | Sequence[SamplingParams] = SamplingParams(), seed: int = 0,
                     stop: Sequence[str] = (), ignore_eos: bool = False, pipelined: bool = True,
                     on_text: Callable[[int, str], None] | None = None,
                     reuse_cache: bool = False, constraints: Sequence | None = None) -> list[GenerationResult]:
    """Generates for several prompts of any lengths at once, each stopping on its own.

    Each sequence has its own positions, visible length, sampling settings (one SamplingParams per prompt,
    or one for all) and PRNG key on the device, so its padding never reaches attention, and its output
    equals running it alone. `on_text(b, text)` streams sequence b's text. With reuse_cache, prompts that
    start with what the cache holds from the previous call (same batch size) prefill only the rest.
    constraints: one jaxllm.structured.Constraint or None per prompt; a sequence whose grammar completes
    ends with finish_reason "grammar".
    """
    if self.tokenizer is None and stop:
      raise ValueError("stop strings need a tokenizer")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
      raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if not prompts:
      raise ValueError("no prompts given")
    for p in prompts:
      self.check_prompt(p)
    eog = frozenset() if ignore_eos or self.tokenizer is None else self.tokenizer.eog_ids
    seqs = [SequenceOutput(list(p), min(max_tokens, self.max_context - len(p) + 1), max_tokens, self.tokenizer,
                      stop, eog) for p in prompts]
    steps = max(s.limit for s in seqs)
    stream = self.stream_tokens([s.prompt_ids for s in seqs], steps, params, seed, pipelined, ignore_eos,
                                reuse_cache, constraints)
    try:
      for tokens, t in stream:
        for b, s in enumerate(seqs):
          piece = s.push(int(tokens[b]), t * 1e3)
          c = constraints[b] if constraints is not None else None
          if c is not None and (c.complete or c.error is not None):
            piece += s.end("grammar" if c.complete else "error", c.error)
          if on_text and piece:
            on_text(b, piece)
        if all(s.finish for s in seqs):
          break
    finally:
      stream.close()
    for s, reused in zip(seqs, self.last_reused):
      s.reused = reused
    return [s.result() for s in seqs]

