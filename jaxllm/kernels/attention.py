"""Attention over the preallocated KV cache: decode (one query per sequence) and prefill (a chunk of them).

Shapes: B batch, T queries per sequence, H query heads, G key/value heads (H % G == 0, GQA), R = H / G,
S cache length, Dh head dim, L layers. The cache is stacked over layers, [L, N, G, S, Dh]; `layer` (a
Python int) picks one, so the FFI kernels read the layer in place instead of XLA slicing it out. It may hold
more rows than the queries (N >= B: a server's N slots, a step on the first B of them): query row b reads
cache row b, rows [B, N) are never read (the decode kernels take the whole cache, with no copy of the rows;
the CUDA flash prefill kernel takes N == B only).

One contract for every path: query t of sequence b sits at cache position start[b] + t (its key already
written) and sees the keys at positions <= its own, clipped to the cache: s <= min(start[b] + t, S - 1).
Decode is the case T = 1 with visible length start + 1, clipped to [1, S]. Positions past a sequence's
visible keys hold stale values that never reach the result.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.kernels import ffi, select

PREFILL_KEY_BLOCK = 512   # keys per step of the blocked (flash) prefill attention on the XLA path


def _precision(dtype):
  """f32 queries are the float reference: full-precision products on the GPU too (its f32 default is TF32)."""
  return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _visible_lengths(lengths: jax.Array, s: int) -> jax.Array:
  return jnp.clip(lengths, 1, s)


def decode_attention_reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: int,
                               lengths: jax.Array) -> jax.Array:
  """Masked softmax attention over the first lengths[b] cache positions (clipped to [1, S]), f32 softmax.

  Args:
    q: [B, H, Dh] queries (already rotated).
    k_cache, v_cache: [L, N, G, S, Dh], N >= B (rows [0, B) read).
    layer: which layer of the cache.
    lengths: [B] int32 visible lengths.
  Returns:
    [B, H, Dh] in q.dtype.
  """
  return prefill_attention_reference(q[:, None], k_cache, v_cache, layer, lengths - 1)[:, 0]


def prefill_attention_reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: int,
                                start: jax.Array) -> jax.Array:
  """Causal attention of T queries from cache position start[b] (masked softmax over all S keys, f32).

  Materializes [B, H, T, S] scores: the definition the kernels are checked against, for small sizes.
  q [B, T, H, Dh]; caches [L, N, G, S, Dh] (N >= B: rows [0, B) read); start [B] -> [B, T, H, Dh] in q.dtype.
  """
  b, t, h, dh = q.shape
  k, v = k_cache[layer, :b], v_cache[layer, :b]                # [B, G, S, Dh]
  g, s = k.shape[1], k.shape[2]
  qg = q.reshape(b, t, g, h // g, dh).astype(jnp.float32)       # [B, T, G, R, Dh]
  hi = _precision(q.dtype)
  scores = jnp.einsum("btgrd,bgsd->bgrts", qg, k.astype(jnp.float32), precision=hi) * (dh ** -0.5)
  last = jnp.clip(start[:, None] + jnp.arange(t)[None, :], 0, s - 1)   # [B, T] last visible key
  visible = jnp.arange(s)[None, None, :] <= last[:, :, None]            # [B, T, S]
  scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
  p = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bgrts,bgsd->btgrd", p, v.astype(jnp.float32), precision=hi)
  return out.reshape(b, t, h, dh).astype(q.dtype)


def prefill_attention_blocked(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: int,
                              start: jax.Array, block: int = PREFILL_KEY_BLOCK) -> jax.Array:
  """The same contract as prefill_attention_reference in O(T x block) memory (flash attention in jnp).

  A loop over key blocks up to the last visible key of the chunk (so work follows the visible keys, not
  S) with an online softmax in f32. The last block is read from min(j * block, S - block) so it stays in
  the cache; keys before j * block were counted by the previous block and are masked.
  """
  b, t, h, dh = q.shape
  k, v = k_cache[layer, :b], v_cache[layer, :b]                # [B, G, S, Dh]
  g, s = k.shape[1], k.shape[2]
  r = h // g
  block = min(block, s)
  qg = jnp.moveaxis(q.reshape(b, t, g, r, dh), 1, 3).astype(jnp.float32) * (dh ** -0.5)   # [B, G, R, T, Dh]
  hi = _precision(q.dtype)
  last = jnp.clip(start[:, None] + jnp.arange(t)[None, :], 0, s - 1)                    # [B, T]
  n_blocks = (jnp.max(last) + block) // block

  def body(j, carry):
    m, l, acc = carry
    lo = j * block
    at = jnp.minimum(lo, s - block)
    kb = jax.lax.dynamic_slice_in_dim(k, at, block, axis=2).astype(jnp.float32)          # [B, G, blk, Dh]
    vb = jax.lax.dynamic_slice_in_dim(v, at, block, axis=2).astype(jnp.float32)
    pos = at + jnp.arange(block)                                                        # [blk]
    visible = (pos[None, None, :] <= last[:, :, None]) & (pos >= lo)[None, None, :]     # [B, T, blk]
    sc = jnp.einsum("bgrtd,bgsd->bgrts", qg, kb, precision=hi)
    sc = jnp.where(visible[:, None, None], sc, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(sc, axis=-1))                                        # [B, G, R, T]
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(sc - m_safe[..., None])
    alpha = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
    l = l * alpha + jnp.sum(p, axis=-1)
    acc = acc * alpha[..., None] + jnp.einsum("bgrts,bgsd->bgrtd", p, vb, precision=hi)
    return m_new, l, acc

  init = (jnp.full((b, g, r, t), -jnp.inf, jnp.float32), jnp.zeros((b, g, r, t), jnp.float32),
          jnp.zeros((b, g, r, t, dh), jnp.float32))
  _, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
  out = acc / l[..., None]                                                              # [B, G, R, T, Dh]
  return jnp.moveaxis(out, 3, 1).reshape(b, t, h, dh).astype(q.dtype)


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: int,
                     lengths: jax.Array, *, kernels: str = "xla") -> jax.Array:
  """Decode attention through the selected implementation (see jaxllm.kernels).

  Geometries the FFI kernel is not built for (see ffi.attention_supported) run the reference.
  """
  lengths = _visible_lengths(lengths, k_cache.shape[3])
  if (select.uses_ffi(kernels) and "attention" in select.ffi_ops()
      and ffi.attention_supported(q.shape[-1], q.shape[1], k_cache.shape[2])):
    return ffi.decode_attention(q, k_cache, v_cache, layer, lengths)
  return decode_attention_reference(q, k_cache, v_cache, layer, lengths)


def prefill_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: int, start: jax.Array,
                      *, kernels: str = "xla") -> jax.Array:
  """Prefill attention through the selected implementation: the CUDA flash kernel on the GPU where it is
  built for the geometry and the cache holds exactly q's rows, else the blocked jnp form (which the CPU runs on
  both paths, and which reads rows [0, B) of a cache of more rows)."""
  if (select.uses_ffi(kernels) and "attention" in select.ffi_ops() and k_cache.shape[1] == q.shape[0]
      and ffi.prefill_attention_supported(q.shape[-1], q.shape[2], k_cache.shape[2], q.dtype)):
    return ffi.prefill_attention(q, k_cache, v_cache, layer, start)
  return prefill_attention_blocked(q, k_cache, v_cache, layer, start)
