"""The transformer as pure functions over pytrees: embed, layer, forward, logits.

Notation: B batch, T new tokens, D model width, H query heads, G key/value heads, Dh head dim,
F feed-forward width, V vocabulary, L layers, S cache length.

One forward serves prefill (T > 1: causal attention over the cache, written first) and decode (T = 1:
the decode-attention kernel, or with kernels "ffi" the fused QKV epilogue and one-kernel attention). On the GPU the layer loop is a Python loop, unrolled into the compiled program:
`lax.scan` over layers defeats XLA's command buffers (DESIGN.md). On the CPU the layers run under `lax.scan`
by default (LAYERS, forward(layers="scan")): a program one layer long compiles in a fraction of the time
(the functional API's first call: seconds instead of a minute) and holds one layer's working set. The residual stream is float32; matmul inputs use the activation dtype
(`cache.compute_dtype`: bf16 on GPU, f32 on CPU), the KV cache its own dtype (by default the same).
RMSNorm is in jaxllm/norm.py, RoPE in jaxllm/rope.py (shared with the fused kernels).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxllm.cache import KVCache
from jaxllm.config import Config
from jaxllm.kernels import decode_attention, fused, linear, prefill_attention, select
from jaxllm.norm import rms_norm
from jaxllm.quant import Linear, Mixed
from jaxllm.rope import apply_rope, rope_angles, rope_inv_freq, rope_position_scale


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Weights:
  """All weights, stacked over layers so the step takes few arrays (DESIGN.md)."""
  embed: Linear                  # [V, D]
  attn_norm: jax.Array           # [L, D] f32
  # The stacked matrices: Linear (W8A16 or float), LowBit (the file's 4/5-bit blocks) or Mixed (layers
  # held in different ways).
  wqkv: Linear                   # [L, H*Dh + 2*G*Dh, D]  (q, k, v fused)
  wo: Linear                     # [L, D, H*Dh]
  ffn_norm: jax.Array            # [L, D] f32
  w_gate_up: Linear              # [L, 2F, D]  (gate, up fused)
  w_down: Linear                 # [L, D, F]
  out_norm: jax.Array            # [D] f32
  head: Linear                   # [V, D]  (the embed arrays when tied)
  bqkv: jax.Array | None = None  # [L, H*Dh + 2*G*Dh] f32 (qwen2)
  q_norm: jax.Array | None = None  # [L, Dh] f32 (qwen3)
  k_norm: jax.Array | None = None  # [L, Dh] f32 (qwen3)
  rope_freqs: jax.Array | None = None  # [Dh/2] f32 divisors (llama3 scaling)
  # Weights laid out over a mesh (jaxllm.parallel.shard_weights): their TensorParallel, which forward and
  # logits hand them to; None on one device. Static: part of what a compiled function is for.
  tp: object = dataclasses.field(default=None, metadata=dict(static=True))


def embed(weights: Weights, tokens: jax.Array) -> jax.Array:
  """tokens [B, T] int32 -> [B, T, D] f32."""
  e = weights.embed
  return Linear(w=e.w[tokens], scale=None if e.scale is None else e.scale[tokens]).dequantize()


def _write_cache(cache: jax.Array, layer: int, new: jax.Array, positions: jax.Array) -> jax.Array:
  """Writes new [B, T, G, Dh] at cache[layer, b, :, positions[b, t]] of a cache [L, N, G, S, Dh] (N >= B: rows
  [0, B) written in place, the rest untouched); positions >= S are dropped."""
  bi = jnp.arange(new.shape[0])[:, None]
  return cache.at[layer, bi, :, positions].set(new.astype(cache.dtype), mode="drop")


def layer(config: Config, weights: Weights, i: int, x: jax.Array, cache: KVCache, start: jax.Array,
          writes: jax.Array, angles: jax.Array, *, kernels: str,
          cache_layer: int | jax.Array | None = None, reduce=None,
          fused_attention: bool = False) -> tuple[jax.Array, KVCache]:
  """Transformer block i.

  Args:
    i: the layer's index into the stacked weights (a Python int).
    x: [B, T, D] f32 residual stream.
    start: [B] int32 cache position of each sequence's first new token (token t sits at start + t).
    writes: [B, T] int32 cache positions the new keys/values go to (S for tokens not to be written).
    angles: [B, T, Dh/2] RoPE angles of the new tokens' positions.
    cache_layer: the layer's index into the cache when it differs from i (a traced index under
      forward(layers="scan")); default i.
    reduce: applied to the O and down projections' outputs [B, T, D] f32 before they join the residual: a
      psum over the shards under tensor parallelism (jaxllm.parallel); None: as they are.
    fused_attention: decode only (T = 1, i the cache layer): the bias, q/k norm, RoPE, cache append and
      attention as two fused kernels (fused.qkv_epilogue, fused.decode_attention_merged) instead of XLA's ops
      and the decode-attention kernel; forward decides (fused.attention_block_reason).
  Returns:
    x [B, T, D] and the cache with this layer's new keys/values written.
  """
  c = config
  li = i if cache_layer is None else cache_layer
  dtype = cache.compute_dtype
  b, t, _ = x.shape
  h = rms_norm(x, weights.attn_norm[i], c.rms_eps).astype(dtype)
  qkv = linear(h, weights.wqkv, i, kernels=kernels)              # [B, T, H*Dh + 2*G*Dh]
  if fused_attention:
    if t != 1 or cache_layer is not None:
      raise ValueError(f"layer(fused_attention=True) decodes one token a row of an unrolled layer; got T = {t}"
                       + ("" if cache_layer is None else " and a cache_layer"))
    q, k, v, counters = fused.qkv_epilogue(
        qkv[:, 0], weights.bqkv, weights.q_norm, weights.k_norm, rope_inv_freq(c, weights.rope_freqs), i, start,
        writes[:, 0], cache.k, cache.v, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads, neox=c.rope_style == "neox",
        pos_scale=rope_position_scale(c), eps=c.rms_eps)                                   # q [B, H, Dh]
    cache = dataclasses.replace(cache, k=k, v=v)
    attn = fused.decode_attention_merged(q, k, v, i, start + 1, counters)                  # [B, H, Dh]
    return _layer_rest(config, weights, i, x, attn[:, None], dtype, kernels, reduce), cache
  if weights.bqkv is not None:
    qkv = (qkv.astype(jnp.float32) + weights.bqkv[i]).astype(dtype)
  q, k, v = jnp.split(qkv, [c.q_dim, c.q_dim + c.kv_dim], axis=-1)
  q = q.reshape(b, t, c.n_heads, c.head_dim)
  k = k.reshape(b, t, c.n_kv_heads, c.head_dim)
  v = v.reshape(b, t, c.n_kv_heads, c.head_dim)
  if weights.q_norm is not None:
    q = rms_norm(q, weights.q_norm[i], c.rms_eps).astype(dtype)
    k = rms_norm(k, weights.k_norm[i], c.rms_eps).astype(dtype)
  q = apply_rope(q, angles, c.rope_style)
  k = apply_rope(k, angles, c.rope_style)
  cache = dataclasses.replace(cache, k=_write_cache(cache.k, li, k, writes), v=_write_cache(cache.v, li, v, writes))
  if t == 1 and isinstance(li, int):
    attn = decode_attention(q[:, 0], cache.k, cache.v, li, start + 1, kernels=kernels)[:, None]
  elif t == 1:   # a traced layer (under scan): the decode-attention kernel takes a static one, so it reads a copy of
    # the layer's rows [0, B) (of a cache of N >= B rows): the scanned step copies B rows of a layer, not N
    kl, vl = (jax.lax.dynamic_slice(a, (li, 0, 0, 0, 0), (1, b) + a.shape[2:])              # [1, B, G, S, Dh]
              for a in (cache.k, cache.v))
    attn = decode_attention(q[:, 0], kl, vl, 0, start + 1, kernels=kernels)[:, None]
  else:
    attn = prefill_attention(q, cache.k, cache.v, li, start, kernels=kernels)
  return _layer_rest(config, weights, i, x, attn, dtype, kernels, reduce), cache


def _layer_rest(config: Config, weights: Weights, i: int, x: jax.Array, attn: jax.Array, dtype, kernels: str,
                reduce) -> jax.Array:
  """layer() after the attention: attn [B, T, H, Dh] -> x [B, T, D] f32 through O, the residual and the MLP
  (matmul inputs in dtype)."""
  c = config
  b, t, _ = x.shape
  reduce = reduce or (lambda y: y)
  x = x + reduce(linear(attn.reshape(b, t, c.q_dim), weights.wo, i, kernels=kernels).astype(jnp.float32))
  h = rms_norm(x, weights.ffn_norm[i], c.rms_eps).astype(dtype)
  gate, up = jnp.split(linear(h, weights.w_gate_up, i, kernels=kernels), 2, axis=-1)
  act = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(dtype)
  return x + reduce(linear(act, weights.w_down, i, kernels=kernels).astype(jnp.float32))


# How forward runs the layers by default, per backend: "scan" on the CPU, "unrolled" elsewhere.
LAYERS = {"cpu": "scan"}
LAYER_MODES = ("unrolled", "scan")


def default_layers() -> str:
  """forward's layer loop on the default backend (LAYERS): "scan" on the CPU, "unrolled" on the GPU."""
  return LAYERS.get(jax.default_backend(), "unrolled")


