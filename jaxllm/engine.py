"""The engine: compiles chunked prefill and the decode step, and runs the generate loop.

The decode step donates its whole DecodeState, so every output aliases an input and buffer addresses
stay fixed from step to step: the condition for XLA to replay a recorded command buffer unchanged
(docs/cuda-graphs.md says what was measured about it). Sampling settings, seeds and stop conditions are
data in that state, so one executable serves every request of a batch size (two, where every row is
greedy: an argmax-only step). The loop is pipelined: call i+1 is dispatched before the tokens of call i
are read on the host, so the device never waits for the host; `pipelined=False` reads every token before
the next dispatch (the streaming baseline). A call is one decode step, or K (`tokens_per_call`, 8 by
default where the GPU runs the fused step) whose tokens arrive together.

Prompts run in chunks of `prefill_chunk` tokens (one executable per chunk size; the last chunk padded to
a power of two), each attending to what the cache already holds, so no intermediate grows with the
prompt beyond O(chunk x S). With `reuse_cache=True` a request whose prompt starts with the tokens the
cache already holds (an earlier turn of a chat, and its answer) prefills only the rest.

An Engine serves one request at a time: a second thread calling it while a request runs gets a
RuntimeError, and starting a request closes a stream the caller abandoned (its cache comes back).
"""
from __future__ import annotations

import dataclasses
import functools
import statistics
import threading
import time
import warnings
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import graphs, lab
from jaxllm.cache import KVCache, check_fits, create_cache
from jaxllm.config import Config
from jaxllm.decode import (DEVICE_LOOPS, MAX_EOG, DecodeState, decode_step, decode_steps, eog_table, extend,
                           finish_prefill)
from jaxllm.kernels import fused, resolve_kernels, select
from jaxllm.model import Weights
from jaxllm.sampling import NONFINITE, Sampler, SamplingParams, candidates_kernel, rows_of
from jaxllm.tokenizer import StreamDecoder, Tokenizer

MIN_BUCKET = 16
# Tokens per prefill chunk, measured (docs/results/2026-12-01-h200-prefill.md): on the H200 a 32000-token
# prompt took 327 / 279 / 267 ms with chunks of 2048 / 4096 / 8192 (8192 tokens: 36.7 / 34.5 / 34.2 ms), the
# memory beyond weights and cache 0.85 / 0.92 / 1.06 GB: 4096 keeps most of the gain. The CPU's matmuls gain
# nothing past a few hundred rows, and each chunk's intermediates grow with it.
PREFILL_CHUNK = {"gpu": 4096, "cpu": 512}
PREFILL_LAYERS = {"cpu": "scan"}            # how prefill runs the layers per backend (model.forward)


def prompt_bucket(length: int, cap: int) -> int:
  """Padded length of a chunk: the next power of two >= length (at least MIN_BUCKET), capped at `cap`."""
  bucket = MIN_BUCKET
  while bucket < length:
    bucket *= 2
  return min(bucket, cap)


@dataclasses.dataclass
class GenerationResult:
  prompt_ids: list[int]
  ids: list[int]                  # new tokens (the stopping EOS excluded)
  text: str                       # decoded new text (stop string excluded)
  finish_reason: str              # "eos" | "stop" | "length" | "context" | "error"
  ttft_ms: float                  # prompt submitted -> first new token on the host
  tpot_ms: float                  # mean time per new token after the first
  tok_per_s: float                # decode tokens per second after the first
  token_times_ms: list[float]     # arrival time of each new token, from the prompt's submission
  error: str | None = None        # what went wrong when finish_reason is "error"
  reused_tokens: int = 0          # prompt tokens whose keys were already in the cache (reuse_cache)

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


