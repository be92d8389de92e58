"""The device side of continuous batching: one DecodeState of N slots and the programs that change it.

The server keeps a single batched DecodeState (cache [L, N, G, S, Dh], one row per slot) for its whole life.
Busy slots are always its first rows (the scheduler keeps them packed with swap_rows), and each decode call
runs the engine's decode program on the first `count` rows only, count the smallest of COUNTS(N) = 1, 2, 4,
..., N that covers the busy ones: a step costs what its rows cost (on this 2-core CPU a 4-row step of
smollm2 took 4x a 1-row one), so one request alone decodes at the speed it has alone. A free row inside the
count is a done row, which the step runs but which writes nothing. A request joins by writing its own row:

  extend_slot(weights, state, slot, tokens [1, C], lengths [1], start [1], last [1, D]) -> (state, last)
      runs a full prefill chunk of one request into row `slot` (its cache row cut out, extended at batch 1,
      put back) and marks the row done, so decode steps between two chunks leave it alone;
  admit_slot(weights, state, slot, tokens [1, T], lengths, start, last, pos, sampler, limit, eog) -> state
      runs the last chunk (T a power-of-two bucket), samples the first token and writes the row's whole
      state (token, position, limit, end-of-generation ids, sampling settings and key): the row decodes from
      the next step on;
  swap_rows(state, a, b) -> state
      exchanges two rows (cache and per-row values): how the scheduler keeps busy rows first without losing
      what a free row's cache holds (prefix reuse);
  decode_rows(weights, state, block [K, count]) -> (state, block)
      the engine's decode program (Engine.decode_program: K steps a call) on rows [0, count), the rest
      untouched; the masked variant (one step a call) draws each row under its token mask;
  put_masks(state, masks [N, ceil(V / 32)]) -> state
      the token masks of the next masked call: a grammar's for a row under one (jaxllm.structured), every
      token for the others;
  score_slot(weights, state, slot, tokens [1, T], start [1], targets [1, T]) -> (logprobs [T], top ids and
      logprobs [T, TOP_LOGPROBS])
      the model's log-probabilities of `targets` after each of `tokens` run from `start` in row `slot` (a
      copy of its cache: the state is read, never changed), for OpenAI's logprobs: the prompt's (echo) after
      admission, a request's new tokens after each decode call.

Slot indices are data (int32 scalars), so each program is compiled once per chunk size or row count: with
the decode step's two modes (every active row greedy without penalties: the argmax step; else the full
sampler), and where the server takes a top_k above MAX_TOP_K a third (WIDE: the full sampler with the wide
step, sampling.Sampler.wide_top_k, whose first tokens have their own admit programs too), the server compiles
everything at start-up (SlotPrograms.warmup) and nothing while it serves. A
prompt is prefilled at batch 1 whatever N is, and its first token and decode steps are the same computation
as Engine.generate's for that request alone.

Token masks: the state's Sampler always holds a mask per row (uint32 [N, ceil(V / 32)], every bit set for a
row without a grammar), so admitting a request under a grammar changes data, never a program: admit_slot
samples its first token under its mask. The decode calls while no busy row has a grammar are the engine's own
programs (K steps a call, pipelined): decode_rows hands them the rows without the mask, which they never see
(nor pay for). While some row has one, the call is the masked program of one step, the full sampler over the
mask (Sampler.mask: then the step never takes the GPU's argmax head, decode.decode_step), after put_masks.
Logit biases ride the same way: the state's Sampler always holds MAX_LOGIT_BIAS (id, bias) pairs per row
(none used for a row without biases), written with the row at admission; the masked program applies them, so
a row with biases decodes in the masked program (one step a call) beside rows without, in one batch.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.cache import KVCache, check_fits
from jaxllm.engine import snapshot
from jaxllm.decode import MAX_EOG, NO_EOG, DecodeState, eog_table, extend, finish_prefill, sequence_logits
from jaxllm.programs import prompt_bucket
from jaxllm.sampling import MAX_TOP_K, Sampler, SamplingParams, full_mask


def counts(slots: int) -> list[int]:
  """The row counts a server of `slots` slots decodes with: powers of two below it, and itself."""
  out = [1]
  while out[-1] * 2 < slots:
    out.append(out[-1] * 2)
  return out + [slots] if out[-1] != slots else out


TOP_LOGPROBS = 20        # alternatives a score call returns per position (OpenAI's top_logprobs at most)
SCORE_CHUNK = 128        # tokens per score call at most: its logits are [T, V] f32


# The decode modes the server compiles (Engine.step_fn's `greedy`): the argmax-only step while every active
# row is greedy without penalties, else the full sampler (temperature, top-k/p, min-p, penalties, seeds); WIDE,
# the full sampler with the wide step, while some row samples with a top_k above MAX_TOP_K.
GREEDY, FULL, WIDE = True, False, "wide"
_ENGINE_MODE = {GREEDY: True, FULL: False, WIDE: "wide-penalized"}     # as Engine.decode_program takes them


def _with_wide(state: DecodeState, wide: bool) -> DecodeState:
  """The state with its Sampler's static wide_top_k set (the arrays as they are)."""
  return dataclasses.replace(state, sampler=dataclasses.replace(state.sampler, wide_top_k=wide))


