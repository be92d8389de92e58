"""Prefill and the decode step as pure functions over a DecodeState pytree.

These are what the engine compiles (donating the state) and what users call inside their own `jit`,
`vmap` or `scan`. Every per-step value (next token, write/RoPE position, PRNG keys, sampling settings,
stop conditions) lives in the state on the device, so one compiled step serves every request.

The context contract: a sequence stops advancing when it is done (an end-of-generation token, its token
limit, a full cache, or non-finite logits). A done sequence's row still runs through the batched step but
writes nothing to the cache, keeps its position and repeats its last token: never an error, never a write
past the cache, and the same tokens on every kernel path.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxllm.cache import KVCache
from jaxllm.config import Config
from jaxllm.model import Weights, forward, forward_decode_fused_head, logits, use_fused
from jaxllm.sampling import NONFINITE, Sampler, sample
from jaxllm.tokenizer import MAX_EOG  # end-of-generation ids a state holds per sequence (checked at load)

NO_EOG = -2      # padding of the eog table (never a token: sampled ids are >= 0 or NONFINITE)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  """Everything a decode step reads and writes.

  cache: KVCache [L, N, G, S, Dh] with N >= B: sequence b is cache row b. A cache of more rows than the batch
    (a server's N slots, a step on the first B of them) is read and written in place on rows [0, B), the
    rest untouched: every kernel path takes the whole cache, so a step with unrolled layers (the engine's and
    the server's) copies none of it; with scanned layers each layer's attention reads a copy of that layer's
    rows [0, B), as it did before caches could hold more rows.
  tokens: [B] int32, the last sampled token of each sequence (the next step's input); NONFINITE (-1)
    where the logits were not all finite.
  pos: [B] int32, where that token will be written: the number of tokens already in the cache; it is
    also the token's RoPE position, and pos + 1 is the visible length of its attention.
  done: [B] bool, sequences that have stopped (see the module docstring).
  limit: [B] int32, the position at which a sequence stops (<= S): it generates limit - pos + 1 tokens
    after a prefill that leaves it at pos.
  eog: [B, MAX_EOG] int32 end-of-generation ids per sequence (NO_EOG pads; all NO_EOG ignores EOS).
  sampler: per-sequence sampling settings, PRNG keys and penalty window.
  """
  cache: KVCache
  tokens: jax.Array
  pos: jax.Array
  done: jax.Array
  limit: jax.Array
  eog: jax.Array
  sampler: Sampler


def eog_table(ids, batch: int):
  """An eog table [batch, MAX_EOG] from a set of ids (the same for every row), as a host array."""
  import numpy as np
  ids = sorted(set(int(i) for i in ids))
  if len(ids) > MAX_EOG:
    raise ValueError(f"at most {MAX_EOG} end-of-generation ids, got {len(ids)}")
  row = ids + [NO_EOG] * (MAX_EOG - len(ids))
  return np.tile(np.asarray(row, np.int32), (batch, 1))


def _stopped(tokens: jax.Array, pos: jax.Array, limit: jax.Array, eog: jax.Array) -> jax.Array:
  """Whether a sequence that just sampled `tokens` and now sits at `pos` is done.

  The eog columns are compared one by one rather than reduced with jnp.any: elementwise over [B], this
  fuses with the step's other state updates into one kernel (a reduction is a kernel of its own on the GPU,
  one more on the path from one step's LM head to the next step's layers)."""
  stop = (pos >= limit) | (tokens == NONFINITE)
  for i in range(eog.shape[-1]):
    stop = stop | (tokens == eog[:, i])
  return stop


def _last_hidden(hidden: jax.Array, lengths: jax.Array, last: jax.Array | None) -> jax.Array:
  """hidden [B, T, D] at each row's last new token (lengths [B] >= 1), or `last` [B, D] where lengths is 0."""
  at = hidden[jnp.arange(hidden.shape[0]), jnp.maximum(lengths - 1, 0)]
  return at if last is None else jnp.where((lengths > 0)[:, None], at, last)


def extend(config: Config, weights: Weights, cache: KVCache, tokens: jax.Array, lengths: jax.Array,
           start: jax.Array, last: jax.Array | None = None, *, kernels: str = "xla",
           layers: str | None = None) -> tuple[KVCache, jax.Array]:
  """Runs each row's first lengths[b] tokens from cache position start[b]; samples nothing.

  The building block of chunked prefill: the cache keeps what it held before start (an earlier chunk or
  an earlier turn) and the new tokens attend to it.
  Args:
    tokens: [B, T] int32, right-padded; lengths: [B] int32 in [0, T]; start: [B] int32.
    last: [B, D] f32 carried for rows with lengths 0 (their last token was in an earlier chunk).
    layers: "unrolled", "scan" or None (the backend's default: "scan" on the CPU; see model.forward).
  Returns:
    the cache and each row's final hidden state [B, D] f32 at its last new token.
  """
  valid = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
  hidden, cache = forward(config, weights, cache, tokens, start, valid, kernels=kernels, layers=layers)
  return cache, _last_hidden(hidden, lengths, last)


def finish_prefill(config: Config, weights: Weights, cache: KVCache, hidden: jax.Array, pos: jax.Array,
                   sampler: Sampler, limit: jax.Array, eog: jax.Array, *, greedy_only: bool = False,
                   kernels: str = "xla") -> DecodeState:
  """Samples each row's first new token from its last hidden state [B, D]; pos [B] = tokens in the cache."""
  step_logits = logits(weights, hidden, cache.compute_dtype, kernels=kernels)                 # [B, V]
  tokens, sampler = sample(step_logits, sampler, greedy_only=greedy_only)
  sampler = sampler.push(tokens, pos, jnp.ones_like(pos, bool))
  return DecodeState(cache=cache, tokens=tokens, pos=pos, done=_stopped(tokens, pos, limit, eog),
                     limit=limit, eog=eog, sampler=sampler)


def prefill(config: Config, weights: Weights, cache: KVCache, tokens: jax.Array, lengths: jax.Array,
            sampler: Sampler, *, start: jax.Array | None = None, limit: jax.Array | None = None,
            eog: jax.Array | None = None, last: jax.Array | None = None, greedy_only: bool = False,
            kernels: str = "xla", layers: str | None = None) -> DecodeState:
  """Runs the prompts (from cache position start, default 0) and samples each sequence's first new token.

  Args:
    cache: KVCache with room for start + lengths (positions from start on are overwritten).
    tokens: [B, T] int32 prompts, right-padded; lengths: [B] int32 real lengths (>= 1, or 0 with `last`).
    sampler: Sampler.create(...) for B rows.
    start: [B] int32, where each prompt goes (an earlier turn's tokens before it are attended to).
    limit: [B] int32, the position at which each sequence stops (default: the cache length).
    eog: [B, MAX_EOG] int32 ids that end a sequence (default: none; see eog_table).
    last: [B, D] f32 hidden state carried from an earlier chunk for rows with lengths 0.
    layers: how the layers run (model.forward): None, the backend's default, scans them on the CPU.
  Returns:
    DecodeState ready for decode_step: tokens = first sampled tokens, pos = start + lengths.
  """
  b = tokens.shape[0]
  start = jnp.zeros((b,), jnp.int32) if start is None else start.astype(jnp.int32)
  limit = jnp.full((b,), cache.max_len, jnp.int32) if limit is None else jnp.minimum(limit, cache.max_len)
  eog = jnp.full((b, MAX_EOG), NO_EOG, jnp.int32) if eog is None else eog
  cache, hidden = extend(config, weights, cache, tokens, lengths, start, last, kernels=kernels, layers=layers)
  return finish_prefill(config, weights, cache, hidden, start + lengths.astype(jnp.int32), sampler, limit,
                        eog, greedy_only=greedy_only, kernels=kernels)


def decode_step(config: Config, weights: Weights, state: DecodeState, *, greedy_only: bool = False,
                penalties: bool = True, kernels: str = "xla", layers: str | None = None) -> DecodeState:
  """Runs each active sequence's last token and samples the next one; done sequences stay as they are.

  greedy_only (static): compile only the argmax, for states whose every row is greedy.
  penalties (static): False promises that no row has a repeat/presence/frequency penalty (they are then
    skipped); with greedy_only the fused path takes the token from the LM-head kernel's argmax and never
    writes the logits, and weights on a mesh take it from each shard's argmax (parallel.TensorParallel.greedy)
    without gathering them.
  kernels "ffi" runs the fused kernels where they take the model and batch (model.use_fused).
  layers (static): "unrolled", "scan" or None, the backend's default ("scan" on the CPU; model.forward).
  The state's Sampler brings the last static settings: wide_top_k, set by Sampler.create where some row's
  top_k exceeds sampling.MAX_TOP_K (its step sorts the vocabulary for such rows; sampling.sample), and whether
  it carries a token mask (Sampler.mask, a grammar's) or logit biases (Sampler.bias_ids). A state with either
  never takes the LM-head kernel's argmax, which sees neither: its logits go through sample(), which applies
  them. Whether they are there is the pytree's structure, so it is part of what the step compiles for.
  """
  active = ~state.done
  b = state.tokens.shape[0]
  if state.cache.batch < b:
    raise ValueError(f"the cache [L, N, G, S, Dh] must hold at least the state's B = {b} rows, got "
                     f"{state.cache.k.shape}")
  # The argmax alone decides the token: it may come from the LM head's kernel, or from each shard's own logits.
  argmax = greedy_only and not penalties and state.sampler.mask is None and state.sampler.bias_ids is None
  if use_fused(config, weights, state.cache, b, kernels):
    # out: (tokens [B], all finite [B]) with argmax, else the logits [B, V] f32
    out, cache = forward_decode_fused_head(config, weights, state.cache, state.tokens, state.pos, active,
                                           greedy=argmax)
  else:
    hidden, cache = forward(config, weights, state.cache, state.tokens[:, None], state.pos, active[:, None],
                            kernels=kernels, layers=layers)
    argmax = argmax and weights.tp is not None      # vocabulary-parallel: no [B, V] logits cross the shards
    head = weights.tp.greedy if argmax else logits
    out = head(weights, hidden[:, 0], cache.compute_dtype, kernels=kernels)
  if argmax:
    new, finite = out
    new, sampler = jnp.where(finite, new, NONFINITE), state.sampler
  else:
    new, sampler = sample(out, state.sampler, greedy_only=greedy_only, penalties=penalties, kernels=kernels)
  tokens = jnp.where(active, new, state.tokens)
  pos = jnp.where(active, state.pos + 1, state.pos)
  if penalties:   # the window is read by the penalties only (a state without them keeps it as it was)
    sampler = sampler.push(tokens, pos, active)
  done = state.done | (active & _stopped(tokens, pos, state.limit, state.eog))
  return DecodeState(cache=cache, tokens=tokens, pos=pos, done=done, limit=state.limit, eog=state.eog,
                     sampler=sampler)


DEVICE_LOOPS = ("unrolled", "while")


def decode_steps(config: Config, weights: Weights, state: DecodeState, block: jax.Array, *,
                 loop: str = "unrolled", **step_flags) -> tuple[DecodeState, jax.Array]:
  """K = block.shape[0] decode steps in one program (K tokens per executable call: the host's dispatch and
  read are paid once per K tokens). block [K, B] int32 is overwritten with each step's tokens (donate it
  with the state, so that its address too stays fixed from call to call); step_flags as decode_step's.

  loop: "unrolled" traces the step K times (K copies of its thunks in the program); "while" runs it in a
  `lax.fori_loop` (one copy, in a while loop whose body XLA records as a command buffer; XLA's WHILE and
  CONDITIONAL command types, `--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL`, are meant to put the
  loop itself into one). On the H200 both ran at the same TPOT (docs/results/2026-12-01-h200-cluster.md).
  """
  if loop not in DEVICE_LOOPS:
    raise ValueError(f"loop must be one of {DEVICE_LOOPS}, got {loop!r}")
  if loop == "while":
    def body(i, carry):
      state, block = carry
      state = decode_step(config, weights, state, **step_flags)
      return state, jax.lax.dynamic_update_index_in_dim(block, state.tokens, i, 0)
    return jax.lax.fori_loop(0, block.shape[0], body, (state, block))
  for i in range(block.shape[0]):
    state = decode_step(config, weights, state, **step_flags)
    block = block.at[i].set(state.tokens)
  return state, block


def sequence_logits(config: Config, weights: Weights, cache: KVCache, tokens: jax.Array,
                    start: jax.Array, *, kernels: str = "xla",
                    layers: str | None = None) -> tuple[jax.Array, KVCache]:
  """Logits [B, T, V] f32 of every position of tokens [B, T] written from cache position start [B]
  (layers as model.forward's)."""
  hidden, cache = forward(config, weights, cache, tokens, start, kernels=kernels, layers=layers)
  return logits(weights, hidden, cache.compute_dtype, kernels=kernels), cache
