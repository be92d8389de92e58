"""The compiled programs an Engine runs, and compiling them.

Programs holds a model's weights and the settings that shape its executables (kernel path, dtypes, cache
length, prefill chunk, decode steps per call, command buffers) and compiles each program once per key:
a prefill chunk (extend_fn), the last chunk with the first token's sampling (prefill_fn), and the decode
step (step_fn, or steps_fn for K steps per call), each from abstract arguments. With command buffers on it
runs a new executable once on zeros, and where either fails it warns, turns command buffers off for this
engine and compiles again without them; with cache_executables it keeps executables on disk (jaxllm.executables).
compile_programs builds many at once on threads (a server's warmup), their trial runs after, one at a time.

greedy_mode names the decode step a request needs: sampling settings are data in the DecodeState, so one
executable serves every request of a batch size and mode. The mode is part of every prefill and decode key
(and so of the disk cache's): it decides the static flags, the Sampler's wide_top_k among them. `masked`
programs take a Sampler with a token mask (a grammar's, per row: Sampler.mask) and apply it; their keys say so.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import executables, graphs, parallel, tuning
from jaxllm.cache import KVCache, create_cache
from jaxllm.config import Config
from jaxllm.cores import pool_threads
from jaxllm.decode import DEVICE_LOOPS, MAX_EOG, DecodeState, decode_step, decode_steps, extend, finish_prefill
from jaxllm.device_memory import out_of_memory
from jaxllm.kernels import fused, resolve_kernels, select
from jaxllm.model import Weights, default_layers, use_fused
from jaxllm.quant import Linear
from jaxllm.sampling import Sampler, SamplingParams, candidates_kernel, full_mask, rows_of

MIN_BUCKET = 16
# Tokens per prefill chunk, measured (docs/results/2026-12-01-h200-prefill.md): on the H200 a 32000-token
# prompt took 327 / 279 / 267 ms with chunks of 2048 / 4096 / 8192 (8192 tokens: 36.7 / 34.5 / 34.2 ms), the
# memory beyond weights and cache 0.85 / 0.92 / 1.06 GB: 4096 keeps most of the gain. The CPU's matmuls gain
# nothing past a few hundred rows, and each chunk's intermediates grow with it.
PREFILL_CHUNK = {"gpu": 4096, "cpu": 512}


def prompt_bucket(length: int, cap: int) -> int:
  """Padded length of a chunk: the next power of two >= length (at least MIN_BUCKET), capped at `cap`."""
  bucket = MIN_BUCKET
  while bucket < length:
    bucket *= 2
  return min(bucket, cap)


# Decode steps per executable call by default (Engine.tokens_per_call_for) where the GPU runs the fused step
# (measured on the H200, docs/results/2026-12-01-h200-step.md: 4 and 8 both leave the step device-bound) and
# on the CPU, there in a while loop (docs/results/2026-12-02-cpu-calls.md: 0.74-0.86x the TPOT of one step a
# call, compiled as fast); and the most an Engine takes.
GPU_TOKENS_PER_CALL = 8
CPU_TOKENS_PER_CALL = 8
MAX_TOKENS_PER_CALL = 64


def _lower(fn, donate: int | tuple[int, ...], options: dict, args, tp=None):
  """jit + lower with per-executable XLA options (in the calling thread: JAX's settings, such as a
  default_matmul_precision context, are per thread); on tp's mesh (jaxllm.parallel), a program that takes the
  per-step values replicated and puts its arguments there first."""
  donate = (donate,) if isinstance(donate, int) else donate
  args = args if tp is None else parallel.on_mesh(args, tp)
  return jax.jit(fn, donate_argnums=donate, compiler_options=options or None).lower(*args)


def _finish(lowered, tp=None) -> Callable:
  """XLA's compile of a lowered program: outside the GIL, so compile_programs runs several on threads."""
  compiled = lowered.compile()
  return compiled if tp is None else parallel.placing(compiled)


def _compile(fn, donate: int | tuple[int, ...], options: dict, args, tp=None) -> Callable:
  return _finish(_lower(fn, donate, options, args, tp), tp)