def _row_cache(cache: KVCache, slot: jax.Array) -> KVCache:
  """Row `slot` of a cache [L, N, G, S, Dh], as a batch-1 cache."""
  take = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=slot, slice_size=1, axis=1)
  return dataclasses.replace(cache, k=take(cache.k), v=take(cache.v))


def _put(big: jax.Array, row: jax.Array, slot: jax.Array, axis: int = 0) -> jax.Array:
  return jax.lax.dynamic_update_slice_in_dim(big, row.astype(big.dtype), slot, axis)


def _put_cache(cache: KVCache, row: KVCache, slot: jax.Array) -> KVCache:
  return dataclasses.replace(cache, k=_put(cache.k, row.k, slot, 1), v=_put(cache.v, row.v, slot, 1))


def _rows(state: DecodeState, count: int) -> DecodeState:
  """Rows [0, count) of a state (count static)."""
  if count == state.tokens.shape[0]:
    return state
  cut = functools.partial(jax.lax.slice_in_dim, start_index=0, limit_index=count)
  return DecodeState(cache=dataclasses.replace(state.cache, k=cut(state.cache.k, axis=1), v=cut(state.cache.v, axis=1)),
                     tokens=cut(state.tokens), pos=cut(state.pos), done=cut(state.done), limit=cut(state.limit),
                     eog=cut(state.eog), sampler=jax.tree.map(cut, state.sampler))


def _put_rows(state: DecodeState, rows: DecodeState, slot) -> DecodeState:
  """state with rows (a state of fewer rows) written from row `slot` on (its arrays; the Sampler's static
  wide_top_k stays the state's)."""
  put = functools.partial(_put, slot=slot)
  rows = _with_wide(rows, state.sampler.wide_top_k)
  return DecodeState(cache=_put_cache(state.cache, rows.cache, slot), tokens=put(state.tokens, rows.tokens),
                     pos=put(state.pos, rows.pos), done=put(state.done, rows.done), limit=put(state.limit, rows.limit),
                     eog=put(state.eog, rows.eog), sampler=jax.tree.map(put, state.sampler, rows.sampler))


def _row(state: DecodeState, slot) -> DecodeState:
  """Row `slot` of a state, as a state of one row."""
  take = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=slot, slice_size=1)
  return DecodeState(cache=_row_cache(state.cache, slot), tokens=take(state.tokens), pos=take(state.pos),
                     done=take(state.done), limit=take(state.limit), eog=take(state.eog),
                     sampler=jax.tree.map(take, state.sampler))


def swap_rows(state: DecodeState, a, b) -> DecodeState:
  """Rows a and b of a state exchanged (a == b leaves it as it is)."""
  row_a, row_b = _row(state, a), _row(state, b)
  return _put_rows(_put_rows(state, row_b, a), row_a, b)


def _with_mask(state: DecodeState, mask, bias_ids=None, bias_values=None) -> DecodeState:
  return dataclasses.replace(state, sampler=dataclasses.replace(state.sampler, mask=mask, bias_ids=bias_ids,
                                                                bias_values=bias_values))


