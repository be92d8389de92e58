"""The engine: compiles prefill (per length bucket) and the decode step, and runs the generate loop.

The decode step donates its whole DecodeState, so every output aliases an input and buffer addresses
stay fixed from step to step: the condition for XLA to replay a recorded command buffer unchanged
(docs/cuda-graphs.md says what was measured about it). The loop is
pipelined: step i+1 is dispatched before token i is read on the host, so the device never waits for the
host; `pipelined=False` reads every token before the next dispatch (the streaming baseline).
"""
from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import graphs
from jaxllm.cache import KVCache, create_cache
from jaxllm.config import Config
from jaxllm.decode import DecodeState, decode_step, prefill
from jaxllm.kernels import resolve_kernels
from jaxllm.model import Weights
from jaxllm.sampling import SamplingParams
from jaxllm.tokenizer import StreamDecoder, Tokenizer

MIN_BUCKET = 16


def prompt_bucket(length: int, max_context: int) -> int:
  """Padded prefill length: the next power of two >= length (at least MIN_BUCKET), capped at max_context."""
  bucket = MIN_BUCKET
  while bucket < length:
    bucket *= 2
  return min(bucket, max_context)


@dataclasses.dataclass
class GenerationResult:
  prompt_ids: list[int]
  ids: list[int]                  # new tokens (the stopping EOS excluded)
  text: str                       # decoded new text (stop string excluded)
  finish_reason: str              # "eos" | "stop" | "length" | "context"
  ttft_ms: float                  # prompt submitted -> first new token on the host
  tpot_ms: float                  # mean time per new token after the first
  tok_per_s: float                # decode tokens per second after the first
  token_times_ms: list[float]     # arrival time of each new token, from the prompt's submission

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


class _StopText:
  """Holds back text that could still become a stop string; reports when one appears."""

  def __init__(self, stops: Sequence[str]):
    self.stops = [s for s in stops if s]
    self.text = ""
    self.emitted = 0

  def push(self, piece: str) -> tuple[str, bool]:
    """Adds decoded text; returns (text safe to show now, whether a stop string was hit)."""
    self.text += piece
    for s in self.stops:
      at = self.text.find(s)
      if at >= 0:
        self.text = self.text[:at]
        out = self.text[self.emitted:]
        self.emitted = len(self.text)
        return out, True
    hold = 0
    for s in self.stops:
      for n in range(min(len(s) - 1, len(self.text)), 0, -1):
        if self.text.endswith(s[:n]):
          hold = max(hold, n)
          break
    safe = len(self.text) - hold
    out = self.text[self.emitted:safe]
    self.emitted = max(self.emitted, safe)
    return out, False

  def flush(self) -> str:
    out = self.text[self.emitted:]
    self.emitted = len(self.text)
    return out


def _compile(fn, donate: int, options: dict, args) -> Callable:
  """jit + lower + compile with per-executable XLA options."""
  return jax.jit(fn, donate_argnums=(donate,), compiler_options=options or None).lower(*args).compile()


def _trial_args(args):
  """Zero-filled device arrays standing in for abstract arguments (for a first, throw-away run)."""
  return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a, args)


def _snapshot(x: jax.Array) -> jax.Array:
  return jnp.copy(x)


_snapshot_jit = jax.jit(_snapshot)