LAYER_FIELDS = ("attn_norm", "wqkv", "wo", "ffn_norm", "w_gate_up", "w_down", "bqkv", "q_norm", "k_norm")


def _layer_slices(weights: Weights) -> dict:
  """The per-layer weights, stacked [L, ...]: a scan's xs (a Mixed stack is not one array a layer: the scan's
  body picks its layer by index instead)."""
  return {f: getattr(weights, f) for f in LAYER_FIELDS
          if getattr(weights, f) is not None and not isinstance(getattr(weights, f), Mixed)}


def forward(config: Config, weights: Weights, cache: KVCache, tokens: jax.Array, start: jax.Array,
            valid: jax.Array | None = None, *, kernels: str = "xla", layers: str | None = None,
            embed_fn=embed, reduce=None) -> tuple[jax.Array, KVCache]:
  """Runs T new tokens per sequence, written to the cache from position start[b]. The cache may hold more rows
  than the tokens (N >= B): sequence b is its row b, rows [B, N) untouched (decode on every path; prefill on
  the jnp attention, not the GPU's flash kernel).

  layers: "unrolled" (a Python loop: every layer in the program, which XLA's command buffers need) or
  "scan" (lax.scan over the layers: a program a layer long, compiled in a fraction of the time, whose working
  set is one layer's: XLA then never holds every layer's dequantized weights at once); None: default_layers(),
  "scan" on the CPU. The two compute the same (tests/test_model.py compares them).
  Args:
    tokens: [B, T] int32 (ids outside [0, V) read row 0 or V - 1).
    start: [B] int32 cache position of each sequence's first new token.
    valid: [B, T] bool, the tokens whose keys/values are written (padding and stopped sequences are
      not); all when None. Positions past the cache are never written.
    embed_fn, reduce: the embedding lookup and layer()'s reduce; jaxllm.parallel's for one shard.
  Returns:
    hidden [B, T, D] f32 after the final norm, and the updated cache.
  Weights laid out over a mesh (weights.tp) run there (jaxllm.parallel), each shard this function.
  """
  if weights.tp is not None:
    return weights.tp.forward(config, weights, cache, tokens, start, valid, kernels=kernels, layers=layers)
  layers = default_layers() if layers is None else layers
  if layers not in LAYER_MODES:
    raise ValueError(f"layers must be one of {LAYER_MODES} or None, got {layers!r}")
  positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]  # [B, T]
  s = cache.max_len
  writes = positions if valid is None else jnp.where(valid, positions, s)
  angles = rope_angles(config, positions, weights.rope_freqs)
  x = embed_fn(weights, jnp.clip(tokens, 0, config.vocab_size - 1))
  if layers == "scan":
    def body(carry, xs):
      x, k, v, li = carry
      # This layer's weights as a one-layer stack [1, ...] (a reshape inside the loop: no copy of the
      # stacked arrays), which layer(..., i=0) indexes as usual.
      view = dataclasses.replace(weights, **jax.tree.map(lambda a: a[None], xs),
                                 **{f: getattr(weights, f).at(li) for f in LAYER_FIELDS
                                    if isinstance(getattr(weights, f), Mixed)})
      x, kv = layer(config, view, 0, x, dataclasses.replace(cache, k=k, v=v), start, writes, angles,
                    kernels=kernels, cache_layer=li, reduce=reduce)
      return (x, kv.k, kv.v, li + 1), None
    (x, k, v, _), _ = jax.lax.scan(body, (x, cache.k, cache.v, jnp.int32(0)), _layer_slices(weights))
    cache = dataclasses.replace(cache, k=k, v=v)
  else:
    # Decode with the FFI kernels on one device: the attention block as two fused kernels where they take the
    # model (a shard under tensor parallelism, reduce given, keeps XLA's ops).
    fused_attention = (kernels == "ffi" and tokens.shape[1] == 1 and reduce is None and "fused" in select.ffi_ops()
                       and fused.attention_block_reason(config, cache, tokens.shape[0]) is None)
    for i in range(config.n_layers):
      x, cache = layer(config, weights, i, x, cache, start, writes, angles, kernels=kernels, reduce=reduce,
                       fused_attention=fused_attention)
  return rms_norm(x, weights.out_norm, config.rms_eps), cache