def decode_rows(step, count: int, k: int, masked: bool, wide: bool, weights, state: DecodeState, block):
  """`step` (Engine.decode_program's function: one step for k = 1, else k steps with a [k, count] token block)
  on rows [0, count) of state; returns (state, block [k, count] of the call's tokens). masked (static): the
  step draws under the rows' token masks and logit biases; else it gets the rows without them (the engine's
  program as it is), and they pass through unchanged. wide (static): the step's Sampler runs the wide step."""
  s = state.sampler
  kept = (s.mask, s.bias_ids, s.bias_values)
  if not masked:
    state = _with_mask(state, None)
  rows = _with_wide(_rows(state, count), wide)
  if k == 1:
    rows = step(weights, rows)
    block = rows.tokens[None]
  else:
    rows, block = step(weights, rows, block)
  out = _with_wide(rows, state.sampler.wide_top_k) if count == state.tokens.shape[0] else _put_rows(state, rows, 0)
  return (out if masked else _with_mask(out, *kept)), block


def put_masks(state: DecodeState, masks) -> DecodeState:
  """The state with the token masks [N, ceil(V / 32)] uint32 of the next masked decode call (the rows' logit
  biases kept: each row's were written with its first token, admit_slot)."""
  return _with_mask(state, masks, state.sampler.bias_ids, state.sampler.bias_values)


def score_slot(config, weights, state: DecodeState, slot, tokens, start, targets, *, kernels, layers):
  """Log-probabilities [T] of targets [1, T] after tokens [1, T] run from start in row `slot`, and the
  TOP_LOGPROBS best ids and log-probabilities [T, TOP_LOGPROBS] at each position (the raw model's, before any
  sampling setting). Positions past the real tokens give values that the caller drops."""
  lg, _ = sequence_logits(config, weights, _row_cache(state.cache, slot), tokens, start, kernels=kernels,
                          layers=layers)
  lp = jax.nn.log_softmax(lg[0].astype(jnp.float32), axis=-1)                  # [T, V]
  chosen = jnp.take_along_axis(lp, targets[0][:, None], axis=-1)[:, 0]
  top_lp, top_ids = jax.lax.top_k(lp, min(TOP_LOGPROBS, lp.shape[-1]))
  return chosen, top_ids.astype(jnp.int32), top_lp


def extend_slot(config, weights, state: DecodeState, slot, tokens, lengths, start, last, *, kernels, layers):
  """A full prefill chunk of one request into row `slot`; the row is marked done until admit_slot."""
  row, last = extend(config, weights, _row_cache(state.cache, slot), tokens, lengths, start, last,
                     kernels=kernels, layers=layers)
  done = state.done.at[slot].set(True)
  return dataclasses.replace(state, cache=_put_cache(state.cache, row, slot), done=done), last


def admit_slot(config, weights, state: DecodeState, slot, tokens, lengths, start, last, pos, sampler, limit, eog,
               *, kernels, layers) -> DecodeState:
  """The last prefill chunk of one request into row `slot`, its first token sampled: the row joins the batch."""
  row, hidden = extend(config, weights, _row_cache(state.cache, slot), tokens, lengths, start, last,
                       kernels=kernels, layers=layers)
  new = finish_prefill(config, weights, row, hidden, pos, sampler, limit, eog, kernels=kernels)
  return _put_rows(state, new, slot)


def _spec(tree):
  """The abstract arguments of a state: shapes, dtypes, and the layout of arrays laid out on a mesh (tensor
  parallel: the cache split by KV head)."""
  def one(a):
    sharding = getattr(a, "sharding", None)
    sharding = sharding if isinstance(sharding, jax.sharding.NamedSharding) else None
    return jax.ShapeDtypeStruct(np.shape(a), jnp.asarray(a).dtype, sharding=sharding)
  return jax.tree.map(one, tree)


@dataclasses.dataclass
class Prefill:
  """One request's prompt on its way into a slot, a chunk at a time (SlotPrograms.prefill_chunks)."""
  slot: int
  chunks: list[tuple[np.ndarray, int, int]]   # (tokens [1, size], real length, start position) per chunk
  pos: int                                    # tokens in the row's cache once it is all run
  sampler: Sampler                            # the row's sampling state (host arrays, batch 1)
  limit: int
  eog: np.ndarray                             # [1, MAX_EOG]
  last: jax.Array | None = None               # [1, D] hidden state carried between chunks

  @property
  def remaining(self) -> int:
    return len(self.chunks)