class _StopText:
  """Holds back text that could still become a stop string; reports when one appears.

  Shown text is kept as a list of pieces and only the held-back tail (shorter than the longest stop string,
  plus the newest piece) is searched and rebuilt, so the cost per token does not grow with the text
  generated.
  """

  def __init__(self, stops: Sequence[str]):
    self.stops = [s for s in stops if s]
    self.shown: list[str] = []   # text already returned, in pieces
    self.pending = ""            # decoded text not returned yet: it may still begin a stop string

  @property
  def text(self) -> str:
    """All the text so far (cut before the stop string, once one appeared)."""
    return "".join(self.shown) + self.pending

  def _show(self, n: int) -> str:
    out, self.pending = self.pending[:n], self.pending[n:]
    if out:
      self.shown.append(out)
    return out

  def push(self, piece: str) -> tuple[str, bool]:
    """Adds decoded text; returns (text safe to show now, whether a stop string was hit)."""
    # Shown text never ends with the start of a stop string (that much is held back), so a stop string
    # can only begin in the pending text.
    self.pending += piece
    hits = [at for at in (self.pending.find(s) for s in self.stops) if at >= 0]
    if hits:                     # the earliest stop string in the text, whatever its place in the list
      at = min(hits)
      self.pending = self.pending[:at]
      return self._show(at), True
    hold = 0
    for s in self.stops:
      for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
        if self.pending.endswith(s[:n]):
          hold = max(hold, n)
          break
    return self._show(len(self.pending) - hold), False

  def flush(self) -> str:
    return self._show(len(self.pending))


# Decode steps per executable call by default (Engine.tokens_per_call_for) where the GPU runs the fused step
# (measured on the H200, docs/results/2026-12-01-h200-step.md: 4 and 8 both leave the step device-bound) and
# on the CPU, there in a while loop (docs/results/2026-12-02-cpu-calls.md: 0.74-0.86x the TPOT of one step a
# call, compiled as fast); and the most an Engine takes.
GPU_TOKENS_PER_CALL = 8
CPU_TOKENS_PER_CALL = 8
MAX_TOKENS_PER_CALL = 64


def _compile(fn, donate: int | tuple[int, ...], options: dict, args) -> Callable:
  """jit + lower + compile with per-executable XLA options."""
  donate = (donate,) if isinstance(donate, int) else donate
  return jax.jit(fn, donate_argnums=donate, compiler_options=options or None).lower(*args).compile()


def _trial_args(args):
  """Zero-filled device arrays standing in for abstract arguments (for a first, throw-away run)."""
  return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a, args)


def _snapshot(x: jax.Array) -> jax.Array:
  return jnp.copy(x)


_snapshot_jit = jax.jit(_snapshot)


def _graphs_possible() -> bool:
  """XLA command buffers exist on the GPU backend only."""
  return jax.default_backend() == "gpu"


def _spec(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), tree)


def _final_chunk(config, weights, cache, tokens, lengths, start, last, pos, sampler, limit, eog, *, greedy_only,
                 kernels, layers):
  """The last prefill chunk: extend the cache, then sample each row's first token."""
  cache, hidden = extend(config, weights, cache, tokens, lengths, start, last, kernels=kernels, layers=layers)
  return finish_prefill(config, weights, cache, hidden, pos, sampler, limit, eog, greedy_only=greedy_only,
                        kernels=kernels)