class Engine:
  """A loaded model plus its compiled prefill/decode executables and a reusable KV cache.

  Args:
    config, weights, tokenizer: the model (see jaxllm.load).
    max_context: cache length S (prompt + generated tokens must fit).
    kernels: "auto" | "ffi" | "xla" (see jaxllm.kernels); `self.kernels` is the path that runs.
    graphs: None = the JAXLLM_CUDA_GRAPHS default, True/False to force.
    dtype: activation/cache dtype; default bf16 on GPU, f32 on CPU.
  """

  def __init__(self, config: Config, weights: Weights, tokenizer: Tokenizer | None, max_context: int,
               kernels: str = "auto", graphs_on: bool | None = None, dtype=None):
    if not 2 <= max_context:
      raise ValueError(f"max_context must be >= 2, got {max_context!r}")
    self.config = config
    self.weights = weights
    self.tokenizer = tokenizer
    self.max_context = int(max_context)
    self.kernels = resolve_kernels(kernels)
    self.graphs_requested = graphs.graphs_requested() if graphs_on is None else bool(graphs_on)
    self.compiler_options = graphs.compiler_options(self.graphs_requested)
    self.graphs_fallback: str | None = None   # why command buffers were dropped, if they were
    self.dtype = dtype or (jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32)
    self._cache: KVCache | None = None
    self._prefill: dict[tuple, Callable] = {}
    self._step: dict[SamplingParams, Callable] = {}
    self.compile_seconds = 0.0

  # ---- compilation ---------------------------------------------------------------------------

  def _build(self, fn, donate: int, args) -> Callable:
    """Compiles fn; with command buffers on, also runs it once on zeros. If either fails, warns once with
    the reason, turns command buffers off for this engine, and compiles again without them."""
    t0 = time.perf_counter()
    try:
      compiled = _compile(fn, donate, self.compiler_options, args)
      if self.graphs_requested and self.graphs_fallback is None and jax.default_backend() == "gpu":
        jax.block_until_ready(compiled(*_trial_args(args)))
    except Exception as e:  # XLA reports command-buffer failures as assorted runtime errors
      if not self.graphs_requested or self.graphs_fallback is not None:
        raise
      self.graphs_fallback = f"{type(e).__name__}: {e}".splitlines()[0][:300]
      warnings.warn(f"jaxllm: CUDA graphs (XLA command buffers) failed, running without them: "
                    f"{self.graphs_fallback}", RuntimeWarning, stacklevel=3)
      self.compiler_options = graphs.compiler_options(False)
      self._prefill.clear()
      self._step.clear()
      compiled = _compile(fn, donate, self.compiler_options, args)
    self.compile_seconds += time.perf_counter() - t0
    return compiled

  @property
  def graphs_active(self) -> bool:
    """Command buffers requested and not dropped by a fallback (whether XLA used them: graph_state())."""
    return self.graphs_requested and self.graphs_fallback is None

  def _take_cache(self, batch: int) -> KVCache:
    """The engine's cache for `batch` sequences (reused across calls; the old one is given up)."""
    cache, self._cache = self._cache, None
    if cache is None or cache.k.is_deleted() or cache.batch != batch:
      cache = create_cache(self.config, batch, self.max_context, self.dtype)
    return cache

  def _cache_spec(self, batch: int) -> KVCache:
    c = self.config
    kv = jax.ShapeDtypeStruct((c.n_layers, batch, c.n_kv_heads, self.max_context, c.head_dim), self.dtype)
    return KVCache(k=kv, v=kv)

  def prefill_fn(self, bucket: int, params: SamplingParams, batch: int = 1) -> Callable:
    """Compiled prefill(weights, cache, tokens [B, bucket], lengths [B], key) -> DecodeState."""
    key = (batch, bucket, params)
    if key not in self._prefill:
      fn = functools.partial(prefill, self.config, params=params, kernels=self.kernels)
      args = (self.weights, self._cache_spec(batch), jax.ShapeDtypeStruct((batch, bucket), jnp.int32),
              jnp.ones((batch,), jnp.int32), jax.random.PRNGKey(0))
      self._prefill[key] = self._build(fn, 1, args)                      # (weights, cache, ...)
    return self._prefill[key]

  def step_fn(self, params: SamplingParams, batch: int = 1) -> Callable:
    """Compiled decode_step(weights, state) -> state, the state donated."""
    if (batch, params) not in self._step:
      fn = functools.partial(decode_step, self.config, params=params, kernels=self.kernels)
      self._step[batch, params] = self._build(fn, 1, (self.weights, self._state_spec(batch)))  # (weights, state)
    return self._step[batch, params]

  def _state_spec(self, batch: int = 1) -> DecodeState:
    vec = jax.ShapeDtypeStruct((batch,), jnp.int32)
    return DecodeState(cache=self._cache_spec(batch), tokens=vec, pos=vec,
                       key=jax.ShapeDtypeStruct((2,), jnp.uint32))

  def graph_state(self, params: SamplingParams = SamplingParams(), dump_dir: str | None = None) -> dict:
    """What XLA actually did with the decode step: compiles it once more with a dump and reads it.

    Returns a dict with "state" ("on" | "off" | "unknown"), "requested", the command-buffer count and
    the share of the step's work thunks they hold ("coverage"), and the user's XLA_FLAGS setting if any.
    `dump_dir` keeps XLA's dump there (default: a temporary directory).
    """
    info = {"requested": self.graphs_requested, "fallback": self.graphs_fallback,
            "xla_flags_setting": graphs.user_xla_flag(),
            "backend": jax.default_backend(), "kernels": self.kernels}
    if jax.default_backend() != "gpu":
      info.update(state="off", reason="XLA command buffers (CUDA graphs) exist only on the GPU backend")
      return info
    import tempfile
    fn = functools.partial(decode_step, self.config, params=params, kernels=self.kernels)
    with tempfile.TemporaryDirectory(prefix="jaxllm-dump-") as tmp:
      target = dump_dir or tmp
      options = dict(self.compiler_options, xla_dump_to=target)
      _compile(fn, 1, options, (self.weights, self._state_spec()))
      info.update(graphs.read_dump(target))
    return info

  def warmup(self, prompt_len: int, params: SamplingParams = SamplingParams(), batch: int = 1) -> None:
    """Compiles what generate() will run for this (longest) prompt length, outside any timing."""
    self.prefill_fn(prompt_bucket(prompt_len, self.max_context), params, batch)
    self.step_fn(params, batch)

  # ---- generation ----------------------------------------------------------------------------

  def check_prompt(self, prompt_ids: Sequence[int]) -> None:
    n = len(prompt_ids)
    if n == 0:
      raise ValueError("the prompt is empty: give at least one token")
    if n >= self.max_context:
      raise ValueError(f"the prompt has {n} tokens but the context holds {self.max_context} "
                       f"(--max-context): it must be shorter than the context to leave room to generate")
    bad = [t for t in prompt_ids if not 0 <= t < self.config.vocab_size]
    if bad:
      raise ValueError(f"prompt token ids must be in [0, {self.config.vocab_size}), got {bad[:5]}")

  def _prefill_batch(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int):
    """Validates and pads the prompts, runs prefill; returns (state, lengths)."""
    for p in prompts:
      self.check_prompt(p)
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    bucket = prompt_bucket(int(lengths.max()), self.max_context)
    tokens = np.zeros((len(prompts), bucket), np.int32)
    for b, p in enumerate(prompts):
      tokens[b, :len(p)] = p
    prefill_fn = self.prefill_fn(bucket, params, len(prompts))
    state = prefill_fn(self.weights, self._take_cache(len(prompts)), jnp.asarray(tokens), jnp.asarray(lengths),
                       jax.random.PRNGKey(seed))
    return state, lengths

  def _stream(self, prompts: Sequence[Sequence[int]], steps: int, params: SamplingParams, seed: int,
              pipelined: bool) -> Iterator[tuple[np.ndarray, float]]:
    """Yields (tokens [B], seconds since submission) for `steps` decode positions: the prefill's token,
    then one per decode step. Pipelined: step i+1 is dispatched before token i is read."""
    if not isinstance(steps, int) or steps < 1:
      raise ValueError(f"max_tokens must be an integer >= 1, got {steps!r}")
    t0 = time.perf_counter()
    state, _ = self._prefill_batch(prompts, params, seed)
    step = self.step_fn(params, len(prompts))
    pending = [_snapshot_jit(state.tokens)]
    produced = 0
    try:
      while pending:
        if pipelined and produced + len(pending) < steps:
          state = step(self.weights, state)              # dispatch ahead, then read the older token
          pending.append(_snapshot_jit(state.tokens))
        tokens = np.asarray(pending.pop(0))
        produced += 1
        yield tokens, time.perf_counter() - t0
        if produced >= steps:
          break
        if not pipelined:
          state = step(self.weights, state)
          pending.append(_snapshot_jit(state.tokens))
    finally:
      self._cache = state.cache

  def stream_ids(self, prompt_ids: Sequence[int], max_tokens: int, params: SamplingParams = SamplingParams(),
                 seed: int = 0, pipelined: bool = True) -> Iterator[tuple[int, float]]:
    """Yields (token id, seconds since the prompt was submitted) for up to max_tokens new tokens.

    The caller decides when to stop (EOS, stop strings) by ceasing to iterate. Generation also ends
    when the context is full.
    """
    self.check_prompt(prompt_ids)
    if isinstance(max_tokens, int) and max_tokens >= 1:
      max_tokens = min(max_tokens, self.max_context - len(prompt_ids) + 1)
    for tokens, t in self._stream([prompt_ids], max_tokens, params, seed, pipelined):
      yield int(tokens[0]), t

  def burst_step_ms(self, prompt_ids: Sequence[int], steps: int,
                    params: SamplingParams = SamplingParams()) -> float:
    """Mean ms per decode step when `steps` steps are dispatched back to back and read once at the end:
    the device-bound step time when host dispatch keeps ahead of the device."""
    steps = min(steps, self.max_context - len(prompt_ids))
    state, _ = self._prefill_batch([prompt_ids], params, 0)
    step = self.step_fn(params)
    state = step(self.weights, state)
    state.tokens.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(steps - 1):
      state = step(self.weights, state)
    state.tokens.block_until_ready()
    elapsed = time.perf_counter() - t0
    self._cache = state.cache
    return elapsed / max(1, steps - 1) * 1e3

  def generate(self, prompt_ids: Sequence[int], max_tokens: int = 32, params: SamplingParams = SamplingParams(),
               seed: int = 0, stop: Sequence[str] = (), ignore_eos: bool = False, pipelined: bool = True,
               on_text: Callable[[str], None] | None = None) -> GenerationResult:
    """Generates from token ids; `on_text` receives text as it becomes final (for streaming)."""
    return self.generate_batch([prompt_ids], max_tokens, params, seed, stop, ignore_eos, pipelined,
                               on_text=None if on_text is None else (lambda b, piece: on_text(piece)))[0]

  def generate_batch(self, prompts: Sequence[Sequence[int]], max_tokens: int = 32,
                     params: SamplingParams = SamplingParams(), seed: int = 0, stop: Sequence[str] = (),
                     ignore_eos: bool = False, pipelined: bool = True,
                     on_text: Callable[[int, str], None] | None = None) -> list[GenerationResult]:
    """Generates for several prompts of any lengths at once, each stopping on its own.

    Each sequence has its own positions and visible length on the device, so its padding never reaches
    attention, and greedy output equals running it alone. `on_text(b, text)` streams sequence b's text.
    """
    if self.tokenizer is None and stop:
      raise ValueError("stop strings need a tokenizer")
    if not isinstance(max_tokens, int) or max_tokens < 1:
      raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if not prompts:
      raise ValueError("no prompts given")
    for p in prompts:
      self.check_prompt(p)
    eog = frozenset() if ignore_eos or self.tokenizer is None else self.tokenizer.eog_ids
    seqs = [_Sequence(list(p), min(max_tokens, self.max_context - len(p) + 1), max_tokens, self.tokenizer,
                      stop, eog) for p in prompts]
    steps = max(s.limit for s in seqs) if seqs else 0
    for tokens, t in self._stream([s.prompt_ids for s in seqs], steps, params, seed, pipelined):
      for b, s in enumerate(seqs):
        piece = s.push(int(tokens[b]), t * 1e3)
        if on_text and piece:
          on_text(b, piece)
      if all(s.finish for s in seqs):
        break
    return [s.result() for s in seqs]


class _Sequence:
  """Host-side state of one sequence in generate_batch: ids, text, stop conditions, token times."""

  def __init__(self, prompt_ids, limit, max_tokens, tokenizer, stop, eog):
    self.prompt_ids, self.limit, self.max_tokens, self.eog = prompt_ids, limit, max_tokens, eog
    self.stream = StreamDecoder(tokenizer) if tokenizer is not None else None
    self.stops = _StopText(stop)
    self.ids: list[int] = []
    self.times: list[float] = []
    self.finish: str | None = None

  def push(self, token: int, t_ms: float) -> str:
    """Takes the next sampled token; returns the text it makes final ("" when finished or held back)."""
    if self.finish:
      return ""
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
                            tpot_ms=tpot, tok_per_s=1e3 / tpot if tpot > 0 else 0.0, token_times_ms=times)