def use_fused(config: Config, weights: Weights, cache: KVCache, batch: int, kernels: str) -> bool:
  """Whether the decode step runs through the fused kernels (kernels "ffi", supported model and batch; one
  device: weights on a mesh run model.forward's layers)."""
  return (kernels == "ffi" and weights.tp is None and "fused" in select.ffi_ops()
          and fused.fused_decode_reason(config, weights, cache, batch) is None)


def forward_decode_fused(config: Config, weights: Weights, cache: KVCache, tokens: jax.Array, pos: jax.Array,
                         active: jax.Array) -> tuple[jax.Array, KVCache]:
  """One token per sequence through the fused kernels: six ops per layer (jaxllm/kernels/fused.py), on the
  GPU all layers from one FFI call of five kernels per layer (fused.decode_layers; fused.layers_call says
  when).

  tokens [B] int32, pos [B] int32 (the token's position), active [B] bool (inactive rows write nothing).
  Returns the residual stream [B, D] f32 before the final norm (the head fuses it) and the cache.
  """
  x, cache, _ = _decode_fused(config, weights, cache, tokens, pos, active, None)
  return x, cache


def forward_decode_fused_head(config: Config, weights: Weights, cache: KVCache, tokens: jax.Array, pos: jax.Array,
                              active: jax.Array, *, greedy: bool):
  """forward_decode_fused and the fused LM head. greedy: ((tokens [B] int32, finite [B] bool), cache) from the
  argmax head, the logits never written (fused.norm_argmax); else (logits [B, V] f32, cache). On the GPU's
  one layers call the head is that call's last kernel, a programmatic dependent of the last layer's."""
  head = "argmax" if greedy else "logits"
  x, cache, out = _decode_fused(config, weights, cache, tokens, pos, active, head)
  dtype = cache.compute_dtype
  if out is None:   # one FFI call per op: the head's own call
    if greedy:
      return fused.norm_argmax(x, weights.out_norm, config.rms_eps, weights.head, dtype=dtype), cache
    out = fused.norm_linear(x, weights.out_norm, config.rms_eps, weights.head, dtype=dtype)
  if greedy:
    return fused.unpack_argmax(out), cache
  return out.astype(jnp.float32), cache


