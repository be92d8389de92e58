"""The engine: compiles prefill (per length bucket) and the decode step, and runs the generate loop.

The decode step donates its whole DecodeState, so every output aliases an input and buffer addresses
stay fixed from step to step (XLA command buffers then replay without re-recording). The loop is
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
               kernels: str = "auto", graphs_on: bool | None = None, dtype=None, batch: int = 1):
    if not 2 <= max_context:
      raise ValueError(f"max_context must be >= 2, got {max_context!r}")
    self.config = config
    self.weights = weights
    self.tokenizer = tokenizer
    self.max_context = int(max_context)
    self.batch = batch
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

  def _take_cache(self) -> KVCache:
    cache = self._cache
    if cache is None or cache.k.is_deleted():
      cache = create_cache(self.config, self.batch, self.max_context, self.dtype)
    self._cache = None
    return cache

  def prefill_fn(self, bucket: int, params: SamplingParams) -> Callable:
    """Compiled prefill(weights, cache, tokens [B, bucket], lengths [B], key) -> DecodeState."""
    key = (bucket, params)
    if key not in self._prefill:
      fn = functools.partial(prefill, self.config, params=params, kernels=self.kernels)
      c = self.config
      kv = jax.ShapeDtypeStruct((c.n_layers, self.batch, c.n_kv_heads, self.max_context, c.head_dim), self.dtype)
      args = (self.weights, KVCache(k=kv, v=kv), jax.ShapeDtypeStruct((self.batch, bucket), jnp.int32),
              jnp.ones((self.batch,), jnp.int32), jax.random.PRNGKey(0))
      self._prefill[key] = self._build(fn, 1, args)                      # (weights, cache, ...)
    return self._prefill[key]

  def step_fn(self, params: SamplingParams) -> Callable:
    """Compiled decode_step(weights, state) -> state, the state donated."""
    if params not in self._step:
      fn = functools.partial(decode_step, self.config, params=params, kernels=self.kernels)
      self._step[params] = self._build(fn, 1, (self.weights, self._state_spec()))   # (weights, state)
    return self._step[params]

  def _state_spec(self) -> DecodeState:
    c, b = self.config, self.batch
    kv = jax.ShapeDtypeStruct((c.n_layers, b, c.n_kv_heads, self.max_context, c.head_dim), self.dtype)
    vec = jax.ShapeDtypeStruct((b,), jnp.int32)
    return DecodeState(cache=KVCache(k=kv, v=kv), tokens=vec, pos=vec,
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
      jax.jit(fn, donate_argnums=(1,), compiler_options=options).lower(self.weights, self._state_spec()).compile()
      info.update(graphs.read_dump(target))
    return info

  def warmup(self, prompt_len: int, params: SamplingParams = SamplingParams()) -> None:
    """Compiles what generate() will run for this prompt length, outside any timing."""
    self.prefill_fn(prompt_bucket(prompt_len, self.max_context), params)
    self.step_fn(params)

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

  def stream_ids(self, prompt_ids: Sequence[int], max_tokens: int, params: SamplingParams = SamplingParams(),
                 seed: int = 0, pipelined: bool = True) -> Iterator[tuple[int, float]]:
    """Yields (token id, seconds since the prompt was submitted) for up to max_tokens new tokens.

    The caller decides when to stop (EOS, stop strings) by ceasing to iterate. Generation also ends
    when the context is full.
    """
    if self.batch != 1:
      raise ValueError("stream_ids runs one sequence; use jaxllm.generate_batch for a batch")
    self.check_prompt(prompt_ids)
    if not isinstance(max_tokens, int) or max_tokens < 1:
      raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    n = len(prompt_ids)
    bucket = prompt_bucket(n, self.max_context)
    prefill_fn, step = self.prefill_fn(bucket, params), self.step_fn(params)
    max_tokens = min(max_tokens, self.max_context - n + 1)
    tokens = np.zeros((1, bucket), np.int32)
    tokens[0, :n] = prompt_ids

    t0 = time.perf_counter()
    state = prefill_fn(self.weights, self._take_cache(), jnp.asarray(tokens),
                       jnp.asarray([n], jnp.int32), jax.random.PRNGKey(seed))
    pending = [_snapshot_jit(state.tokens)]
    produced = 0
    try:
      while pending:
        if pipelined and produced + len(pending) < max_tokens:
          state = step(self.weights, state)              # dispatch ahead, then read the older token
          pending.append(_snapshot_jit(state.tokens))
        token = int(np.asarray(pending.pop(0))[0])
        produced += 1
        yield token, time.perf_counter() - t0
        if produced >= max_tokens:
          break
        if not pipelined:
          state = step(self.weights, state)
          pending.append(_snapshot_jit(state.tokens))
    finally:
      self._cache = state.cache

  def burst_step_ms(self, prompt_ids: Sequence[int], steps: int,
                    params: SamplingParams = SamplingParams()) -> float:
    """Mean ms per decode step when `steps` steps are dispatched back to back and read once at the end:
    the device-bound step time when host dispatch keeps ahead of the device."""
    n = len(prompt_ids)
    bucket = prompt_bucket(n, self.max_context)
    steps = min(steps, self.max_context - n)
    tokens = np.zeros((self.batch, bucket), np.int32)
    tokens[:, :n] = prompt_ids
    state = self.prefill_fn(bucket, params)(self.weights, self._take_cache(), jnp.asarray(tokens),
                                            jnp.full((self.batch,), n, jnp.int32), jax.random.PRNGKey(0))
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
    tok = self.tokenizer
    if tok is None and stop:
      raise ValueError("stop strings need a tokenizer")
    eog = frozenset() if ignore_eos or tok is None else tok.eog_ids
    stream = StreamDecoder(tok) if tok is not None else None
    stops = _StopText(stop)
    ids, times, finish = [], [], "length"
    for token, t in self.stream_ids(prompt_ids, max_tokens, params, seed, pipelined):
      times.append(t * 1e3)
      if token in eog:
        finish = "eos"
        break
      ids.append(token)
      if stream is not None:
        piece, hit = stops.push(stream.push(token))
        if on_text and piece:
          on_text(piece)
        if hit:
          finish = "stop"
          break
    else:
      if len(ids) < max_tokens:
        finish = "context"
    if stream is not None and finish != "stop":
      piece, _ = stops.push(stream.flush())
      piece += stops.flush()
      if on_text and piece:
        on_text(piece)
    text = stops.text if stream is not None else ""
    decode_ms = times[-1] - times[0] if len(times) > 1 else 0.0
    tpot = decode_ms / (len(times) - 1) if len(times) > 1 else 0.0
    return GenerationResult(prompt_ids=list(prompt_ids), ids=ids, text=text, finish_reason=finish,
                            ttft_ms=times[0] if times else 0.0, tpot_ms=tpot,
                            tok_per_s=1e3 / tpot if tpot > 0 else 0.0, token_times_ms=times)