# The JAX settings read when a lowered program is compiled, not when it is lowered (executables._JAX_SETTINGS has
# both kinds: all of them decide the code). By option name (jax_compiler_enable_remat_pass is jax._src.config's
# enable_remat_opt_pass); the two efforts exist up to jax 0.10, the profile version from 0.10 on (jax/_src/compiler.py
# get_compile_options reads it with the levels and the remat pass).
_COMPILE_TIME_SETTINGS = ("jax_optimization_level", "jax_memory_fitting_level", "jax_exec_time_optimization_effort",
                          "jax_memory_fitting_effort", "jax_compiler_enable_remat_pass", "jax_enable_pgle",
                          "jax_pgle_profiling_runs", "jax_xla_profile_version")


def _compile_time_settings() -> list[str]:
  return [str(getattr(jax.config, name, None)) for name in _COMPILE_TIME_SETTINGS]


def _finish_timed(lowered, tp=None) -> tuple[Callable, float]:
  t0 = time.perf_counter()
  return _finish(lowered, tp), time.perf_counter() - t0


def _trial_args(args):
  """Zero-filled device arrays standing in for abstract arguments (for a first, throw-away run)."""
  return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a, args)


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


def greedy_mode(rows: SamplingParams | Sequence[SamplingParams]) -> bool | str:
  """The step a request needs (Engine.step_fn's `greedy`), from its rows (one SamplingParams or one per row):

    True              every row greedy, no penalties (the fused path's argmax head)
    "penalized"       every row greedy, some with penalties
    "sampled"         some row samples, no penalties (the step skips them: a pass over [B, V] less)
    False             some row samples, some row has penalties
    "wide"            as "sampled", and some sampling row's top_k exceeds MAX_TOP_K: the wide step, which
                      sorts the vocabulary for such rows (Sampler.wide_top_k)
    "wide-penalized"  as False, with the wide step

  Each sampling step serves every temperature, top-k (up to MAX_TOP_K; the wide steps any), top-p, min-p,
  penalty window and seed (they are data: changing them never compiles)."""
  rows = [rows] if isinstance(rows, SamplingParams) else rows
  penalized = any(p.penalized for p in rows)
  if any(p.wide_top_k for p in rows):
    return "wide-penalized" if penalized else "wide"
  if not all(p.greedy for p in rows):
    return False if penalized else "sampled"
  return "penalized" if penalized else True


def _all_greedy(params, batch: int) -> bool | str:
  return greedy_mode(rows_of(params, batch))


def _greedy_only(greedy: bool | str) -> bool:
  """Whether a greedy mode (greedy_mode) compiles only the argmax."""
  return greedy is True or greedy == "penalized"


def _wide(greedy: bool | str) -> bool:
  """Whether a greedy mode (greedy_mode) runs the wide step (its Sampler's static wide_top_k)."""
  return greedy in ("wide", "wide-penalized")


def _masked_key(masked: bool) -> tuple:
  """What a masked program adds to its key (nothing for the others: their keys, on disk too, stay as they were)."""
  return ("masked",) if masked else ()


def _step_flags(greedy: bool | str) -> dict:
  """decode_step's static flags for a greedy mode (see Engine.step_fn); the wide step is the Sampler's own
  static field (_wide)."""
  return {"greedy_only": _greedy_only(greedy), "penalties": greedy in (False, "penalized", "wide-penalized")}


@dataclasses.dataclass
class _Batch:
  """The programs compile_programs lowered on its thread and handed to its pool (None: compiled on that thread,
  where its JAX settings differ from a fresh thread's): (key, disk key, whether with command buffers, abstract
  arguments, seconds lowering, the compile's future of (executable, seconds))."""
  thread: int
  pool: ThreadPoolExecutor | None
  pending: list = dataclasses.field(default_factory=list)
  keys: set = dataclasses.field(default_factory=set)

  def add(self, key, disk_key, graphs_on: bool, args, seconds: float, lowered, tp) -> None:
    if self.pool is not None:
      future = self.pool.submit(_finish_timed, lowered, tp)
    else:
      future = Future()
      try:
        future.set_result(_finish_timed(lowered, tp))
      except Exception as e:  # as a pool's future holds it
        future.set_exception(e)
    self.keys.add(key)
    self.pending.append((key, disk_key, graphs_on, args, seconds, future))