class SlotPrograms:
  """The slot state of an Engine's model: the N-row DecodeState and the compiled programs that change it.

  Args:
    engine: a jaxllm Engine (its weights, kernel path, chunk size, compile cache and decode step).
    slots: N, the rows of the batched cache (requests decoding at once).
    wide_top_k: whether requests may sample with a top_k above MAX_TOP_K (the WIDE programs are compiled too).
  """

  def __init__(self, engine, slots: int, wide_top_k: bool = False):
    if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
      raise ValueError(f"slots must be an integer >= 1, got {slots!r}")
    self.engine, self.slots, self.wide_top_k = engine, slots, bool(wide_top_k)
    self.config = engine.config
    check_fits(self.config, slots, engine.max_context, engine.cache_dtype)
    longest = engine.max_context - 1                  # the longest prompt a slot takes
    chunk = engine.prefill_chunk
    self.buckets = sorted({prompt_bucket(n, chunk) for n in range(1, min(longest, chunk) + 1)})
    self.chunked = longest > engine.prefill_chunk     # whether a prompt can take more than one chunk
    self.score_sizes = [b for b in self.buckets if b <= SCORE_CHUNK] or [self.buckets[0]]
    self.counts = counts(slots)
    self.state = self._empty_state()
    self._blocks: dict[int, jax.Array] = {}          # per row count: the token block its calls donate
    self._calls: dict[int, tuple[int, str]] = {}      # per row count: (decode steps a call, how they run), as the
                                                      # engine chooses (tokens_per_call_for, loop_for)

  def _empty_state(self) -> DecodeState:
    n, engine = self.slots, self.engine
    cache = engine.new_cache(n)
    zeros = np.zeros((n,), np.int32)
    v = self.config.vocab_size
    state = DecodeState(cache=cache, tokens=zeros, pos=zeros, done=np.ones((n,), bool), limit=zeros,
                        eog=np.full((n, MAX_EOG), NO_EOG, np.int32),
                        sampler=Sampler.create(SamplingParams(), n, vocab_size=v, masks=full_mask(n, v),
                                               biases=[None] * n))
    return jax.device_put(state)

  def reset(self) -> None:
    """A new empty state (after a failed program, whose donated state may be gone)."""
    self.state, self._blocks = self._empty_state(), {}

  # ---- programs ------------------------------------------------------------------------------

  def _args(self, size: int, final: bool, wide: bool = False) -> tuple:
    vec = jax.ShapeDtypeStruct((1,), jnp.int32)
    common = (self.engine.weights, _spec(self.state), jax.ShapeDtypeStruct((), jnp.int32),
              jax.ShapeDtypeStruct((1, size), jnp.int32), vec, vec,
              jax.ShapeDtypeStruct((1, self.config.d_model), jnp.float32))
    if not final:
      return common
    v = self.config.vocab_size
    sampler = _spec(Sampler.create(SamplingParams(), 1, vocab_size=v, masks=full_mask(1, v), biases=[None]))
    sampler = dataclasses.replace(sampler, wide_top_k=wide)
    return common + (vec, sampler, vec, jax.ShapeDtypeStruct((1, MAX_EOG), jnp.int32))

  def extend_fn(self) -> Callable:
    e = self.engine
    fn = functools.partial(extend_slot, self.config, kernels=e.kernels, layers=e.prefill_layers)
    key = ("slot-extend", self.slots, e.prefill_chunk)
    return e.compile_program(key, lambda: (fn, 1, self._args(e.prefill_chunk, False)))

  def admit_fn(self, bucket: int, wide: bool = False) -> Callable:
    """admit_slot for a last chunk of `bucket` tokens; wide: for a request whose top_k is above MAX_TOP_K."""
    e = self.engine
    fn = functools.partial(admit_slot, self.config, kernels=e.kernels, layers=e.prefill_layers)
    key = ("slot-admit", self.slots, bucket) + (("wide",) if wide else ())
    return e.compile_program(key, lambda: (fn, 1, self._args(bucket, True, wide)))

  def score_fn(self, size: int) -> Callable:
    e = self.engine
    fn = functools.partial(score_slot, self.config, kernels=e.kernels, layers=e.prefill_layers)
    tokens, vec = jax.ShapeDtypeStruct((1, size), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    return e.compile_program(("slot-score", self.slots, size),
                             lambda: (fn, (), (e.weights, _spec(self.state), scalar, tokens, vec, tokens)))

  def decode_fn(self, count: int, mode: bool | str, masked: bool = False) -> Callable:
    """decode_rows over rows [0, count) in a decode mode (GREEDY, FULL or WIDE): (weights, state, block) ->
    (state, block); masked: one step a call, under the rows' token masks."""
    e = self.engine
    k = self._tokens_per_call(count, masked)
    key = ("slot-decode", self.slots, count, mode, k, self._call(count)[1]) + (("masked",) if masked else ())

    def make():
      step, _, _ = e.decode_program(count, _ENGINE_MODE[mode], k, masked)
      fn = functools.partial(decode_rows, step, count, k, masked, mode == WIDE)
      return fn, (1, 2), (e.weights, _spec(self.state), jax.ShapeDtypeStruct((k, count), jnp.int32))
    return e.compile_program(key, make)

  def _tokens_per_call(self, count: int, masked: bool) -> int:
    """Decode steps a call of `count` rows takes (masked: one)."""
    if masked:
      return 1
    return self._call(count)[0]

  def _call(self, count: int) -> tuple[int, str]:
    """(decode steps a call, their loop) for `count` rows, asked of the engine once per count."""
    if count not in self._calls:
      self._calls[count] = (self.engine.tokens_per_call_for(count), self.engine.loop_for(count))
    return self._calls[count]

  def put_masks_fn(self) -> Callable:
    masks = jax.ShapeDtypeStruct(self.state.sampler.mask.shape, jnp.uint32)
    return self.engine.compile_program(("slot-masks", self.slots),
                                       lambda: (put_masks, 0, (_spec(self.state), masks)))

  def swap_fn(self) -> Callable:
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    return self.engine.compile_program(("slot-swap", self.slots),
                                       lambda: (swap_rows, 0, (_spec(self.state), scalar, scalar)))

  def check(self, params: SamplingParams) -> None:
    """ValueError where these slots cannot sample with `params`: a top_k above MAX_TOP_K without the wide
    programs."""
    if params.wide_top_k and not self.wide_top_k:
      raise ValueError(f"top_k above {MAX_TOP_K} needs slots made with wide_top_k=True (these compile no wide "
                       f"programs), got top_k={params.top_k}")

  def modes(self) -> tuple:
    """The decode modes this server compiles."""
    return (GREEDY, FULL, WIDE) if self.wide_top_k else (GREEDY, FULL)

  def programs(self) -> list[Callable[[], Callable]]:
    """Lookups of every program serving can run, each compiling its program the first time: each chunk bucket,
    each row count in each decode mode (and masked in the sampling ones), the swap, the masks' write."""
    lookups = [self.extend_fn] if self.chunked else []
    lookups += [functools.partial(self.admit_fn, b, wide) for b in self.buckets
                for wide in ((False, True) if self.wide_top_k else (False,))]
    lookups += [self.swap_fn, self.put_masks_fn] + [functools.partial(self.score_fn, n) for n in self.score_sizes]
    lookups += [functools.partial(self.decode_fn, count, mode, masked) for count in self.counts
                for mode in self.modes() for masked in ((False,) if mode == GREEDY else (False, True))]
    return lookups

  def warmup(self) -> None:
    """Compiles every program serving can run, several at a time (Engine.compile_programs), and runs the swap,
    the masks' write and each decode program once on the empty state (every row done: nothing changes), so
    that serving compiles nothing."""
    self.engine.compile_programs(self.programs())
    self.swap(0, 0)
    self.put_masks(full_mask(self.slots, self.config.vocab_size))
    for count in self.counts:
      for mode in self.modes():
        np.asarray(self.decode(count, mode))
        if mode != GREEDY:
          np.asarray(self.decode(count, mode, masked=True))

  # ---- running -------------------------------------------------------------------------------

  def plan(self, slot: int, prompt: Sequence[int], start: int, params: SamplingParams, seed: int, limit: int,
           eog_ids, mask: np.ndarray | None = None, bias: dict[int, float] | None = None) -> Prefill:
    """The chunks that bring prompt[start:] into `slot` (its cache already holding prompt[:start]); mask: the
    token mask [ceil(V / 32)] its first token is drawn under (None: every token); bias: the row's logit biases
    ({token id: bias}), which its first token and every masked decode call apply."""
    self.check(params)
    chunk = self.engine.prefill_chunk
    rest = list(prompt[start:])
    full, tail = divmod(len(rest), chunk)
    if tail == 0:
      full, tail = full - 1, chunk
    chunks, at = [], start
    for j in range(full + 1):
      n = chunk if j < full else tail
      size = chunk if j < full else prompt_bucket(n, chunk)
      tokens = np.zeros((1, size), np.int32)
      tokens[0, :n] = prompt[at:at + n]
      chunks.append((tokens, n, at))
      at += n
    masks = full_mask(1, self.config.vocab_size)
    if mask is not None:
      masks[0] = mask
    sampler = Sampler.create(params, 1, seed, history=[list(prompt)], vocab_size=self.config.vocab_size, masks=masks,
                             biases=[bias])
    return Prefill(slot=slot, chunks=chunks, pos=len(prompt), sampler=sampler, limit=limit,
                   eog=eog_table(eog_ids, 1))

  def prefill_step(self, job: Prefill) -> int | None:
    """Runs the next chunk of `job`; after its last, returns the row's first sampled token (else None)."""
    tokens, n, start = job.chunks.pop(0)
    slot = np.int32(job.slot)
    last = job.last if job.last is not None else np.zeros((1, self.config.d_model), np.float32)
    lengths, starts = np.asarray([n], np.int32), np.asarray([start], np.int32)
    if job.chunks:
      self.state, job.last = self.extend_fn()(self.engine.weights, self.state, slot, tokens, lengths, starts, last)
      return None
    fn = self.admit_fn(tokens.shape[1], job.sampler.wide_top_k)
    self.state = fn(self.engine.weights, self.state, slot, tokens, lengths, starts, last,
                    np.asarray([job.pos], np.int32), job.sampler, np.asarray([job.limit], np.int32), job.eog)
    return int(np.asarray(self.state.tokens)[job.slot])

  def swap(self, a: int, b: int) -> None:
    """Exchanges rows a and b (cache and per-row values)."""
    self.state = self.swap_fn()(self.state, np.int32(a), np.int32(b))

  def put_masks(self, masks: np.ndarray) -> None:
    """Writes the token masks [N, ceil(V / 32)] uint32 that the next masked decode call draws under."""
    self.state = self.put_masks_fn()(self.state, masks)

  def decode(self, count: int, mode: bool | str, masked: bool = False) -> jax.Array:
    """Dispatches one decode call (tokens_per_call steps; masked: one, under the masks put_masks wrote) of rows
    [0, count) and returns its tokens [K, count]: a device copy already on its way to the host (np.asarray reads
    it), so the caller may dispatch the next call, which donates the call's own token block, before reading them."""
    k = self._tokens_per_call(count, masked)
    block = self._blocks.pop((count, k), None)
    if block is None:
      block = np.zeros((k, count), np.int32)
    self.state, block = self.decode_fn(count, mode, masked)(self.engine.weights, self.state, block)
    self._blocks[(count, k)] = block
    tokens = snapshot(block)
    tokens.copy_to_host_async()
    return tokens

  def score(self, slot: int, inputs: Sequence[int], start: int, targets: Sequence[int]) -> list[tuple]:
    """Per target: (log-probability, [(id, log-probability)] * TOP_LOGPROBS), the model's after inputs[i] at
    position start + i of `slot` (whose cache must hold the positions before start)."""
    out = []
    step = self.score_sizes[-1]
    for at in range(0, len(inputs), step):
      n = min(step, len(inputs) - at)
      size = next(b for b in self.score_sizes if b >= n)
      tokens, want = np.zeros((1, size), np.int32), np.zeros((1, size), np.int32)
      tokens[0, :n], want[0, :n] = inputs[at:at + n], targets[at:at + n]
      chosen, ids, lps = self.score_fn(size)(self.engine.weights, self.state, np.int32(slot), tokens,
                                             np.asarray([start + at], np.int32), want)
      chosen, ids, lps = np.asarray(chosen), np.asarray(ids), np.asarray(lps)
      out += [(float(chosen[i]), list(zip(ids[i].tolist(), lps[i].tolist()))) for i in range(n)]
    return out
