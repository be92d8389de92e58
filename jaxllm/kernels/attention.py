"""Decode attention: one new query token per sequence against the preallocated KV cache.

Shapes: B batch, H query heads, G key/value heads (H % G == 0, GQA), S cache length, Dh head dim,
L layers. The cache is stacked over layers, [L, B, G, S, Dh]; `layer` (a Python int) picks one, so the
FFI kernel reads the layer in place instead of XLA slicing it out.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def decode_attention_reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: int,
                               lengths: jax.Array) -> jax.Array:
  """Masked softmax attention over the first lengths[b] cache positions, f32 softmax.

  Args:
    q: [B, H, Dh] queries (already rotated).
    k_cache, v_cache: [L, B, G, S, Dh].
    layer: which layer of the cache.
    lengths: [B] int32 visible lengths, 1 <= lengths[b] <= S.
  Returns:
    [B, H, Dh] in q.dtype.
  """
  k, v = k_cache[layer], v_cache[layer]                       # [B, G, S, Dh]
  b, h, dh = q.shape
  g, s = k.shape[1], k.shape[2]
  qg = q.reshape(b, g, h // g, dh).astype(jnp.float32)         # [B, G, R, Dh]
  scores = jnp.einsum("bgrd,bgsd->bgrs", qg, k.astype(jnp.float32)) * (dh ** -0.5)
  visible = jnp.arange(s)[None, :] < lengths[:, None]           # [B, S]
  scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
  p = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bgrs,bgsd->bgrd", p, v.astype(jnp.float32))
  return out.reshape(b, h, dh).astype(q.dtype)


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: int,
                     lengths: jax.Array, *, kernels: str = "xla") -> jax.Array:
  """Decode attention through the selected implementation (see jaxllm.kernels).

  Geometries the FFI kernel is not built for (see ffi.attention_supported) run the reference.
  """
  from jaxllm.kernels import ffi, select
  if (kernels == "ffi" and "attention" in select.ffi_ops()
      and ffi.attention_supported(q.shape[-1], q.shape[1], k_cache.shape[2])):
    return ffi.decode_attention(q, k_cache, v_cache, layer, lengths)
  return decode_attention_reference(q, k_cache, v_cache, layer, lengths)