class Programs:
  """A model's weights and its compiled programs (the base of Engine, which documents the arguments)."""

  def __init__(self, config: Config, weights: Weights, max_context: int, kernels: str = "auto",
               graphs_on: bool | None = None, dtype=None, prefill_chunk: int | None = None,
               cache_executables: bool = False, cache_dtype=None, tokens_per_call: int | None = None,
               device_loop: str | None = None, mesh=None, autotune: bool | None = None):
    if not isinstance(max_context, int) or max_context < 2:
      raise ValueError(f"max_context must be an integer >= 2, got {max_context!r}")
    if tokens_per_call is not None and (not isinstance(tokens_per_call, int) or isinstance(tokens_per_call, bool)
                                        or not 1 <= tokens_per_call <= MAX_TOKENS_PER_CALL):
      raise ValueError(f"tokens_per_call must be an integer in [1, {MAX_TOKENS_PER_CALL}], got {tokens_per_call!r}")
    if device_loop is not None and device_loop not in DEVICE_LOOPS:
      raise ValueError(f"device_loop must be one of {DEVICE_LOOPS} or None, got {device_loop!r}")
    self.tokens_per_call = tokens_per_call
    self._device_loop = device_loop            # None: chosen per batch size (loop_for)
    self.config = config
    # Tensor parallel (jaxllm.parallel): the weights laid out over the mesh, the cache split by KV head.
    self.tp = None if mesh is None else parallel.plan(config, mesh)
    self.weights = weights if self.tp is None else parallel.shard_weights(weights, self.tp)
    self.cache_config = config if self.tp is None else parallel.cache_config(self.tp)
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
    self.prefill_layers = default_layers()
    self.decode_layers = "unrolled"
    self._exe: dict[tuple, Callable] = {}
    self._batch: _Batch | None = None          # inside compile_programs: the programs its threads compile
    self.compile_seconds = 0.0                 # seconds lowering, compiling and trying (compiles on threads summed)
    # Executables built so far: loaded from the disk cache, compiled, and of those compiled, saved to it.
    self.built = {"loaded": 0, "compiled": 0, "saved": 0}
    # Sharded executables are not kept on disk (their key would have to name the devices of the mesh).
    self.cache_executables = cache_executables and self.tp is None
    self.autotune = tuning.enabled() if autotune is None else bool(autotune)
    self._tuned = False                        # _tune has run
    self.mma_table: tuning.Table = {}          # its choices for the weights' shapes (jaxllm.tuning)
    self.tune_seconds = 0.0                    # what getting them took (timing in a child, or reading the file)

  # ---- compilation ---------------------------------------------------------------------------

  def _build(self, key: tuple, fn, donate: int, args) -> Callable | None:
    """Compiles fn once per key; with command buffers on, also runs it once on zeros. If either fails, warns
    once with the reason, turns command buffers off for this engine, and compiles again without. Inside
    compile_programs (on its thread), lowers fn and leaves the rest to it (returns None)."""
    compiled = self._exe.get(key)
    if compiled is not None:
      return compiled
    self._tune()
    t0 = time.perf_counter()
    options, graphs_on = self.compiler_options, self.graphs_active
    disk_key = None
    if self.cache_executables:
      disk_key = executables.executable_key(key, self.config, self.kernels, jnp.dtype(self.dtype).name,
                                            jnp.dtype(self.cache_dtype).name, self.max_context,
                                            sorted(options.items()), fused.layers_call(),
                                            fused.cpu_fused(), select.ffi_ops(), candidates_kernel(),
                                            sorted(self.mma_table.items()),
                                            jax.tree.structure(args),
                                            [(a.shape, str(a.dtype)) for a in jax.tree.leaves(args)])
      compiled = executables.load_executable(disk_key)
      if compiled is not None:
        self._done(key, compiled, "loaded", time.perf_counter() - t0)
        return compiled
    batch = self._batch if self._batch is not None and self._batch.thread == threading.get_ident() else None
    if batch is not None and key in batch.keys:
      return None
    with tuning.use(self.mma_table):
      lowered = _lower(fn, donate, options, args, self.tp)   # a tracing error is the program's, raised as it is
    if batch is not None:
      batch.add(key, disk_key, graphs_on, args, time.perf_counter() - t0, lowered, self.tp)
      return None
    try:
      compiled = _finish(lowered, self.tp)
      if graphs_on:
        jax.block_until_ready(compiled(*_trial_args(args)))
    except Exception as e:  # XLA reports command-buffer failures as assorted runtime errors
      if not graphs_on:
        raise
      self._drop_graphs(e)
      with tuning.use(self.mma_table):
        compiled = _compile(fn, donate, self.compiler_options, args, self.tp)
      disk_key = None                   # the options changed: this key no longer describes the executable
    if disk_key is not None:
      self.built["saved"] += executables.save_executable(disk_key, compiled)
    self._done(key, compiled, "compiled", time.perf_counter() - t0)
    return compiled

  def _tune(self) -> None:
    """Before the first program: the tensor-core matmul's configuration measured for each W8A16 weight shape
    (jaxllm.tuning; the GPU's FFI path on one device, bf16; timed once a card and kept in the cache)."""
    if self._tuned:
      return
    self._tuned = True
    if (not self.autotune or self.tp is not None or self.kernels == "xla" or jax.default_backend() != "gpu"
        or self.dtype != jnp.bfloat16):
      return
    lins = jax.tree.leaves(self.weights, is_leaf=lambda a: isinstance(a, Linear))
    shapes = {lin.w.shape[-2:] for lin in lins if isinstance(lin, Linear) and lin.quantized and lin.w.dtype == jnp.int8}
    t0 = time.perf_counter()
    self.mma_table = tuning.ensure(shapes, jax.devices()[0].device_kind)
    self.tune_seconds = time.perf_counter() - t0
    self.compile_seconds += self.tune_seconds

  def _done(self, key: tuple, compiled, how: str, seconds: float) -> None:
    self.built[how] += 1
    self.compile_seconds += seconds
    self._exe[key] = compiled

  def _drop_graphs(self, error: Exception) -> None:
    """Command buffers off for this engine after `error` (once): compiles without them from now on, and warns. The
    device out of memory too (its trial holds a second copy of the state; a run without them does not), said so."""
    if self.graphs_fallback is not None:
      return
    self.graphs_fallback = f"{type(error).__name__}: {error}".splitlines()[0][:300]
    self.compiler_options = graphs.compiler_options(False)
    self._exe.clear()
    why = "their trial ran out of device memory" if out_of_memory(error) else "failed"
    warnings.warn(f"jaxllm: CUDA graphs (XLA command buffers) {why}, running without them: "
                  f"{self.graphs_fallback}", RuntimeWarning, stacklevel=4)

  def compile_programs(self, lookups: Sequence[Callable[[], object]], threads: int | None = None) -> None:
    """Runs program lookups (calls that build their program the first time: compile_program's, step_fn, ...)
    with XLA's compiles `threads` at a time (default cores.pool_threads()): each program is lowered here, in this
    thread, and compiled on a thread of its own (outside the GIL; a server's ~40 programs compiled one after
    another took 200 s on an H100 host). Then, here and one at a time, each new executable's trial run (with
    command buffers on: each takes a zero state of its own) and its saving. If a compile or a trial fails with
    command buffers on, they go as in _build, and every program is built again without them."""
    had_graphs = self.graphs_active
    with ThreadPoolExecutor(threads or pool_threads()) as pool:
      # JAX reads some settings as it compiles (optimization effort, ...): where this thread's differ from a
      # fresh thread's (a context manager's), the compiles stay on this thread.
      same = _compile_time_settings() == pool.submit(_compile_time_settings).result()
      self._batch = batch = _Batch(threading.get_ident(), pool if same else None)
      try:
        for lookup in lookups:
          lookup()
      except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)       # an error or Ctrl-C: no compile left waiting
        raise
      finally:
        self._batch = None
      for key, disk_key, graphs_on, args, seconds, future in batch.pending:
        try:
          compiled, compile_seconds = future.result()
          t0 = time.perf_counter()
          if graphs_on and self.graphs_active:
            jax.block_until_ready(compiled(*_trial_args(args)))
        except Exception as e:  # as in _build
          if not graphs_on:
            raise
          self._drop_graphs(e)
        if graphs_on != self.graphs_active:         # compiled with command buffers that are now off
          continue
        if disk_key is not None:
          self.built["saved"] += executables.save_executable(disk_key, compiled)
        self._done(key, compiled, "compiled", seconds + compile_seconds + time.perf_counter() - t0)
    if had_graphs and not self.graphs_active:
      self.compile_programs(lookups, threads)

  @property
  def graphs_active(self) -> bool:
    """Command buffers requested, possible on this backend, and not dropped by a fallback."""
    return self.graphs_requested and self.graphs_fallback is None and _graphs_possible()

  def _cache_spec(self, batch: int) -> KVCache:
    c = self.cache_config
    kv = jax.ShapeDtypeStruct((c.n_layers, batch, c.n_kv_heads, self.max_context, c.head_dim), self.cache_dtype)
    compute = jnp.dtype(self.dtype).name if jnp.dtype(self.dtype) != jnp.dtype(self.cache_dtype) else ""
    spec = KVCache(k=kv, v=kv, compute=compute)
    return spec if self.tp is None else parallel.cache_spec(spec, self.tp)

  def new_cache(self, batch: int) -> KVCache:
    """A KV cache for `batch` sequences (on the mesh, split by KV head, under tensor parallel)."""
    cache = create_cache(self.cache_config, batch, self.max_context, self.dtype, self.cache_dtype)
    return cache if self.tp is None else parallel.shard_cache(cache, self.tp)

  def _sampler_spec(self, batch: int, greedy: bool | str = True, masked: bool = False) -> Sampler:
    """The abstract Sampler of a request in this greedy mode (the wide modes' with wide_top_k; masked: with a
    token mask)."""
    masks = full_mask(batch, self.config.vocab_size) if masked else None
    return dataclasses.replace(_spec(Sampler.create(SamplingParams(), batch, masks=masks)), wide_top_k=_wide(greedy))

  def _state_spec(self, batch: int, greedy: bool | str = True, masked: bool = False) -> DecodeState:
    vec = jax.ShapeDtypeStruct((batch,), jnp.int32)
    return DecodeState(cache=self._cache_spec(batch), tokens=vec, pos=vec,
                       done=jax.ShapeDtypeStruct((batch,), jnp.bool_), limit=vec,
                       eog=jax.ShapeDtypeStruct((batch, MAX_EOG), jnp.int32),
                       sampler=self._sampler_spec(batch, greedy, masked))

  def extend_fn(self, batch: int, size: int) -> Callable:
    """Compiled extend(weights, cache, tokens [B, size], lengths, start, last) -> (cache, last)."""
    fn = functools.partial(extend, self.config, kernels=self.kernels, layers=self.prefill_layers)
    vec = jax.ShapeDtypeStruct((batch,), jnp.int32)
    args = (self.weights, self._cache_spec(batch), jax.ShapeDtypeStruct((batch, size), jnp.int32), vec, vec,
            jax.ShapeDtypeStruct((batch, self.config.d_model), jnp.float32))
    return self._build(("extend", batch, size), fn, 1, args)                 # (weights, cache, ...)

  def prefill_fn(self, batch: int, bucket: int, greedy: bool | str, masked: bool = False) -> Callable:
    """Compiled final prefill chunk (weights, cache, tokens [B, bucket], lengths, start, last, pos, sampler,
    limit, eog) -> DecodeState; masked: the sampler carries token masks."""
    fn = functools.partial(_final_chunk, self.config, greedy_only=_greedy_only(greedy), kernels=self.kernels,
                           layers=self.prefill_layers)
    vec = jax.ShapeDtypeStruct((batch,), jnp.int32)
    args = (self.weights, self._cache_spec(batch), jax.ShapeDtypeStruct((batch, bucket), jnp.int32), vec, vec,
            jax.ShapeDtypeStruct((batch, self.config.d_model), jnp.float32), vec,
            self._sampler_spec(batch, greedy, masked), vec, jax.ShapeDtypeStruct((batch, MAX_EOG), jnp.int32))
    return self._build(("prefill", batch, bucket, greedy) + _masked_key(masked), fn, 1, args)

  def step_fn(self, batch: int = 1, greedy: bool | str = True, masked: bool = False) -> Callable:
    """Compiled decode_step(weights, state) -> state, the state donated.

    greedy: True (every row greedy, no penalties: the fused path's argmax head), "penalized" (every row
    greedy, some with penalties), "sampled" (sampling, no penalties), False (sampling with penalties), or
    "wide" / "wide-penalized" (the same two with the wide top-k step), as greedy_mode says. masked: the
    state's Sampler carries token masks (the step then never takes the argmax head: decode_step).
    """
    return self._build(("step", batch, greedy) + _masked_key(masked), *self.decode_program(batch, greedy, 1, masked))

  def steps_fn(self, batch: int, greedy: bool | str, k: int) -> Callable:
    """Compiled decode_steps(weights, state, block [k, B]) -> (state, block): k steps per call, the state
    and the token block donated."""
    return self._build(("steps", batch, greedy, k, self.loop_for(batch)), *self.decode_program(batch, greedy, k))

  def decode_program(self, batch: int, greedy: bool | str, k: int,
                     masked: bool = False) -> tuple[Callable, int | tuple, tuple]:
    """(function, donated arguments, abstract arguments) of the decode executable of k steps per call:
    decode_step for k = 1, decode_steps with its [k, B] token block otherwise (masked: a state with token masks)."""
    flags = dict(_step_flags(greedy), layers=self.decode_layers)
    state = self._state_spec(batch, greedy, masked)
    if k == 1:
      return (functools.partial(decode_step, self.config, kernels=self.kernels, **flags), 1, (self.weights, state))
    return (functools.partial(decode_steps, self.config, kernels=self.kernels, loop=self.loop_for(batch), **flags),
            (1, 2),
            (self.weights, state, jax.ShapeDtypeStruct((k, batch), jnp.int32)))

  def loop_for(self, batch: int) -> str:
    """How a call of several steps at this batch size runs them (decode.decode_steps' loop): the engine's
    device_loop, or by default "unrolled" where the GPU runs the fused step (K copies of a step that compiles in
    about a second) and "while" elsewhere: on the CPU (K unrolled steps compile for ~20 s instead of ~3) and
    for the GPU's unfused step (K unrolled copies compile for tens of seconds; one copy in a loop runs at the
    unrolled program's TPOT, docs/results/2026-12-01-h200-cluster.md)."""
    if self._device_loop is not None:
      return self._device_loop
    return "unrolled" if self._gpu_fused(batch) else "while"

  def tokens_per_call_for(self, batch: int) -> int:
    """Decode steps per executable call at this batch size: the engine's tokens_per_call, or by default
    GPU_TOKENS_PER_CALL on the GPU (there the host's ~0.3 ms dispatch and ~0.4 ms read, and at batch > 1 each
    row's output handling, would otherwise set the pace: docs/results/2026-12-01-h200-step.md,
    2026-12-05-h200-serve.md) and CPU_TOKENS_PER_CALL on the CPU (a call's launch, the token's copy and read,
    and the host thread waking beside the two compute threads cost 15-25% of a step of one token a call),
    but 1 where the loop is "unrolled" by request (device_loop) and the step is not the GPU's fused one (such
    K-step programs compile for tens of seconds)."""
    if self.tokens_per_call is not None:
      return self.tokens_per_call
    if self._device_loop == "unrolled" and not self._gpu_fused(batch):
      return 1
    return GPU_TOKENS_PER_CALL if jax.default_backend() == "gpu" else CPU_TOKENS_PER_CALL

  def _gpu_fused(self, batch: int) -> bool:
    """Whether a decode step at this batch size runs the GPU's fused layer kernels."""
    return (jax.default_backend() == "gpu"
            and use_fused(self.config, self.weights, self._cache_spec(batch), batch, self.kernels))

  def advance_fn(self, batch: int, greedy: bool | str) -> Callable:
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

  def _chunks(self, n: int) -> list[int]:
    """Chunk sizes (padded) for n new tokens: full chunks, then the last padded to a bucket."""
    full, rest = divmod(max(n, 1), self.prefill_chunk)
    if rest == 0:
      full, rest = full - 1, self.prefill_chunk
    return [self.prefill_chunk] * full + [prompt_bucket(rest, self.prefill_chunk)]