class Engine:
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
    prefill_chunk: prompt tokens per prefill chunk (default per backend, PREFILL_CHUNK).
    cache_executables: keep compiled executables on disk (jaxllm.store) and load them on a later run
      instead of tracing and compiling again.
    tokens_per_call: decode steps per executable call (decode_steps): the host dispatches and reads once
      per that many tokens, which then arrive together; a stream may compute up to that many - 1 steps past
      the point where its caller stops reading. None (the default): GPU_TOKENS_PER_CALL where the GPU runs
      the fused step, CPU_TOKENS_PER_CALL on the CPU with the while loop, else 1 (tokens_per_call_for says
      which).
    device_loop: how a call of several steps runs them (decode.decode_steps' loop): "unrolled" (K copies of
      the step in the program) or "while" (one copy in a while loop). None (the default): "while" on the CPU
      (K unrolled CPU steps compile for ~20 s instead of ~3), "unrolled" on the GPU.
  """

  def __init__(self, config: Config, weights: Weights, tokenizer: Tokenizer | None, max_context: int,
               kernels: str = "auto", graphs_on: bool | None = None, dtype=None, prefill_chunk: int | None = None,
               cache_executables: bool = False, cache_dtype=None, tokens_per_call: int | None = None,
               device_loop: str | None = None):
    if not isinstance(max_context, int) or max_context < 2:
      raise ValueError(f"max_context must be an integer >= 2, got {max_context!r}")
    if tokens_per_call is not None and (not isinstance(tokens_per_call, int) or isinstance(tokens_per_call, bool)
                                        or not 1 <= tokens_per_call <= MAX_TOKENS_PER_CALL):
      raise ValueError(f"tokens_per_call must be an integer in [1, {MAX_TOKENS_PER_CALL}], got {tokens_per_call!r}")
    if device_loop is not None and device_loop not in DEVICE_LOOPS:
      raise ValueError(f"device_loop must be one of {DEVICE_LOOPS} or None, got {device_loop!r}")
    self.tokens_per_call = tokens_per_call
    self.device_loop = device_loop or ("unrolled" if jax.default_backend() == "gpu" else "while")
    self.config = config
    self.weights = weights
    self.tokenizer = tokenizer
    self.max_context = int(max_context)
    self.kernels = resolve_kernels(kernels)
    self.graphs_requested = graphs.graphs_requested() if graphs_on is None else bool(graphs_on)
    self.compiler_options = graphs.compiler_options(self.graphs_requested)
    self.graphs_fallback: str | None = None   # why command buffers were dropped, if they were
    self.dtype = dtype or (jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32)
    self.cache_dtype = cache_dtype or self.dtype
    chunk = prefill_chunk or PREFILL_CHUNK.get(jax.default_backend(), 512)
    if not isinstance(chunk, int) or chunk < MIN_BUCKET:
      raise ValueError(f"prefill_chunk must be an integer >= {MIN_BUCKET}, got {chunk!r}")
    self.prefill_chunk = chunk
    # The CPU's prefill scans over the layers (a working set of one layer, and a program that compiles in a
    # fraction of the time); the GPU's is unrolled, like the decode step, for its kernels and command buffers.
    self.prefill_layers = PREFILL_LAYERS.get(jax.default_backend(), "unrolled")
    self._cache: KVCache | None = None
    self._history: list[list[int]] | None = None   # per row: the tokens whose keys the cache holds
    self._exe: dict[tuple, Callable] = {}
    self._lock = threading.Lock()
    self._active: Iterator | None = None
    self._active_thread: threading.Thread | None = None
    self.last_reused: list[int] = []
    self.compile_seconds = 0.0
    self.cache_executables = cache_executables
    check_fits(config, 1, self.max_context, self.cache_dtype)

  # ---- compilation ---------------------------------------------------------------------------

  def _build(self, key: tuple, fn, donate: int, args) -> Callable:
    """Compiles fn once per key; with command buffers on, also runs it once on zeros. If either fails,
    warns once with the reason, turns command buffers off for this engine, and compiles again without."""
    if key in self._exe:
      return self._exe[key]
    t0 = time.perf_counter()
    disk_key = None
    if self.cache_executables:
      from jaxllm import store
      disk_key = store.executable_key(key, self.config, self.kernels, jnp.dtype(self.dtype).name,
                                      jnp.dtype(self.cache_dtype).name, self.max_context,
                                      sorted(self.compiler_options.items()), fused.layers_call(), fused.cpu_fused(),
                                      select.ffi_ops(), candidates_kernel(), jax.tree.structure(args),
                                      [(a.shape, str(a.dtype)) for a in jax.tree.leaves(args)])
      compiled = store.load_executable(disk_key)
      if compiled is not None:
        self.compile_seconds += time.perf_counter() - t0
        self._exe[key] = compiled
        return compiled
    try:
      compiled = _compile(fn, donate, self.compiler_options, args)
      if self.graphs_active:
        jax.block_until_ready(compiled(*_trial_args(args)))
    except Exception as e:  # XLA reports command-buffer failures as assorted runtime errors
      if not self.graphs_active:
        raise
      self.graphs_fallback = f"{type(e).__name__}: {e}".splitlines()[0][:300]
      warnings.warn(f"jaxllm: CUDA graphs (XLA command buffers) failed, running without them: "
                    f"{self.graphs_fallback}", RuntimeWarning, stacklevel=3)
      self.compiler_options = graphs.compiler_options(False)
      self._exe.clear()
      compiled = _compile(fn, donate, self.compiler_options, args)
      disk_key = None                   # the options changed: this key no longer describes the executable
    if disk_key is not None:
      from jaxllm import store
      store.save_executable(disk_key, compiled)
    self.compile_seconds += time.perf_counter() - t0
    self._exe[key] = compiled
    return compiled

  @property
  def graphs_active(self) -> bool:
    """Command buffers requested, possible on this backend, and not dropped by a fallback."""
    return self.graphs_requested and self.graphs_fallback is None and _graphs_possible()

  def _take_cache(self, batch: int) -> KVCache:
    """The engine's cache for `batch` sequences (reused across calls; the old one is given up)."""
    cache, self._cache = self._cache, None
    if cache is None or cache.k.is_deleted() or cache.batch != batch:
      cache = None
      self._history = None
      cache = create_cache(self.config, batch, self.max_context, self.dtype, self.cache_dtype)
    return cache

  def _cache_spec(self, batch: int) -> KVCache:
    c = self.config
    kv = jax.ShapeDtypeStruct((c.n_layers, batch, c.n_kv_heads, self.max_context, c.head_dim), self.cache_dtype)
    compute = jnp.dtype(self.dtype).name if jnp.dtype(self.dtype) != jnp.dtype(self.cache_dtype) else ""
    return KVCache(k=kv, v=kv, compute=compute)

  def _sampler_spec(self, batch: int) -> Sampler:
    return _spec(Sampler.create(SamplingParams(), batch))

  def _state_spec(self, batch: int) -> DecodeState:
    vec = jax.ShapeDtypeStruct((batch,), jnp.int32)
    return DecodeState(cache=self._cache_spec(batch), tokens=vec, pos=vec,
                       done=jax.ShapeDtypeStruct((batch,), jnp.bool_), limit=vec,
                       eog=jax.ShapeDtypeStruct((batch, MAX_EOG), jnp.int32), sampler=self._sampler_spec(batch))

  def extend_fn(self, batch: int, size: int) -> Callable:
    """Compiled extend(weights, cache, tokens [B, size], lengths, start, last) -> (cache, last)."""
    fn = functools.partial(extend, self.config, kernels=self.kernels, layers=self.prefill_layers)
    vec = jax.ShapeDtypeStruct((batch,), jnp.int32)
    args = (self.weights, self._cache_spec(batch), jax.ShapeDtypeStruct((batch, size), jnp.int32), vec, vec,
            jax.ShapeDtypeStruct((batch, self.config.d_model), jnp.float32))
    return self._build(("extend", batch, size), fn, 1, args)                 # (weights, cache, ...)

  def prefill_fn(self, batch: int, bucket: int, greedy: bool | str) -> Callable:
    """Compiled final prefill chunk (weights, cache, tokens [B, bucket], lengths, start, last, pos, sampler,
    limit, eog) -> DecodeState."""
    fn = functools.partial(_final_chunk, self.config, greedy_only=_greedy_only(greedy), kernels=self.kernels,
                           layers=self.prefill_layers)
    vec = jax.ShapeDtypeStruct((batch,), jnp.int32)
    args = (self.weights, self._cache_spec(batch), jax.ShapeDtypeStruct((batch, bucket), jnp.int32), vec, vec,
            jax.ShapeDtypeStruct((batch, self.config.d_model), jnp.float32), vec, self._sampler_spec(batch), vec,
            jax.ShapeDtypeStruct((batch, MAX_EOG), jnp.int32))
    return self._build(("prefill", batch, bucket, greedy), fn, 1, args)

  def step_fn(self, batch: int = 1, greedy: bool | str = True) -> Callable:
    """Compiled decode_step(weights, state) -> state, the state donated.

    greedy: True (every row greedy, no penalties: the fused path's argmax head), "penalized" (every row
    greedy, some with penalties), "sampled" (sampling, no penalties) or False (sampling with penalties), as
    greedy_mode says.
    """
    return self._build(("step", batch, greedy), *self._decode_program(batch, greedy, 1))

  def steps_fn(self, batch: int, greedy: bool | str, k: int) -> Callable:
    """Compiled decode_steps(weights, state, block [k, B]) -> (state, block): k steps per call, the state
    and the token block donated."""
    return self._build(("steps", batch, greedy, k, self.device_loop), *self._decode_program(batch, greedy, k))

  def _decode_program(self, batch: int, greedy: bool | str, k: int) -> tuple[Callable, int | tuple, tuple]:
    """(function, donated arguments, abstract arguments) of the decode executable of k steps per call:
    decode_step for k = 1, decode_steps with its [k, B] token block otherwise."""
    flags = _step_flags(greedy)
    if k == 1:
      return (functools.partial(decode_step, self.config, kernels=self.kernels, **flags), 1,
              (self.weights, self._state_spec(batch)))
    return (functools.partial(decode_steps, self.config, kernels=self.kernels, loop=self.device_loop, **flags), (1, 2),
            (self.weights, self._state_spec(batch), jax.ShapeDtypeStruct((k, batch), jnp.int32)))

  def tokens_per_call_for(self, batch: int) -> int:
    """Decode steps per executable call at this batch size: the engine's tokens_per_call, or by default
    GPU_TOKENS_PER_CALL where the GPU runs the fused step (there the host's ~0.3 ms dispatch and ~0.4 ms
    read would otherwise set the pace, docs/results/2026-12-01-h200-step.md), CPU_TOKENS_PER_CALL on the CPU
    with the while loop (a call's launch, the token's copy and read, and the host thread waking beside the
    two compute threads cost 15-25% of a step of one token a call), else 1 (the GPU's unfused step and
    unrolled CPU steps compile for tens of seconds at K > 1)."""
    if self.tokens_per_call is not None:
      return self.tokens_per_call
    if jax.default_backend() != "gpu":
      return CPU_TOKENS_PER_CALL if self.device_loop == "while" else 1
    from jaxllm.model import use_fused
    if use_fused(self.config, self.weights, self._cache_spec(batch), batch, self.kernels):
      return GPU_TOKENS_PER_CALL
    return 1

  def _advance_fn(self, batch: int, greedy: bool | str) -> Callable:
    """advance(state, block) -> (state, block, tokens): one executable call of tokens_per_call_for(batch)
    steps; tokens [B] (one step) or [K, B] (the block), the call's tokens on the device."""
    k = self.tokens_per_call_for(batch)
    if k == 1:
      step = self.step_fn(batch, greedy)

      def advance(state, block):
        state = step(self.weights, state)
        return state, block, state.tokens
      return advance
    steps = self.steps_fn(batch, greedy, k)

    def advance(state, block):
      if block is None:
        block = jnp.zeros((k, batch), jnp.int32)
      state, block = steps(self.weights, state, block)
      return state, block, block
    return advance

  def executables(self) -> list[tuple]:
    """Keys of the executables compiled so far (one per kind, batch size and chunk size)."""
    return sorted(self._exe, key=str)

  def graph_state(self, greedy: bool = True, dump_dir: str | None = None) -> dict:
    """What XLA actually did with the decode step: compiles it once more with a dump and reads it.

    Returns a dict with "state" ("on" | "off" | "unknown"), "requested", the command-buffer count and
    the share of the step's work thunks they hold ("coverage"), and the user's XLA_FLAGS setting if any.
    What it compiles is the executable a batch-1 request runs: "tokens_per_call" steps, whose thunks are
    "work_thunks" in all and "work_thunks_per_step" per step.
    `dump_dir` keeps XLA's dump there (default: a temporary directory).
    """
    info = {"requested": self.graphs_requested, "fallback": self.graphs_fallback,
            "xla_flags_setting": graphs.user_xla_flag(),
            "backend": jax.default_backend(), "kernels": self.kernels}
    if jax.default_backend() != "gpu":
      info.update(state="off", reason="XLA command buffers (CUDA graphs) exist only on the GPU backend")
      return info
    import tempfile
    k = self.tokens_per_call_for(1)
    info["tokens_per_call"] = k
    fn, donate, args = self._decode_program(1, greedy, k)
    with tempfile.TemporaryDirectory(prefix="jaxllm-dump-") as tmp:
      target = dump_dir or tmp
      options = dict(self.compiler_options, xla_dump_to=target)
      _compile(fn, donate, options, args)
      info.update(graphs.read_dump(target))
    if "work_thunks" in info:
      info["work_thunks_per_step"] = info["work_thunks"] / k
    return info

  def _chunks(self, n: int) -> list[int]:
    """Chunk sizes (padded) for n new tokens: full chunks, then the last padded to a bucket."""
    full, rest = divmod(max(n, 1), self.prefill_chunk)
    if rest == 0:
      full, rest = full - 1, self.prefill_chunk
    return [self.prefill_chunk] * full + [prompt_bucket(rest, self.prefill_chunk)]

  def warmup(self, prompt_len: int, params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
             batch: int = 1, trial: bool = False) -> None:
    """Compiles what a request of this (longest) prompt length will run, outside any timing.

    trial=True also runs a request through the same executables (token 0s, at most one full chunk plus
    the same last chunk, two new tokens) and throws it away, so what a first run costs beyond compiling
    (allocating the cache, first executions) is paid here too.
    """
    greedy = _all_greedy(params, batch)
    sizes = self._chunks(prompt_len)
    for size in sizes[:-1]:
      self.extend_fn(batch, size)
    self.prefill_fn(batch, sizes[-1], greedy)
    self._advance_fn(batch, greedy)
    if trial:
      n = prompt_len if len(sizes) == 1 else prompt_len - (len(sizes) - 2) * self.prefill_chunk
      n = min(n, self.max_context - 2)
      self.generate_batch([[0] * n] * batch, 2, params, ignore_eos=True)
      self._history = None

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
               greedy: bool, reuse: bool) -> tuple[DecodeState, list[int]]:
    """Runs the prompts chunk by chunk (from what the cache already holds, with reuse); returns the state
    and, per row, how many prompt tokens were reused."""
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
        state = self.prefill_fn(b, size, greedy)(self.weights, cache, tokens, lengths, start, last, pos, sampler,
                                                 limits, eog)
      offset += size
    return state, starts

  def _setup(self, prompts, max_tokens, params, seed, ignore_eos):
    """Host arrays for a request: sampler, per-row token limits and end-of-generation tables."""
    b = len(prompts)
    rows = rows_of(params, b)
    sampler = Sampler.create(rows, b, seed, history=prompts, vocab_size=self.config.vocab_size)
    limits = np.asarray([min(self.max_context, len(p) + max_tokens - 1) for p in prompts], np.int32)
    eog_ids = () if ignore_eos or self.tokenizer is None else self.tokenizer.eog_ids
    return sampler, limits, eog_table(eog_ids, b), greedy_mode(rows)

  def stream_tokens(self, prompts: Sequence[Sequence[int]], max_tokens: int,
                    params: SamplingParams | Sequence[SamplingParams] = SamplingParams(), seed: int = 0,
                    pipelined: bool = True, ignore_eos: bool = False,
                    reuse_cache: bool = False) -> Iterator[tuple[np.ndarray, float]]:
    """Yields (tokens [B], seconds since submission) for up to max_tokens decode positions: the
    prefill's token, then one per decode step, until every sequence is done on the device or the caller
    stops iterating. Pipelined: step i+1 is dispatched before token i is read. A token is NONFINITE (-1)
    where the model's logits were not finite."""
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
      raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if not prompts:
      raise ValueError("no prompts given")
    for p in prompts:
      self.check_prompt(p)
    sampler, limits, eog, greedy = self._setup(prompts, max_tokens, params, seed, ignore_eos)
    if not self._lock.acquire(blocking=False):
      raise RuntimeError("this Engine is running a request in another thread: an Engine serves one request at "
                         "a time (use one Engine per thread)")
    try:
      self._close_abandoned()
      gen = self._stream(prompts, max_tokens, sampler, limits, eog, greedy, pipelined, reuse_cache)
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
    advance = self._advance_fn(b, greedy)
    # Tokens of each call on the device, in order: [B] or [K, B]. Pipelined, they are copied (snapshot)
    # before the next call donates them; otherwise they are read first and the call is the only dispatch.
    keep = _snapshot_jit if pipelined else (lambda x: x)
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
      if any(a.is_deleted() for a in jax.tree.leaves(state)):
        # Interrupted (Ctrl-C) between a call that donated the state and the assignment of what it returned:
        # the buffers are gone, so is the cache; the next request starts from a new one.
        self._cache, self._history = None, None
      else:
        # What the cache now holds, per row: the prompt and the generated tokens written before it stopped.
        pos = np.asarray(state.pos)
        gen = np.stack(read, axis=1) if read else np.zeros((len(prompts), 0), np.int32)
        self._history = [list(p) + [int(t) for t in gen[r, :max(0, pos[r] - len(p))]]
                         for r, p in enumerate(prompts)]
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

  def _timing_start(self, prompt_ids: Sequence[int], tokens: int) -> tuple[DecodeState, Callable]:
    """A greedy batch-1 request of `tokens` tokens for a timing loop, prefilled: (its state, the compiled
    single step). The caller holds the lock and puts the last state's cache back."""
    self.check_prompt(prompt_ids)
    sampler, limits, eog, greedy = self._setup([prompt_ids], tokens, SamplingParams(), 0, True)
    self._close_abandoned()
    state, _ = self._prefill([prompt_ids], sampler, limits, eog, greedy, False)
    return state, self.step_fn(1, greedy)

  def burst_step_ms(self, prompt_ids: Sequence[int], steps: int) -> float:
    """Mean ms per greedy decode step when `steps` steps are dispatched back to back and read once at the
    end: the device-bound step time when host dispatch keeps ahead of the device."""
    steps = min(steps, self.max_context - len(prompt_ids))
    with self._lock:
      state, step = self._timing_start(prompt_ids, steps + 1)
      state = step(self.weights, state)
      state.tokens.block_until_ready()
      t0 = time.perf_counter()
      for _ in range(steps - 1):
        state = step(self.weights, state)
      state.tokens.block_until_ready()
      elapsed = time.perf_counter() - t0
      self._cache, self._history = state.cache, None
    return elapsed / max(1, steps - 1) * 1e3

  def host_timings(self, prompt_ids: Sequence[int], steps: int) -> dict:
    """Where the host's time of a greedy decode step goes: medians in ms over `steps` steps of each loop.

    serial_*: the host reads each token before dispatching the next step (the streaming loop): dispatch
    (the step call returning, the device idle), read (np.asarray of its token: the device step and the copy
    back), step (the two). snapshot_ms: the pipelined loop's copy of a token before the next step donates
    it (a dispatch and its read). busy_dispatch_ms: the step call returning while earlier steps still run
    (the pipelined and burst loops). call_*: the same for the engine's calls of tokens_per_call steps (the
    streaming loop's calls): call_dispatch_ms, call_read_ms (the device's K steps and the copy back), and
    call_device_ms, a call's time when calls are dispatched back to back.
    """
    steps = max(2, min(steps, (self.max_context - len(prompt_ids)) // 3))
    med = lambda xs: statistics.median(xs) * 1e3
    with self._lock:
      state, step = self._timing_start(prompt_ids, 3 * steps + 1)
      state = step(self.weights, state)
      np.asarray(_snapshot_jit(state.tokens))
      dispatch, read, snap, busy = [], [], [], []
      for _ in range(steps):
        t0 = time.perf_counter()
        state = step(self.weights, state)
        t1 = time.perf_counter()
        np.asarray(state.tokens)
        t2 = time.perf_counter()
        dispatch.append(t1 - t0)
        read.append(t2 - t1)
      for _ in range(steps):
        t0 = time.perf_counter()
        np.asarray(_snapshot_jit(state.tokens))
        snap.append(time.perf_counter() - t0)
      for _ in range(steps):
        t0 = time.perf_counter()
        state = step(self.weights, state)
        busy.append(time.perf_counter() - t0)
      # The calls of K steps (past the request's limit the rows are done: the same kernels run); greedy, as
      # the request _timing_start prefilled.
      advance = self._advance_fn(1, True)
      block = None
      state, block, out = advance(state, block)
      np.asarray(out)
      cdispatch, cread = [], []
      for _ in range(8):
        t0 = time.perf_counter()
        state, block, out = advance(state, block)
        t1 = time.perf_counter()
        np.asarray(out)
        cdispatch.append(t1 - t0)
        cread.append(time.perf_counter() - t1)
      t0 = time.perf_counter()
      for _ in range(8):
        state, block, out = advance(state, block)
      np.asarray(out)
      cdevice = (time.perf_counter() - t0) / 8
      state.tokens.block_until_ready()
      self._cache, self._history = state.cache, None
    return {"serial_dispatch_ms": med(dispatch), "serial_read_ms": med(read),
            "serial_step_ms": med([a + b for a, b in zip(dispatch, read)]), "snapshot_ms": med(snap),
            "busy_dispatch_ms": med(busy), "steps": steps, "tokens_per_call": self.tokens_per_call_for(1),
            "call_dispatch_ms": med(cdispatch), "call_read_ms": med(cread), "call_device_ms": cdevice * 1e3}

  def generate(self, prompt_ids: Sequence[int], max_tokens: int = 32, params: SamplingParams = SamplingParams(),
               seed: int = 0, stop: Sequence[str] = (), ignore_eos: bool = False, pipelined: bool = True,
               on_text: Callable[[str], None] | None = None, reuse_cache: bool = False) -> GenerationResult:
    """Generates from token ids; `on_text` receives text as it becomes final (for streaming)."""
    return self.generate_batch([prompt_ids], max_tokens, params, seed, stop, ignore_eos, pipelined,
                               on_text=None if on_text is None else (lambda b, piece: on_text(piece)),
                               reuse_cache=reuse_cache)[0]

  def generate_batch(self, prompts: Sequence[Sequence[int]], max_tokens: int = 32,
                     params: SamplingParams | Sequence[SamplingParams] = SamplingParams(), seed: int = 0,
                     stop: Sequence[str] = (), ignore_eos: bool = False, pipelined: bool = True,
                     on_text: Callable[[int, str], None] | None = None,
                     reuse_cache: bool = False) -> list[GenerationResult]:
    """Generates for several prompts of any lengths at once, each stopping on its own.

    Each sequence has its own positions, visible length, sampling settings (one SamplingParams per prompt,
    or one for all) and PRNG key on the device, so its padding never reaches attention, and its output
    equals running it alone. `on_text(b, text)` streams sequence b's text. With reuse_cache, prompts that
    start with what the cache holds from the previous call (same batch size) prefill only the rest.
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
    seqs = [_Sequence(list(p), min(max_tokens, self.max_context - len(p) + 1), max_tokens, self.tokenizer,
                      stop, eog) for p in prompts]
    steps = max(s.limit for s in seqs)
    stream = self.stream_tokens([s.prompt_ids for s in seqs], steps, params, seed, pipelined, ignore_eos,
                                reuse_cache)
    try:
      for tokens, t in stream:
        for b, s in enumerate(seqs):
          piece = s.push(int(tokens[b]), t * 1e3)
          if on_text and piece:
            on_text(b, piece)
        if all(s.finish for s in seqs):
          break
    finally:
      stream.close()
    for s, reused in zip(seqs, self.last_reused):
      s.reused = reused
    return [s.result() for s in seqs]


def greedy_mode(rows: SamplingParams | Sequence[SamplingParams]) -> bool | str:
  """The step a request needs (Engine.step_fn's `greedy`): where every row is greedy, True, or "penalized"
  where some row has a penalty; where some row samples, "sampled" when no row has a penalty (the step
  skips them: a pass over [B, V] less), else False. Each sampling step serves every temperature, top-k,
  top-p, min-p and seed (they are data: changing them never compiles). rows: one SamplingParams or one per
  row."""
  rows = [rows] if isinstance(rows, SamplingParams) else rows
  penalized = any(p.penalized for p in rows)
  if not all(p.greedy for p in rows):
    return False if penalized else "sampled"
  return "penalized" if penalized else True


def _all_greedy(params, batch: int) -> bool | str:
  return greedy_mode(rows_of(params, batch))


def _greedy_only(greedy: bool | str) -> bool:
  """Whether a greedy mode (greedy_mode) compiles only the argmax."""
  return greedy is True or greedy == "penalized"


def _step_flags(greedy: bool | str) -> dict:
  """decode_step's static flags for a greedy mode (see Engine.step_fn)."""
  return {"greedy_only": _greedy_only(greedy), "penalties": greedy in (False, "penalized")}


class _Sequence:
  """Host-side state of one sequence in generate_batch: ids, text, stop conditions, token times."""

  def __init__(self, prompt_ids, limit, max_tokens, tokenizer, stop, eog):
    self.prompt_ids, self.limit, self.max_tokens, self.eog = prompt_ids, limit, max_tokens, eog
    self.stream = StreamDecoder(tokenizer) if tokenizer is not None else None
    self.stops = _StopText(stop)
    self.ids: list[int] = []
    self.times: list[float] = []
    self.finish: str | None = None
    self.error: str | None = None
    self.reused = 0

  def push(self, token: int, t_ms: float) -> str:
    """Takes the next sampled token; returns the text it makes final ("" when finished or held back)."""
    if self.finish:
      return ""
    if token == NONFINITE:
      self.finish = "error"
      self.error = (f"the model's logits were not finite (NaN or inf) at new token {len(self.ids)}: "
                    "nothing was sampled from them")
      return self._flush()
    self.times.append(t_ms)
    if token in self.eog:
      self.finish = "eos"
      return self._flush()
    self.ids.append(token)
    piece = ""
    if self.stream is not None:
      piece, hit = self.stops.push(self.stream.push(token))
      if hit:
        self.finish = "stop"
        return piece
    if len(self.times) >= self.limit:
      self.finish = "length" if self.limit >= self.max_tokens else "context"
      piece += self._flush()
    return piece

  def _flush(self) -> str:
    if self.stream is None:
      return ""
    piece, _ = self.stops.push(self.stream.flush())
    return piece + self.stops.flush()

  def result(self) -> GenerationResult:
    times = self.times
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return GenerationResult(prompt_ids=self.prompt_ids, ids=self.ids,
                            text=self.stops.text if self.stream is not None else "",
                            finish_reason=self.finish or "length", ttft_ms=times[0] if times else 0.0,
                            tpot_ms=tpot, tok_per_s=1e3 / tpot if tpot > 0 else 0.0, token_times_ms=times,
                            error=self.error, reused_tokens=self.reused)
