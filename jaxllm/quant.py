"""W8A16: int8 weights with one float32 scale per output channel, 16-bit (or f32) activations.

Why groups of 64 inputs rather than one scale per output channel: per channel, SmolLM2-135M's
teacher-forced top-1 agreement with the float model was 93.6% (below our 95% bar) and the relative weight
error 1.3x-3.3x that of groups of 64 (docs/quantization.md has the measured numbers). A scale per 64 int8
weights costs 6% more bytes read and one multiply per group in the kernels.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


GROUP = 64   # inputs per scale; every K of the supported models is a multiple of 64


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Linear:
  """A linear layer's weight, y = x @ dequantize(w).T.

  w: [..., N, K] int8 (quantized) or float (reference runs).
  scale: [..., N, K // group] float32 (one scale per `group` consecutive inputs of each output), or None
    for float weights. A single group (K // group == 1) is per-output-channel scaling.
  """
  w: jax.Array
  scale: jax.Array | None = None

  @property
  def quantized(self) -> bool:
    return self.scale is not None

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """Float weight [..., N, K]."""
    if self.scale is None:
      return self.w.astype(dtype)
    *lead, n, k = self.w.shape
    g = self.scale.shape[-1]
    w = self.w.reshape(*lead, n, g, k // g).astype(jnp.float32) * self.scale[..., None]
    return w.reshape(*lead, n, k).astype(dtype)


def quantize_int8(w: np.ndarray, group: int | None = GROUP) -> tuple[np.ndarray, np.ndarray]:
  """Symmetric int8 with one scale per `group` consecutive inputs (None: per output channel).

  Args:
    w: [..., N, K] float, K a multiple of group.
  Returns:
    q: [..., N, K] int8 with q = round(w / scale), |q| <= 127.
    scale: [..., N, K // group] float32 = max|w| over the group / 127 (1 for all-zero groups).
  """
  w = np.asarray(w, np.float32)
  *lead, n, k = w.shape
  group = k if group is None else group
  if k % group:
    raise ValueError(f"cannot quantize a weight with K={k} inputs in groups of {group}: K must be a multiple")
  g = w.reshape(*lead, n, k // group, group)
  amax = np.max(np.abs(g), axis=-1)
  scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
  q = np.clip(np.rint(g / scale[..., None]), -127, 127).astype(np.int8)
  return q.reshape(w.shape), scale


LOWBIT_GROUP = 32   # values a scale and min in LowBit (the GGUF blocks' size)
# GGUF block types LowBit holds without loss: (bytes a block, whether it has a min, whether a fifth bit).
LOWBIT_TYPES = {"Q4_0": (18, False, False), "Q4_1": (20, True, False), "Q5_0": (22, False, True),
                "Q5_1": (24, True, True)}
# Q4_K: super-blocks of 256 values, 144 bytes (f16 d and dmin, 6-bit scales and mins of its eight groups of
# 32, 4-bit values); LowBit holds it as 4-bit groups with scale d * sc and min -dmin * m rounded to f16.
Q4_K_BYTES = 144
LOWBIT_BITS = {**{t: 5 if high else 4 for t, (_, _, high) in LOWBIT_TYPES.items()}, "Q4_K": 4}   # the width each needs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LowBit:
  """A linear layer's weight at the GGUF file's own 4 or 5 bits: w = scale * q + min in groups of 32 inputs.

  Holds Q4_0, Q4_1, Q5_0 and Q5_1 blocks exactly (Q4_0 and Q5_0 as min = -8 scale and -16 scale; a 4-bit
  weight in a 5-bit stack has its fifth bits zero), in about half the bytes of W8A16; Q4_K with its groups'
  scale and min products rounded to f16 (a relative 2^-11 of each; W8A16's own rounding is 1/254 of a
  group's largest weight).
  q: [..., N, K // 2] uint8, a group's 16 bytes as the file keeps them: byte j holds value j in its low
    nibble and value j + 16 in its high one.
  high: [..., N, K // 32] uint32, bit j the fifth bit of value j of the group; [..., N, 0] for 4-bit weights.
  scale: [..., N, K // 32] float16.
  min: [..., N, K // 32] float16, or [..., N, 0] where every group's min is -2^(bits - 1) scale (a stack of
    Q4_0 or of Q5_0 blocks only), so that it is not stored: 0.56 and 0.69 bytes a weight, as in the file.
  """
  q: jax.Array
  high: jax.Array
  scale: jax.Array
  min: jax.Array

  @property
  def bits(self) -> int:
    return 5 if self.high.shape[-1] else 4

  @property
  def implicit_min(self) -> float | None:
    """The factor of scale that is every group's min where min is not stored (-8 or -16), else None."""
    return None if self.min.shape[-1] else -float(1 << (self.bits - 1))

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """Float weight [..., N, K]."""
    *lead, n, half = self.q.shape
    g = half // 16
    b = self.q.reshape(*lead, n, g, 16).astype(jnp.int32)
    q = jnp.concatenate([b & 15, b >> 4], axis=-1)                               # [..., N, G, 32]
    if self.high.shape[-1]:
      bit = (self.high[..., None].astype(jnp.uint32) >> jnp.arange(32, dtype=jnp.uint32)) & 1
      q = q | (bit.astype(jnp.int32) << 4)
    scale = self.scale.astype(jnp.float32)
    m = scale * self.implicit_min if self.implicit_min is not None else self.min.astype(jnp.float32)
    w = q.astype(jnp.float32) * scale[..., None] + m[..., None]
    return w.reshape(*lead, n, 2 * half).astype(dtype)


def lowbit_bits(types) -> int | None:
  """The LowBit width that holds tensors of these GGUF types (4 or 5), or None (some other type)."""
  types = set(types)
  if not types or not types <= set(LOWBIT_BITS):
    return None
  return max(LOWBIT_BITS[t] for t in types)


def implicit_min_stack(types, bits: int) -> bool:
  """Whether a LowBit stack of `bits` holding tensors of these GGUF types leaves its min out (LowBit.min
  [..., 0]): every one Q4_0 in a 4-bit stack or Q5_0 in a 5-bit one, whose min is -2^(bits - 1) scale."""
  return set(types) == {"Q4_0" if bits == 4 else "Q5_0"}


def lowbit_from_blocks(raw: np.ndarray, ggml_type: str, bits: int,
                       store_min: bool = True) -> tuple[np.ndarray, ...] | None:
  """A tensor's GGUF blocks as LowBit arrays (q, high, scale, min), or None where a min would overflow f16.

  Args:
    raw: [N, row_bytes] uint8, the tensor's rows as the file stores them.
    ggml_type: one of LOWBIT_BITS.
    bits: the stack's width (lowbit_bits): 5 gives high bits (zero for 4-bit types), 4 none.
    store_min: False for a stack whose min is implicit (implicit_min_stack): min then [N, 0].
  Returns:
    q [N, K // 2] uint8, high [N, G or 0] uint32, scale [N, G] float16, min [N, G or 0] float16.
  """
  if ggml_type == "Q4_K":
    return _lowbit_from_q4_k(raw, bits)
  size, has_min, has_high = LOWBIT_TYPES[ggml_type]
  n = raw.shape[0]
  blocks = np.ascontiguousarray(raw).reshape(n, -1, size)                      # [N, G, block]
  g = blocks.shape[1]
  d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
  at = 2
  if has_min:
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    at = 4
  elif not store_min:
    m = np.zeros((n, 0), np.float16)
  else:
    with np.errstate(over="ignore"):
      m = (d.astype(np.float32) * np.float32(-16.0 if has_high else -8.0)).astype(np.float16)
    if not np.all(np.isfinite(m) | ~np.isfinite(d)):
      return None
  if has_high:
    high = blocks[..., at:at + 4].copy().view("<u4")[..., 0].astype(np.uint32)
    at += 4
  else:
    high = np.zeros((n, g), np.uint32)
  q = blocks[..., at:at + 16].reshape(n, g * 16)
  if bits == 4:
    high = np.zeros((n, 0), np.uint32)
  return np.ascontiguousarray(q), high, d, m


def _lowbit_from_q4_k(raw: np.ndarray, bits: int) -> tuple[np.ndarray, ...] | None:
  """Q4_K rows as LowBit arrays (see lowbit_from_blocks), or None where a scale or min overflows f16.

  A super-block (ggml's block_q4_K) holds eight groups of 32: group 2c's values are the low nibbles of
  bytes 32c..32c+31 of its values, group 2c + 1's their high nibbles; value = d * sc[g] * q - dmin * m[g]
  with 6-bit sc and m packed in 12 bytes (ggml's get_scale_min_k4).
  """
  n = raw.shape[0]
  blocks = np.ascontiguousarray(raw).reshape(n, -1, Q4_K_BYTES)                   # [N, S, 144]
  s = blocks.shape[1]
  d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)        # [N, S]
  dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
  p = blocks[..., 4:16].astype(np.uint32)                                          # [N, S, 12]
  sc = np.concatenate([p[..., 0:4] & 63, (p[..., 8:12] & 15) | ((p[..., 0:4] >> 6) << 4)], axis=-1)  # [N, S, 8]
  mn = np.concatenate([p[..., 4:8] & 63, (p[..., 8:12] >> 4) | ((p[..., 4:8] >> 6) << 4)], axis=-1)
  with np.errstate(over="ignore", invalid="ignore"):
    scale = (d[..., None] * sc).astype(np.float16).reshape(n, s * 8)
    minv = (-(dmin[..., None] * mn)).astype(np.float16).reshape(n, s * 8)
  if not (np.all(np.isfinite(scale)) and np.all(np.isfinite(minv))):
    return None
  b = blocks[..., 16:].reshape(n, s, 4, 32)                                        # [N, S, chunk, byte]
  lo, hi = b & 15, b >> 4                                                          # groups 2c and 2c + 1
  # LowBit's group layout: byte j holds value j (low nibble) and value j + 16 (high nibble).
  groups = np.stack([lo, hi], axis=3)                                              # [N, S, 4, 2, 32]
  q = (groups[..., :16] | (groups[..., 16:] << 4)).astype(np.uint8).reshape(n, s * 8 * 16)
  high = np.zeros((n, s * 8 if bits == 5 else 0), np.uint32)
  return np.ascontiguousarray(q), high, scale, minv


@dataclasses.dataclass(frozen=True)
class Mixed:
  """A stacked matrix whose layers are not all held alike (a GGUF file that quantizes some layers, or some
  rows of a layer, to other types: llama.cpp's Q4_K_M gives half the layers' ffn_down Q6_K, the rest Q4_K).

  Layer i's weight is the rows of its pieces, layout[i] = ((part, index), ...), concatenated: part p's
  stacked weight at that index. parts: Linear or LowBit, each stacked [L_p, N_p, K] over the layers that
  have that piece.
  """
  parts: tuple
  layout: tuple = dataclasses.field(metadata=dict(static=True))

  def pieces(self, layer: int) -> list[tuple["Linear | LowBit", int]]:
    return [(self.parts[p], j) for p, j in self.layout[layer]]

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """Float weight [L, N, K]."""
    return jnp.stack([jnp.concatenate([part.dequantize(dtype)[j] for part, j in self.pieces(i)])
                      for i in range(len(self.layout))])

  def at(self, layer: jax.Array) -> "MixedAt":
    return MixedAt(self, jnp.asarray(layer, jnp.int32))


jax.tree_util.register_dataclass(Mixed, data_fields=["parts"], meta_fields=["layout"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MixedAt:
  """One layer of a Mixed stack picked by a traced index (a scan over the layers): the kernels then take the
  layer's kind of pieces by lax.switch (jaxllm.kernels.linear)."""
  mixed: Mixed
  layer: jax.Array   # [] int32


Q6_K_BYTES = 210   # a Q6_K super-block: ql [128], qh [64], scales [16] int8, d f16


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Q6K:
  """A linear layer's weight as the file's Q6_K super-blocks (exactly, 0.82 bytes a weight):
  w = d * sc[i // 16] * (q - 32) with q 6 bits, in ggml's order (see ffi/lowbit_cpu.cc): in each half of
  128 values, ql byte l < 32 holds value l (low nibble) and l + 64 (high), byte l + 32 values l + 32 and
  l + 96; qh byte l the high 2 bits of values l, l + 32, l + 64, l + 96 at bits 0, 2, 4, 6.
  ql: [..., N, K // 2] uint8; qh: [..., N, K // 4] uint8; sc: [..., N, K // 16] int8; d: [..., N, K // 256] f16.
  """
  ql: jax.Array
  qh: jax.Array
  sc: jax.Array
  d: jax.Array

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """Float weight [..., N, K]."""
    *lead, n, half = self.ql.shape
    s = half // 128
    ql = self.ql.reshape(*lead, n, s, 2, 2, 32).astype(jnp.int32)          # [..., S, half, (l, l + 32), 32]
    qh = self.qh.reshape(*lead, n, s, 2, 1, 32).astype(jnp.int32)
    low = jnp.concatenate([ql & 15, ql >> 4], axis=-2)                      # values l, l + 32, l + 64, l + 96
    high = jnp.concatenate([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, (qh >> 6) & 3], axis=-2)
    q = (low | (high << 4)) - 32                                            # [..., N, S, 2, 4, 32]
    sc = self.sc.reshape(*lead, n, s, 16).astype(jnp.float32) * self.d.astype(jnp.float32)[..., None]
    w = q.reshape(*lead, n, s, 16, 16).astype(jnp.float32) * sc[..., None]
    return w.reshape(*lead, n, 2 * half).astype(dtype)


def q6k_from_blocks(raw: np.ndarray) -> tuple[np.ndarray, ...]:
  """A Q6_K tensor's rows [N, row_bytes] uint8 as Q6K arrays (ql, qh, sc, d): the blocks' fields apart."""
  n = raw.shape[0]
  b = np.ascontiguousarray(raw).reshape(n, -1, Q6_K_BYTES)
  s = b.shape[1]
  return (np.ascontiguousarray(b[..., :128]).reshape(n, s * 128), np.ascontiguousarray(b[..., 128:192]).reshape(n, s * 64),
          np.ascontiguousarray(b[..., 192:208]).view(np.int8).reshape(n, s * 16),
          np.ascontiguousarray(b[..., 208:210]).view(np.float16).reshape(n, s))