def _decode_fused(config, weights, cache, tokens, pos, active, head):
  """forward_decode_fused's layers, and (head, on the one layers call) the head's output, else None."""
  c = config
  dtype = cache.compute_dtype
  x = embed(weights, jnp.clip(tokens, 0, c.vocab_size - 1)[:, None])[:, 0]          # [B, D] f32
  writes = jnp.where(active, pos, cache.max_len)
  lengths = pos + 1
  inv_freq = rope_inv_freq(c, weights.rope_freqs)
  pos_scale = rope_position_scale(c)
  k, v = cache.k, cache.v
  b = tokens.shape[0]
  lc = fused.layers_call()
  if lc.one:
    x, k, v, out = fused.decode_layers(c, weights, x, pos, writes, lengths, inv_freq, pos_scale, k, v, pdl=lc.pdl,
                                       head=head if lc.head else None)
    return x, dataclasses.replace(cache, k=k, v=v), out
  for i in range(c.n_layers):
    qkv = fused.norm_linear(x, weights.attn_norm, c.rms_eps, weights.wqkv, i, dtype=dtype)   # [B, N]
    q, k, v, counters = fused.qkv_epilogue(
        qkv, weights.bqkv, weights.q_norm, weights.k_norm, inv_freq, i, pos, writes, k, v, n_heads=c.n_heads,
        n_kv_heads=c.n_kv_heads, neox=c.rope_style == "neox", pos_scale=pos_scale, eps=c.rms_eps)
    attn = fused.decode_attention_merged(q, k, v, i, lengths, counters)                      # [B, H, Dh]
    x = fused.linear_residual(attn.reshape(b, c.q_dim), weights.wo, i, x)
    act = fused.norm_linear(x, weights.ffn_norm, c.rms_eps, weights.w_gate_up, i, dtype=dtype, epilogue="swiglu")
    x = fused.linear_residual(act, weights.w_down, i, x)
  return x, dataclasses.replace(cache, k=k, v=v), None


def logits(weights: Weights, hidden: jax.Array, dtype, *, kernels: str = "xla") -> jax.Array:
  """hidden [..., D] -> logits [..., V] f32 through the (quantized) LM head (on weights.tp's mesh if any)."""
  if weights.tp is not None:
    return weights.tp.logits(weights, hidden, dtype, kernels=kernels)
  return linear(hidden.astype(dtype), weights.head, kernels=kernels).astype(jnp.float32)
