"""The device side of continuous batching: one DecodeState of N slots and the compiled programs that change it.

The server keeps a single batched DecodeState (cache [L, N, G, S, Dh], one row per slot) for its whole life;
the programs are jaxllm.serve.rows' functions of it. Busy slots are always its first rows (the scheduler keeps
them packed with swap_rows), and each decode call runs the engine's decode program on the first `count` rows
only, count the smallest of COUNTS(N) = 1, 2, 4, ..., N that covers the busy ones: a step costs what its rows
cost (on this 2-core CPU a 4-row step of smollm2 took 4x a 1-row one), so one request alone decodes at the
speed it has alone. A free row inside the count is a done row, which the step runs but which writes nothing.

A request joins by writing its own row: its prompt's full chunks one call each (extend_slot, batch 1), then
its last chunk with its first token (admit_rows). Requests whose last chunks are ready in the same turn are
admitted together, R = 1, 2, 4, ... up to `admit_group` in one call, where R x the chunk's bucket is at most
the engine's prefill chunk (the tokens one call runs), so a burst of short prompts costs a few calls, not one
each (ADMIT_GROUP). Each row's values are its own (the rows of a batch never mix), but a batch of R runs its
matmuls over R x T rows of x, which may take another kernel than one row's T; admit_group=1 keeps every
prompt's prefill at batch 1.

Slot indices are data (int32), so each program is compiled once per chunk size, admission size or row count:
with the decode step's two modes (every active row greedy without penalties: the argmax step; else the full
sampler), and where the server takes a top_k above MAX_TOP_K a third (WIDE: the full sampler with the wide
step, sampling.Sampler.wide_top_k, whose first tokens have their own admit programs too, one request a call),
the server compiles everything at start-up (SlotPrograms.warmup) and nothing while it serves.

Token masks: the state's Sampler always holds a mask per row (uint32 [N, ceil(V / 32)], every bit set for a
row without a grammar), so admitting a request under a grammar changes data, never a program: admit_rows
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

from jaxllm.cache import check_fits
from jaxllm.engine import snapshot
from jaxllm.decode import MAX_EOG, NO_EOG, DecodeState, eog_table
from jaxllm.programs import prompt_bucket
from jaxllm.sampling import MAX_TOP_K, Sampler, SamplingParams, full_mask
from jaxllm.serve.rows import admit_rows, decode_rows, extend_slot, put_masks, score_slot, swap_rows


def counts(slots: int) -> list[int]:
  """The row counts a server of `slots` slots decodes with: powers of two below it, and itself."""
  out = [1]
  while out[-1] * 2 < slots:
    out.append(out[-1] * 2)
  return out + [slots] if out[-1] != slots else out


SCORE_CHUNK = 128        # tokens per score call at most: its logits are [T, V] f32
# Requests admitted in one call at most by default (SlotPrograms' admit_group), and the tokens of such a call at
# most (ADMIT_TOKENS: R x bucket, for R > 1; also at most the prefill chunk). A group pays where a prompt's call
# costs more than its arithmetic (on the GPU, reading every weight for a few tokens), so only short chunks are
# grouped; each admission size is a program compiled at start-up. On the CPU (smollm2-135m, 16 slots, 16-stream
# bursts, docs/results/2026-12-05-cpu-admit-group.md) 4 a call against 1 gave 1.5-13% more tokens a second and a
# 10-13% lower mean TTFT; 8 gave about what 4 gave in one unpaired round. On an H100 (0.5B and 7B shapes, 64
# streams, docs/results/2026-12-06-h100-serve.md) 4 against 1 gave 20% and 34% more tokens a second.
ADMIT_GROUP = 4
ADMIT_TOKENS = 1024

# The decode modes the server compiles (Engine.step_fn's `greedy`): the argmax-only step while every active
# row is greedy without penalties, else the full sampler (temperature, top-k/p, min-p, penalties, seeds); WIDE,
# the full sampler with the wide step, while some row samples with a top_k above MAX_TOP_K.
GREEDY, FULL, WIDE = True, False, "wide"
_ENGINE_MODE = {GREEDY: True, FULL: False, WIDE: "wide-penalized"}     # as Engine.decode_program takes them



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
  """One request's prompt on its way into a slot, a chunk at a time (SlotPrograms.extend_step, then admit)."""
  slot: int
  chunks: list[tuple[np.ndarray, int, int]]   # (tokens [1, size], real length, start position) per chunk
  pos: int                                    # tokens in the row's cache once it is all run
  sampler: Sampler                            # the row's sampling state (host arrays, batch 1)
  limit: int
  eog: np.ndarray                             # [1, MAX_EOG]

  @property
  def remaining(self) -> int:
    return len(self.chunks)


