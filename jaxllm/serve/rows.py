"""The device programs of continuous batching: functions of the server's N-row DecodeState.

The server keeps one batched DecodeState (cache [L, N, G, S, Dh], one row per slot) for its whole life
(jaxllm.serve.slots compiles these functions of it and runs them for the scheduler):

  extend_slot(weights, state, slot, tokens [1, C], lengths [1], start [1]) -> state
      runs a full prefill chunk of one request into row `slot` (its cache row cut out, extended at batch 1,
      put back) and marks the row done, so decode steps between two chunks leave it alone;
  admit_rows(weights, state, slots [R], tokens [R, T], lengths [R], start [R], pos [R], sampler (R rows),
             limit [R], eog [R, MAX_EOG]) -> (state, first tokens [R])
      runs the last chunks of R requests (T a power-of-two bucket) in one call, each into its own row (the R
      cache rows gathered, extended as a batch of R, scattered back), samples their first tokens and writes
      each row's whole state (token, position, limit, end-of-generation ids, sampling settings and key): the
      rows decode from the next step on;
  swap_rows(state, a, b) -> state
      exchanges two rows (cache and per-row values): how the scheduler keeps busy rows first without losing
      what a free row's cache holds (prefix reuse);
  decode_rows(weights, state, block [K, count]) -> (state, block)
      the engine's decode program (Engine.decode_program: K steps a call) on rows [0, count), the rest
      untouched: the step takes those rows' per-row values and the whole cache, whose rows [0, count) it reads
      and writes in place (decode.DecodeState), so no cache row is copied; the masked variant (one step a call)
      draws each row under its token mask;
  put_masks(state, masks [N, ceil(V / 32)]) -> state
      the token masks of the next masked call: a grammar's for a row under one (jaxllm.structured), every
      token for the others;
  score_slot(weights, state, slot, tokens [1, T], start [1], targets [1, T]) -> (logprobs [T], top ids and
      logprobs [T, TOP_LOGPROBS])
      the model's log-probabilities of `targets` after each of `tokens` run from `start` in row `slot` (a
      copy of its cache: the state is read, never changed), for OpenAI's logprobs: the prompt's (echo) after
      admission, a request's new tokens after each decode call.

Slot indices are data (int32), so each function compiles once per chunk size, row count or admission size.
Every chunk holds at least one of its prompt's tokens, so the first token is sampled from the last chunk's own
hidden state: no hidden state is carried from one chunk to the next.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxllm.cache import KVCache
from jaxllm.decode import DecodeState, extend, finish_prefill, sequence_logits

TOP_LOGPROBS = 20        # alternatives a score call returns per position (OpenAI's top_logprobs at most)


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


def _by_row(fn, state: DecodeState, *others: DecodeState, cache: bool = True) -> DecodeState:
  """The state whose every per-row array is fn(its array, the others' arrays, axis=its row axis): 1 for the
  cache's k and v, 0 for every other field and the Sampler's arrays. The Sampler's static fields stay the
  state's. cache False: the cache is left as the state's, the other fields only."""
  others = tuple(_with_wide(o, state.sampler.wide_top_k) for o in others)
  if cache:
    cache = dataclasses.replace(state.cache, **{n: fn(getattr(state.cache, n),
                                                      *(getattr(o.cache, n) for o in others), axis=1)
                                                for n in ("k", "v")})
  else:
    cache = state.cache
  rest = {f.name: fn(getattr(state, f.name), *(getattr(o, f.name) for o in others), axis=0)
          for f in dataclasses.fields(DecodeState) if f.name not in ("cache", "sampler")}
  sampler = jax.tree.map(lambda *a: fn(*a, axis=0), state.sampler, *(o.sampler for o in others))
  return DecodeState(cache=cache, sampler=sampler, **rest)


def _step_rows(state: DecodeState, count: int) -> DecodeState:
  """The state a decode step on rows [0, count) takes (count static): those rows of every per-row value and
  the whole cache [L, N, G, S, Dh], whose rows [0, count) the step reads and writes in place (a slice of the
  cache would be a copy of those rows out and back, each call: a cost that grows with the context)."""
  if count == state.tokens.shape[0]:
    return state
  return _by_row(lambda a, axis: jax.lax.slice_in_dim(a, 0, count, axis=axis), state, cache=False)


def _put_step_rows(state: DecodeState, rows: DecodeState) -> DecodeState:
  """state after a step on its first rows (rows: _step_rows' state stepped): their per-row values written back,
  and the step's cache, the whole of it."""
  out = _by_row(lambda big, row, axis: _put(big, row, 0, axis), state, rows, cache=False)
  return dataclasses.replace(out, cache=rows.cache)


def _put_rows(state: DecodeState, rows: DecodeState, slot) -> DecodeState:
  """state with rows (a state of fewer rows) written from row `slot` on."""
  return _by_row(lambda big, row, axis: _put(big, row, slot, axis), state, rows)


def _row(state: DecodeState, slot) -> DecodeState:
  """Row `slot` of a state, as a state of one row."""
  return _by_row(lambda a, axis: jax.lax.dynamic_slice_in_dim(a, slot, 1, axis), state)


def swap_rows(state: DecodeState, a, b) -> DecodeState:
  """Rows a and b of a state exchanged (a == b leaves it as it is)."""
  row_a, row_b = _row(state, a), _row(state, b)
  return _put_rows(_put_rows(state, row_b, a), row_a, b)


def _with_mask(state: DecodeState, mask, bias_ids=None, bias_values=None) -> DecodeState:
  return dataclasses.replace(state, sampler=dataclasses.replace(state.sampler, mask=mask, bias_ids=bias_ids,
                                                                bias_values=bias_values))


def decode_rows(step, count: int, k: int, masked: bool, wide: bool, weights, state: DecodeState, block):
  """`step` (Engine.decode_program's function: one step for k = 1, else k steps with a [k, count] token block)
  on rows [0, count) of state, given those rows' per-row values and the whole cache (_step_rows); returns (state,
  block [k, count] of the call's tokens). masked (static): the step draws under the rows' token masks and logit
  biases; else it gets the rows without them (the engine's program as it is), and they pass through unchanged.
  wide (static): the step's Sampler runs the wide step."""
  s = state.sampler
  kept = (s.mask, s.bias_ids, s.bias_values)
  if not masked:
    state = _with_mask(state, None)
  rows = _with_wide(_step_rows(state, count), wide)
  if k == 1:
    rows = step(weights, rows)
    block = rows.tokens[None]
  else:
    rows, block = step(weights, rows, block)
  out = _with_wide(rows, state.sampler.wide_top_k) if count == state.tokens.shape[0] else _put_step_rows(state, rows)
  return (out if masked else _with_mask(out, *kept)), block


def put_masks(state: DecodeState, masks) -> DecodeState:
  """The state with the token masks [N, ceil(V / 32)] uint32 of the next masked decode call (the rows' logit
  biases kept: each row's were written with its first token, admit_rows)."""
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


def extend_slot(config, weights, state: DecodeState, slot, tokens, lengths, start, *, kernels, layers) -> DecodeState:
  """A full prefill chunk of one request into row `slot`; the row is marked done until admit_rows."""
  row, _ = extend(config, weights, _row_cache(state.cache, slot), tokens, lengths, start, kernels=kernels,
                  layers=layers)
  done = state.done.at[slot].set(True)
  return dataclasses.replace(state, cache=_put_cache(state.cache, row, slot), done=done)


def _cache_rows(cache: KVCache, slots: jax.Array) -> KVCache:
  """Rows `slots` [R] of a cache [L, N, G, S, Dh], as a batch-R cache (one row: a dynamic slice)."""
  if slots.shape[0] == 1:
    return _row_cache(cache, slots[0])
  take = functools.partial(jnp.take, indices=slots, axis=1, mode="clip")
  return dataclasses.replace(cache, k=take(cache.k), v=take(cache.v))


def _scatter_rows(state: DecodeState, rows: DecodeState, slots: jax.Array) -> DecodeState:
  """state with rows (a state of R rows) written into its rows `slots` [R], distinct (one row: a dynamic
  update)."""
  if slots.shape[0] == 1:
    return _put_rows(state, rows, slots[0])
  return _by_row(lambda big, new, axis: big.at[(slice(None),) * axis + (slots,)].set(new.astype(big.dtype),
                                                                                     unique_indices=True), state, rows)


def admit_rows(config, weights, state: DecodeState, slots, tokens, lengths, start, pos, sampler, limit, eog,
               *, kernels, layers) -> tuple[DecodeState, jax.Array]:
  """The last prefill chunks of R requests into rows `slots` [R] (distinct), their first tokens sampled: the
  rows join the batch. tokens [R, T] right-padded; lengths (each >= 1), start, pos, limit [R]; sampler of R
  rows; eog [R, MAX_EOG]. Returns the state and the R first tokens [R] int32 (an array of their own, readable
  while the state goes on to the next call, which donates it)."""
  rows, hidden = extend(config, weights, _cache_rows(state.cache, slots), tokens, lengths, start, kernels=kernels,
                        layers=layers)
  new = finish_prefill(config, weights, rows, hidden, pos, sampler, limit, eog, kernels=kernels)
  return _scatter_rows(state, new, slots), new.tokens
