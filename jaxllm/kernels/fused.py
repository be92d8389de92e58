"""The fused decode-step ops: each a pure-jnp reference (the unfused computation, op for op) and jaxllm's
FFI kernel (CUDA and CPU, ffi/fused_cuda.cu and ffi/cpu_kernels.cc) behind one function.

A decode layer through them is six kernels (docs/kernels.md):
  norm_linear(x, attn_norm, wqkv)            RMSNorm folded into the QKV GEMV            -> qkv [B, N]
  qkv_epilogue(qkv, ...)                     bias, q/k norm, RoPE, K/V append in place   -> q, caches
  decode_attention_merged(q, caches, ...)    split attention merged by its last block    -> attn [B, H, Dh]
  linear_residual(attn, wo, x)               O projection + residual add                 -> x f32
  norm_linear(x, ffn_norm, w_gate_up, swiglu) RMSNorm + gate/up GEMV + SiLU(gate) * up   -> act [B, F]
  linear_residual(act, w_down, x)            down projection + residual add              -> x f32
and the head is norm_argmax (final norm, LM head, greedy argmax: no [B, V] logits) or norm_linear. On the
GPU decode_layers runs every layer in one FFI call with the QKV epilogue folded into the attention: five
kernels a layer, then the head as the call's last kernel, the same bits.

Shapes: M rows (the batch), K inputs, N outputs, L stacked layers; x is the f32 residual stream. The caches
[L, R, G, S, Dh] may hold more rows than the step's batch (R >= M, a server's slots): the QKV epilogue, the
attention and the layers call write and read rows [0, M) in place, the rest untouched (the caches are aliased
through whole, never sliced: a slice passed to a custom call would be a copy).
Weights and per-layer vectors stay stacked [L, ...] and are indexed by `layer` inside the kernels, so XLA
never slices them out (a slice would be a kernel of its own).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import lab
from jaxllm.kernels import ffi
from jaxllm.kernels.linear import linear_reference, max_m
from jaxllm.norm import rms_norm
from jaxllm.quant import Linear
from jaxllm.rope import apply_rope

MODES = {"none": 0, "swiglu": 1, "argmax": 2, "residual": 3}   # FusedMode in ffi/common.h
GPU_MAX_M = 4                 # rows the CUDA fused kernels take (tiles of 4 rows of x)
# Batch sizes the GPU runs the fused step for: on the H200 (Qwen2.5-0.5B shape, docs/results/
# 2026-12-01-h200-fused.md) batch 4 took 1.228 ms per step fused against 1.136 unfused, batch 1 0.70 against
# 0.89 (device-bound steps); batches 2 and 3 were not measured.
GPU_FUSED_BATCH = 1
# Where the GPU runs the unfused step's attention block fused (attention_block_reason), from the batch-16 step on an
# H100 (docs/results/2026-12-06-h100-attention-block.md): Qwen2.5-0.5B's (head dim 64) took 9.6% less time, 7B's
# (head dim 128) 1.2% more; at 0.5B batch 64, 1.7-2.1% more (a review's runs, not kept as records). Batch 17-63
# and other models were not measured.
GPU_BLOCK_MAX_BATCH = 16
GPU_BLOCK_HEAD_DIM = 64
GPU_MAX_NORM_K = 6144         # K of the norm prologue: 4 rows of bf16 in 48 KB of shared memory
MERGE_MAX_SPLITS = 256        # attn1::kMaxSplits in attention_cuda.cuh


def _row(a: jax.Array, layer: int | None) -> jax.Array:
  return a if layer is None or a.ndim == 1 else a[layer]


# ---- references ------------------------------------------------------------------------------------------

def norm_linear_reference(x, norm_w, eps, lin: Linear, layer=None, *, dtype, norm_layer=None,
                          epilogue: str = "none") -> jax.Array:
  """T(rms_norm(x) ) @ W^T in dtype; "swiglu": W = [gate; up] -> T(silu(gate) * up) [..., N / 2]."""
  h = rms_norm(x, _row(norm_w, layer if norm_layer is None else norm_layer), eps).astype(dtype)
  y = linear_reference(h, lin, layer)
  if epilogue == "swiglu":
    gate, up = jnp.split(y, 2, axis=-1)
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(dtype)
  return y


def norm_argmax_reference(x, norm_w, eps, lin: Linear, *, dtype) -> tuple[jax.Array, jax.Array]:
  """(argmax of the rounded logits [M] int32, whether all are finite [M])."""
  y = norm_linear_reference(x, norm_w, eps, lin, dtype=dtype).astype(jnp.float32)
  return jnp.argmax(y, axis=-1).astype(jnp.int32), jnp.all(jnp.isfinite(y), axis=-1)


def linear_residual_reference(a, lin: Linear, layer, res) -> jax.Array:
  """res [..., N] f32 + T(a @ W^T)."""
  return res + linear_reference(a, lin, layer).astype(jnp.float32)


def rope_pairs(x: jax.Array, angles: jax.Array, neox: bool) -> jax.Array:
  """x [B, N, Dh] rotated by angles [B, Dh/2]: rope.apply_rope for one token."""
  return apply_rope(x[:, None], angles[:, None], "neox" if neox else "normal")[:, 0]


def qkv_epilogue_reference(qkv, bias, q_norm, k_norm, inv_freq, layer: int, pos, writes, k_cache, v_cache, *,
                           n_heads: int, n_kv_heads: int, neox: bool, pos_scale: float, eps: float):
  """(q [B, H, Dh] rotated, caches with this token's k/v written at writes[b] (>= S: not written))."""
  b = qkv.shape[0]
  dh = k_cache.shape[-1]
  dtype = qkv.dtype
  if bias is not None:
    qkv = (qkv.astype(jnp.float32) + bias[layer]).astype(dtype)
  q, k, v = jnp.split(qkv, [n_heads * dh, (n_heads + n_kv_heads) * dh], axis=-1)
  q, k, v = (a.reshape(b, -1, dh) for a in (q, k, v))
  if q_norm is not None:
    q = rms_norm(q, q_norm[layer], eps).astype(dtype)
    k = rms_norm(k, k_norm[layer], eps).astype(dtype)
  angles = (pos.astype(jnp.float32) / pos_scale)[:, None] * inv_freq
  q, k = rope_pairs(q, angles, neox), rope_pairs(k, angles, neox)
  bi = jnp.arange(b)
  k_cache = k_cache.at[layer, bi, :, writes].set(k.astype(k_cache.dtype), mode="drop")
  v_cache = v_cache.at[layer, bi, :, writes].set(v.astype(v_cache.dtype), mode="drop")
  return q, k_cache, v_cache


# ---- the FFI calls ---------------------------------------------------------------------------------------

def _fused_call(x, lin: Linear, aux, layer: int, norm_layer: int, mode: str, bf16: bool, eps: float, out,
                poison=None):
  ffi._ensure_registered()
  name, kw = ffi._target("jaxllm_w8a16_fused", poison, 4)
  args = (x, lin.w, lin.scale.astype(jnp.float32), aux) + ((poison,) if poison is not None else ())
  return jax.ffi.ffi_call(name, out, vmap_method="sequential", **kw)(
      *args, layer=np.int64(layer), norm_layer=np.int64(norm_layer), mode=np.int64(MODES[mode]),
      bf16=np.int64(bf16), eps=np.float32(eps))


def _optional_f32(a):
  """An optional per-layer operand as the kernels take it: f32, or [0] for none."""
  return jnp.zeros((0,), jnp.float32) if a is None else a.astype(jnp.float32)


def merged_tile(itemsize: int, head_dim: int) -> int:
  """Cache positions per tile of the one-kernel attention (attn1::Geo::TP): a lane holds 128 bytes of a key row,
  so a warp's 32 lanes cover 32 / (lanes per position) positions."""
  return 32 // max(1, head_dim * itemsize // 128)


def merged_splits(b: int, k_cache) -> int:
  """Splits of the one-kernel attention: a tile each up to the cache's length, about ffi.ATTN_TARGET_BLOCKS
  (sequence, kv head, split) blocks, at most MERGE_MAX_SPLITS (a lab build's JAXLLM_ATTN_MAX_SPLITS: fewer).
  A block per tile keeps the short lengths of decode at one tile of latency; the kernel merges up to 8 splits
  in a thread-block cluster (sm_90), at head dim 128 walks up to twice a cluster's tiles with one cluster (two a
  block), and merges only longer ones through global memory."""
  _, _, g, s, dh = k_cache.shape
  tiles = -(-s // merged_tile(k_cache.dtype.itemsize, dh))
  return max(1, min(tiles, layers_call().max_splits, -(-ffi.ATTN_TARGET_BLOCKS // (b * g))))


def _stacked(lin: Linear, layer: int | None) -> tuple[Linear, int]:
  if lin.w.ndim == 2:
    return Linear(w=lin.w[None], scale=lin.scale[None]), 0
  return lin, int(layer)


def norm_linear(x, norm_w, eps, lin: Linear, layer=None, *, dtype, norm_layer=None, epilogue="none",
                poison=None):
  """norm_linear_reference through the fused kernel. x [M, K] f32; norm_w [L', K] or [K].
  `poison` (tests only): the output's buffer, prefilled, to catch unwritten elements."""
  w, li = _stacked(lin, layer)
  nw = norm_w[None] if norm_w.ndim == 1 else norm_w
  nl = 0 if norm_w.ndim == 1 else (li if norm_layer is None else int(norm_layer))
  if epilogue == "swiglu" and w.w.shape[1] % 2:
    raise ValueError(f"the SwiGLU epilogue needs [gate; up] rows (an even N), got N={w.w.shape[1]}")
  n = w.w.shape[1] // (2 if epilogue == "swiglu" else 1)
  out = jax.ShapeDtypeStruct((x.shape[0], n), dtype)
  return _fused_call(x.astype(jnp.float32), w, nw.astype(jnp.float32), li, nl, epilogue,
                     jnp.dtype(dtype) == jnp.bfloat16, eps, out, poison)


def norm_argmax(x, norm_w, eps, lin: Linear, *, dtype) -> tuple[jax.Array, jax.Array]:
  """norm_argmax_reference through the fused kernel: the logits are never written."""
  w, _ = _stacked(lin, None)
  out = jax.ShapeDtypeStruct((x.shape[0], 4), jnp.uint32)
  packed = _fused_call(x.astype(jnp.float32), w, norm_w.reshape(1, -1).astype(jnp.float32), 0, 0, "argmax",
                       jnp.dtype(dtype) == jnp.bfloat16, eps, out)
  return unpack_argmax(packed)


def unpack_argmax(packed) -> tuple[jax.Array, jax.Array]:
  """The argmax head's output uint32 [B, 4] -> (tokens [B] int32, finite [B] bool): words 0-1 the largest
  (orderable value << 32 | ~row), word 2 set where a value was not finite."""
  tokens = (jnp.uint32(0xFFFFFFFF) - packed[:, 0]).astype(jnp.int32)
  return tokens, packed[:, 2] == 0


def linear_residual(a, lin: Linear, layer, res, *, poison=None):
  """linear_residual_reference through the fused kernel. a [M, K] (bf16 | f32), res [M, N] f32."""
  w, li = _stacked(lin, layer)
  out = jax.ShapeDtypeStruct(res.shape, jnp.float32)
  return _fused_call(a, w, res, li, 0, "residual", a.dtype == jnp.bfloat16, 0.0, out, poison)


def qkv_epilogue(qkv, bias, q_norm, k_norm, inv_freq, layer: int, pos, writes, k_cache, v_cache, *,
                 n_heads: int, n_kv_heads: int, neox: bool, pos_scale: float, eps: float, alias: bool = True):
  """qkv_epilogue_reference through the kernel, the caches updated in place (aliased), plus the zeroed
  counters [B, G] int32 the one-kernel attention takes. alias=False (tests): the caches' outputs not aliased, so
  XLA gives them buffers of their own, which the handler fills from the inputs (as where XLA breaks an alias)."""
  ffi._ensure_registered()
  b, dh = qkv.shape[0], k_cache.shape[-1]
  outs = (jax.ShapeDtypeStruct((b, n_heads, dh), qkv.dtype), jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
          jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype), jax.ShapeDtypeStruct((b, n_kv_heads), jnp.int32))
  q, k_cache, v_cache, counters = jax.ffi.ffi_call(
      "jaxllm_qkv_epilogue", outs, input_output_aliases={7: 1, 8: 2} if alias else None,
      vmap_method="sequential")(
      qkv, _optional_f32(bias), _optional_f32(q_norm), _optional_f32(k_norm), inv_freq.astype(jnp.float32),
      pos.astype(jnp.int32),
      writes.astype(jnp.int32), k_cache, v_cache, layer=np.int64(layer), neox=np.int64(neox),
      pos_scale=np.float32(pos_scale), eps=np.float32(eps))
  return q, k_cache, v_cache, counters


def decode_attention_merged(q, k_cache, v_cache, layer: int, lengths, counters, *, splits=None,
                            with_counters=False, alias=True):
  """Decode attention (attention.decode_attention_reference's contract) in one kernel; counters [B, G]
  int32 zero (qkv_epilogue's; the kernel leaves them zero). splits: the split count (default: enough
  blocks to fill the GPU, at most 256). with_counters: also return the counters (to pass on). alias=False
  (tests): the counters' output not aliased to the input (see qkv_epilogue)."""
  b, h, dh = q.shape
  if splits is None:
    splits = merged_splits(b, k_cache)
  outs = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, splits, dh + 2), jnp.float32),
          jax.ShapeDtypeStruct(counters.shape, jnp.int32))
  out, _, counters = jax.ffi.ffi_call("jaxllm_decode_attention_merged", outs,
                                      input_output_aliases={4: 2} if alias else None, vmap_method="sequential")(
      q, k_cache, v_cache, jnp.clip(lengths, 1, k_cache.shape[3]).astype(jnp.int32), counters,
      layer=np.int64(layer))
  return (out, counters) if with_counters else out


def _align(n: int) -> int:
  return -(-n // 256) * 256


def layers_workspace_bytes(b: int, n: int, h: int, dh: int, f: int, splits: int, g: int) -> int:
  """Bytes of decode_layers' workspace (LayersLayout in ffi/fused_cuda.cu): qkv, attention out and SwiGLU
  out in bf16, the attention partials in f32, the counters."""
  return (_align(b * n * 2) + _align(b * h * dh * 2) + _align(b * f * 2) + _align(b * h * splits * (dh + 2) * 4)
          + _align(b * g * 4))


HEAD_MODES = {None: 0, "argmax": 1, "logits": 2}


def decode_layers(config, weights, x, pos, writes, lengths, inv_freq, pos_scale: float, k_cache, v_cache, *,
                  pdl: bool = True, head: str | None = None):
  """Every layer of the fused decode step in one FFI call (CUDA): the per-op path's kernels
  (forward_decode_fused) with the QKV epilogue folded into the attention kernel, five per layer, launched
  from one handler, each (pdl) a programmatic dependent of the one before; head "argmax" or "logits" adds
  the final norm and the LM head as the call's last kernel (norm_argmax's or norm_linear's).
  x [B, D] f32 -> (x [B, D] f32, caches updated in place, the head's output: packed argmax uint32 [B, 4],
  logits [B, V] in the activation dtype, or None)."""
  ffi._ensure_registered()
  c, w = config, weights
  b = x.shape[0]
  splits = merged_splits(b, k_cache)
  n = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
  nbytes = layers_workspace_bytes(b, n, c.n_heads, c.head_dim, c.d_ff, splits, c.n_kv_heads)
  opt = _optional_f32
  if head is None:
    head_in = (jnp.zeros((0,), jnp.float32), jnp.zeros((0, 0), jnp.int8), jnp.zeros((0, 0), jnp.float32))
    head_out = jax.ShapeDtypeStruct((0,), jnp.uint8)
  else:
    hw = w.head   # [V, D] int8 and [V, G] f32 scales
    head_in = (w.out_norm.reshape(-1).astype(jnp.float32), hw.w, hw.scale)
    head_out = (jax.ShapeDtypeStruct((b, 4), jnp.uint32) if head == "argmax"
                else jax.ShapeDtypeStruct((b, hw.w.shape[0]), jnp.bfloat16))
  outs = (jax.ShapeDtypeStruct(x.shape, jnp.float32), jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
          jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype), jax.ShapeDtypeStruct((nbytes,), jnp.uint8), head_out)
  x, k_cache, v_cache, _, out = jax.ffi.ffi_call("jaxllm_decode_layers", outs, input_output_aliases={18: 1, 19: 2},
                                                  vmap_method="sequential")(
      x, pos.astype(jnp.int32), writes.astype(jnp.int32), lengths.astype(jnp.int32), inv_freq.astype(jnp.float32),
      w.attn_norm, w.wqkv.w, w.wqkv.scale, opt(w.bqkv), opt(w.q_norm), opt(w.k_norm), w.wo.w, w.wo.scale,
      w.ffn_norm, w.w_gate_up.w, w.w_gate_up.scale, w.w_down.w, w.w_down.scale, k_cache, v_cache, *head_in,
      heads=np.int64(c.n_heads), kv_heads=np.int64(c.n_kv_heads), neox=np.int64(c.rope_style == "neox"),
      pos_scale=np.float32(pos_scale), eps=np.float32(c.rms_eps),
      splits=np.int64(splits), pdl=np.int64(pdl), head=np.int64(HEAD_MODES[head]))
  return x, k_cache, v_cache, (None if head is None else out)


class LayersCall(NamedTuple):
  one: bool        # every layer from one FFI call (decode_layers)
  pdl: bool        # programmatic dependent launch
  head: bool       # the LM head as that call's last kernel
  max_splits: int  # the one-kernel attention's splits at most (merged_splits)


def layers_call() -> LayersCall:
  """How the GPU runs the fused step's layers: one FFI call with the LM head as its last kernel, and PDL. In a
  lab build (jaxllm/lab.py), for comparison: JAXLLM_LAYERS_CALL=0 runs one FFI call per op,
  JAXLLM_LAYERS_HEAD=0 the head in its own call, JAXLLM_PDL=0 launches plainly, JAXLLM_ATTN_MAX_SPLITS=n
  cuts the attention's splits to n (a block then walks several tiles)."""
  one = jax.default_backend() == "gpu" and lab.switch("JAXLLM_LAYERS_CALL", "1") != "0"
  cap = lab.switch("JAXLLM_ATTN_MAX_SPLITS", str(MERGE_MAX_SPLITS))
  if not (cap.isascii() and cap.isdigit()) or not 1 <= int(cap) <= MERGE_MAX_SPLITS:   # ('²' is a digit to isdigit)
    raise ValueError(f"JAXLLM_ATTN_MAX_SPLITS must be an integer in 1..{MERGE_MAX_SPLITS}, got {cap!r}")
  return LayersCall(one, lab.switch("JAXLLM_PDL", "1") != "0", lab.switch("JAXLLM_LAYERS_HEAD", "1") != "0",
                    int(cap))


# ---- when the fused decode step runs ---------------------------------------------------------------------

def cpu_fused() -> bool:
  """Whether the CPU runs the fused step: no (see fused_decode_reason), unless JAXLLM_FUSED_CPU=1 in a lab build
  (jaxllm/lab.py; the tests run the CPU's fused handlers so)."""
  return lab.switch("JAXLLM_FUSED_CPU") == "1"


def _attention_reason(config, cache) -> str | None:
  """Why the QKV epilogue and the one-kernel attention cannot run for this model and cache on the default
  backend, or None (what the fused step and the unfused step's attention block both need)."""
  reason = ffi.unavailable_reason()
  if reason is not None:
    return reason
  if cache.k.dtype != cache.compute_dtype:
    return "the fused QKV epilogue writes the cache in the activation dtype"
  if config.head_dim % 2 or config.head_dim > 256:
    return f"head dim {config.head_dim}"
  if jax.default_backend() == "gpu":
    if jnp.dtype(cache.compute_dtype) != jnp.bfloat16:
      return "the CUDA fused kernels are built for bf16 activations"
    if not ffi.attention_supported(config.head_dim, config.n_heads, config.n_kv_heads):
      return "the attention geometry"
  elif not cpu_fused():
    # Measured on the 2-core CPU (smollm2-135m, docs/kernels.md): the fused step ran slower than the
    # unfused one (14.9-17.7 against 11.9-13.2 ms), so the CPU keeps the unfused path unless asked.
    return "the CPU runs the unfused step unless JAXLLM_FUSED_CPU=1 (the fusions do not pay there yet)"
  return None


def attention_block_reason(config, cache, batch: int) -> str | None:
  """None when the unfused decode step's attention block (qkv bias, q/k norm, RoPE, the cache append, the
  attention) can run as qkv_epilogue + decode_attention_merged for a step of `batch` rows (model.forward with
  kernels "ffi" and unrolled layers, where the fused step does not run); else why not."""
  reason = _attention_reason(config, cache)
  if reason is None and jax.default_backend() == "gpu":
    if config.head_dim != GPU_BLOCK_HEAD_DIM:
      reason = f"head dim {config.head_dim} (the fused attention block measured slower at 128, the 7B shape)"
    elif batch > GPU_BLOCK_MAX_BATCH:
      reason = f"batch {batch} > {GPU_BLOCK_MAX_BATCH} (the fused attention block measured slower at batch 64)"
  return reason


def fused_decode_reason(config, weights, cache, batch: int) -> str | None:
  """None when the fused decode step can run for this model, cache and batch on the default backend (with
  the FFI kernels registered); else why not (then the unfused FFI path runs)."""
  reason = ffi.unavailable_reason()
  if reason is not None:
    return reason
  lins = (weights.wqkv, weights.wo, weights.w_gate_up, weights.w_down, weights.head)
  if not all(isinstance(lin, Linear) and lin.quantized for lin in lins):
    return "the fused kernels take W8A16 weights"
  reason = _attention_reason(config, cache)
  if reason is not None:
    return reason
  if jax.default_backend() == "gpu":
    if batch > GPU_FUSED_BATCH:
      return f"batch {batch} > {GPU_FUSED_BATCH} (the fused step measured slower at batch 4)"
    if config.d_model > GPU_MAX_NORM_K:
      return f"model width {config.d_model} > {GPU_MAX_NORM_K}"
  elif batch > max_m():
    return f"batch {batch} > {max_m()}"
  return None