def _last_bucket(jobs: Sequence[Prefill]) -> int:
  """The largest bucket among the jobs' next chunks (their last: the size of the admit call that runs them)."""
  return max(job.chunks[0][0].shape[1] for job in jobs)


class SlotPrograms:
  """The slot state of an Engine's model: the N-row DecodeState and the compiled programs that change it.

  Args:
    engine: a jaxllm Engine (its weights, kernel path, chunk size, compile cache and decode step).
    slots: N, the rows of the batched cache (requests decoding at once).
    wide_top_k: whether requests may sample with a top_k above MAX_TOP_K (the WIDE programs are compiled too).
    admit_group: requests whose last prefill chunks one call runs at most (rounded down to a power of two, at
      most `slots`); None: ADMIT_GROUP; 1: each prompt at batch 1.
  """

  def __init__(self, engine, slots: int, wide_top_k: bool = False, admit_group: int | None = None):
    if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
      raise ValueError(f"slots must be an integer >= 1, got {slots!r}")
    if admit_group is None:
      admit_group = ADMIT_GROUP
    if not isinstance(admit_group, int) or isinstance(admit_group, bool) or admit_group < 1:
      raise ValueError(f"admit_group must be an integer >= 1, got {admit_group!r}")
    self.engine, self.slots, self.wide_top_k = engine, slots, bool(wide_top_k)
    self.config = engine.config
    check_fits(self.config, slots, engine.max_context, engine.cache_dtype)
    longest = engine.max_context - 1                  # the longest prompt a slot takes
    chunk = engine.prefill_chunk
    self.buckets = sorted({prompt_bucket(n, chunk) for n in range(1, min(longest, chunk) + 1)})
    self.chunked = longest > engine.prefill_chunk     # whether a prompt can take more than one chunk
    self.score_sizes = [b for b in self.buckets if b <= SCORE_CHUNK] or [self.buckets[0]]
    groups = [r for r in counts(min(slots, admit_group)) if r & (r - 1) == 0]     # 1, 2, 4, ... (powers of two)
    # (requests, bucket) of each admit program: R last chunks of a bucket in one call, R > 1 only where R x bucket
    # is at most ADMIT_TOKENS and a chunk.
    self.admit_sizes = [(r, b) for b in self.buckets for r in groups if r == 1 or r * b <= min(chunk, ADMIT_TOKENS)]
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
    """A new empty state (after a failed program, whose donated state may be gone). The old one is let go first:
    after the device ran out of memory, both at once may not fit."""
    self.state, self._blocks = None, {}
    self.state = self._empty_state()

  # ---- programs ------------------------------------------------------------------------------

  def _args(self, size: int, rows: int = 0, wide: bool = False) -> tuple:
    """The abstract arguments of a program running a chunk of `size` tokens: extend_slot's (rows 0: one row,
    the slot a scalar), else admit_rows' for `rows` requests."""
    n = max(rows, 1)
    vec = jax.ShapeDtypeStruct((n,), jnp.int32)
    slot = jax.ShapeDtypeStruct((n,) if rows else (), jnp.int32)
    common = (self.engine.weights, _spec(self.state), slot, jax.ShapeDtypeStruct((n, size), jnp.int32), vec, vec)
    if not rows:
      return common
    v = self.config.vocab_size
    sampler = _spec(Sampler.create(SamplingParams(), n, vocab_size=v, masks=full_mask(n, v), biases=[None] * n))
    sampler = dataclasses.replace(sampler, wide_top_k=wide)
    return common + (vec, sampler, vec, jax.ShapeDtypeStruct((n, MAX_EOG), jnp.int32))

  def extend_fn(self) -> Callable:
    e = self.engine
    fn = functools.partial(extend_slot, self.config, kernels=e.kernels, layers=e.prefill_layers)
    key = ("slot-extend", self.slots, e.prefill_chunk)
    return e.compile_program(key, lambda: (fn, 1, self._args(e.prefill_chunk)))

  def admit_fn(self, rows: int, bucket: int, wide: bool = False) -> Callable:
    """admit_rows for the last chunks (of `bucket` tokens) of `rows` requests; wide: for one request whose top_k
    is above MAX_TOP_K."""
    e = self.engine
    fn = functools.partial(admit_rows, self.config, kernels=e.kernels, layers=e.prefill_layers)
    key = ("slot-admit", self.slots, rows, bucket) + (("wide",) if wide else ())
    return e.compile_program(key, lambda: (fn, 1, self._args(bucket, rows, wide)))

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
    lookups += [functools.partial(self.admit_fn, r, b) for r, b in self.admit_sizes]
    lookups += [functools.partial(self.admit_fn, 1, b, True) for b in self.buckets] if self.wide_top_k else []
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

  def extend_step(self, job: Prefill) -> None:
    """Runs the next chunk of `job`, one of its full chunks (a chunk is left after it)."""
    assert job.remaining > 1, "the last chunk runs in admit()"
    tokens, n, start = job.chunks.pop(0)
    self.state = self.extend_fn()(self.engine.weights, self.state, np.int32(job.slot), tokens,
                                  np.asarray([n], np.int32), np.asarray([start], np.int32))

  def groups(self, jobs: Sequence[Prefill]) -> list[list[Prefill]]:
    """`jobs` (each at its last chunk) cut into admit calls: a job whose top_k needs the wide step alone; the
    others in order, each call taking as many of the next ones as an admit program takes (R the largest size
    of admit_sizes whose bucket holds the largest of their last chunks)."""
    out = [[j] for j in jobs if j.sampler.wide_top_k]
    rest = [j for j in jobs if not j.sampler.wide_top_k]
    sizes = sorted({r for r, _ in self.admit_sizes}, reverse=True)
    while rest:
      take = next(r for r in sizes if r <= len(rest) and (r, _last_bucket(rest[:r])) in self.admit_sizes)
      out.append(rest[:take])
      rest = rest[take:]
    return out

  def admit(self, groups: Sequence[Sequence[Prefill]]) -> list[jax.Array]:
    """Runs the last chunks of the jobs of `groups` (as groups() cuts them), a call per group, every call
    dispatched before any is waited for. Returns each group's first sampled tokens, [R] int32 on the device in
    the group's order: reading a group's waits for its own call only, so its requests can have their first tokens
    while the later groups' calls run."""
    return [self._admit(list(group)) for group in groups]

  def _admit(self, jobs: list[Prefill]) -> jax.Array:
    """One admit_rows call: the last chunks of `jobs`, padded to the largest of their buckets; their first
    tokens [R]."""
    rows, size = len(jobs), _last_bucket(jobs)
    tokens = np.zeros((rows, size), np.int32)
    lengths, starts = np.zeros((rows,), np.int32), np.zeros((rows,), np.int32)
    for i, job in enumerate(jobs):
      chunk, lengths[i], starts[i] = job.chunks.pop(0)
      tokens[i, :chunk.shape[1]] = chunk[0]
    sampler = jax.tree.map(lambda *rows_: np.concatenate(rows_), *(job.sampler for job in jobs))
    fn = self.admit_fn(rows, size, jobs[0].sampler.wide_top_k)
    self.state, first = fn(self.engine.weights, self.state, np.asarray([job.slot for job in jobs], np.int32),
                           tokens, lengths, starts, np.asarray([job.pos for job in jobs], np.int32), sampler,
                           np.asarray([job.limit for job in jobs], np.int32), np.concatenate([job.eog for job in jobs]))
    return first

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
