"""Sampling on the device, with every setting as data: one compiled step serves every request.

`SamplingParams` is what a user asks for; `Sampler` is the same settings as per-sequence arrays [B] in the
decode state, with each sequence's PRNG key and a window of its last MAX_REPEAT_LAST_N tokens. Changing a
temperature, a top-p, a penalty window or a seed therefore changes data, never the compiled program, and a
batch can mix settings row by row (what a server does).

Order, per row (HF transformers' order for the first four; the penalties as llama.cpp applies them over
the row's last repeat_last_n tokens, prompt included):
  1. penalties on the logits of tokens among the last repeat_last_n (at most MAX_REPEAT_LAST_N): repeat
     (x / r if x > 0 else x * r), then frequency (- f * count) and presence (- p * [count > 0]);
  2. temperature (0 = greedy: the argmax of the penalized logits);
  3. top-k, top-p (nucleus, on the distribution top-k left), min-p (p >= min_p * p_max);
  4. a draw: with none of top-k/top-p/min-p, exactly from the full softmax (Gumbel-max over all V logits);
     with any, among the MAX_TOP_K most likely tokens. Top-p and min-p are therefore exact whenever the
     tokens they keep are among those candidates; a nucleus wider than MAX_TOP_K tokens is cut to them.
     A row whose top_k exceeds MAX_TOP_K is drawn among all V tokens instead, exactly (top-k, then top-p
     and min-p, over a sort of the vocabulary): that takes the wide step, a static field of the Sampler
     (Sampler.wide_top_k), so the other steps keep their candidates alone. top_k >= V keeps every token.
Candidates come from an exact two-stage top-k (block maxima, then the best blocks), never a sort of V; on the
GPU's FFI path from one CUDA kernel (jaxllm.kernels.ffi.top_candidates: radix selects instead of XLA's
sorts; in a lab build JAXLLM_CANDIDATES_KERNEL=0 keeps the jnp path, see candidates_kernel). The wide
step's sort is XLA's on every backend (the kernel takes at most MAX_TOP_K candidates).
A row whose logits are not all finite samples token -1 and is reported, never drawn from.
A Sampler may carry a token mask (Sampler.mask, a grammar's: jaxllm.structured): a packed bitmask per row,
token t allowed where bit t % 32 of word t // 32 is set; every other token's logit is -inf before all of the
above, so no path of sample() can draw it. A row without a grammar has every bit set.
A Sampler may carry logit biases (OpenAI's logit_bias: Sampler.bias_ids, bias_values): per row up to
MAX_LOGIT_BIAS (token id, bias) pairs added to the logits before the mask and everything above (-100 makes a
token's draw as good as impossible, +100 as good as certain). Sparse, not a dense [B, V] vector: a row's pairs
are 2.4 KB to upload where a dense row is V x 4 bytes (600 KB for Qwen2.5's vocabulary) in the state and on
every admission; the scatter-add onto [B, V] is one pass that the logits' other passes dwarf.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import lab

MAX_TOP_K = 128          # candidates kept for top-k / top-p / min-p: a larger top_k takes the wide step
MAX_SAMPLER_TOP_K = 2 ** 31 - 1   # top_k is an int32 on the device (at least V: every token)
REPEAT_LAST_N = 64       # last tokens the penalties look at by default (llama.cpp's repeat_last_n default)
MAX_REPEAT_LAST_N = 4096  # the most they look at: each row's window of recent tokens (docs/usage.md)
CANDIDATE_BLOCK = 128    # logits per block in the two-stage top-k
NONFINITE = -1           # the token a row with NaN or inf logits gets
MASK_BITS = 32           # tokens per word of a token mask (uint32)
MAX_LOGIT_BIAS = 300     # (token id, bias) pairs per row at most (OpenAI's logit_bias takes 300)
LOGIT_BIAS_RANGE = 100.0  # a bias is in [-100, 100]
_NO_BIAS_ID = np.iinfo(np.int32).max   # an unused pair's id: past every vocabulary, so the scatter drops it
# Sampling settings' bounds: within them a finite logit stays finite through temperature and penalties
# (|logit| / 1e-3, |logit| x 100 and 100 x MAX_REPEAT_LAST_N stay far inside f32).
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 1e3
REPEAT_PENALTY_RANGE = (0.01, 100.0)
MAX_ADDITIVE_PENALTY = 100.0


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """One request's sampling settings (host side). Defaults: greedy, no penalties.

  temperature 0 = greedy; top_k 0 = off (at least the vocabulary: every token; above MAX_TOP_K the wide
  step); top_p 1 = off; min_p 0 = off; repeat_penalty 1 = off; presence/frequency 0 = off; seed None =
  derived from the engine's seed; repeat_last_n: how many of the last tokens the penalties look at, in
  [0, MAX_REPEAT_LAST_N] (0 = penalties off).
  """
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  repeat_penalty: float = 1.0
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  seed: int | None = None
  repeat_last_n: int = REPEAT_LAST_N

  def __post_init__(self):
    def number(name, ok, expect):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name} must be {expect}, got {value!r}")

    def integer(name, hi, expect):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= hi:
        raise ValueError(f"{name} must be an integer in [0, {hi}] ({expect}), got {value!r}")
    # Bounds keep every scaled logit finite (a logit divided by 1e-38, or a penalty of 1e30, is inf, and then
    # NaN): temperature 0 (greedy) or in [MIN_TEMPERATURE, MAX_TEMPERATURE]; penalties within their ranges.
    number("temperature", lambda v: v == 0 or MIN_TEMPERATURE <= v <= MAX_TEMPERATURE,
           f"0 (greedy) or a number in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]")
    integer("top_k", MAX_SAMPLER_TOP_K, "0 = off; at least the vocabulary keeps every token")
    integer("repeat_last_n", MAX_REPEAT_LAST_N, "the last tokens the penalties look at; 0 = penalties off")
    number("top_p", lambda v: 0 < v <= 1, "in (0, 1]")
    number("min_p", lambda v: 0 <= v < 1, "in [0, 1)")
    lo, hi = REPEAT_PENALTY_RANGE
    number("repeat_penalty", lambda v: lo <= v <= hi, f"a number in [{lo}, {hi}] (1 = off)")
    number("presence_penalty", lambda v: abs(v) <= MAX_ADDITIVE_PENALTY,
           f"a number in [-{MAX_ADDITIVE_PENALTY}, {MAX_ADDITIVE_PENALTY}] (0 = off)")
    number("frequency_penalty", lambda v: abs(v) <= MAX_ADDITIVE_PENALTY,
           f"a number in [-{MAX_ADDITIVE_PENALTY}, {MAX_ADDITIVE_PENALTY}] (0 = off)")
    if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                  or not 0 <= self.seed < 2 ** 63):
      raise ValueError(f"seed must be an integer in [0, 2^63) or None, got {self.seed!r}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0 or self.top_k == 1

  @property
  def penalized(self) -> bool:
    """Whether any repeat/presence/frequency penalty is on (over a window of at least one token)."""
    on = self.repeat_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
    return on and self.repeat_last_n > 0

  @property
  def wide_top_k(self) -> bool:
    """Whether the row samples with a top_k beyond the MAX_TOP_K candidates (the wide step draws it)."""
    return not self.greedy and self.top_k > MAX_TOP_K


def rows_of(params: SamplingParams | Sequence[SamplingParams], batch: int) -> list[SamplingParams]:
  """One SamplingParams per row: the one given for every row, or the list given (checked)."""
  rows = [params] * batch if isinstance(params, SamplingParams) else list(params)
  if len(rows) != batch or not all(isinstance(p, SamplingParams) for p in rows):
    raise ValueError(f"params must be one SamplingParams or one per row ({batch}), got {params!r}")
  return rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampler:
  """Per-sequence sampling state: settings [B], PRNG keys [B, 2], and the penalties' window.

  recent [B, W] (W = MAX_REPEAT_LAST_N) holds each row's last W tokens, token i in slot i % W (any id >= V
  where there is none); seen [B] counts the row's tokens so far (its history and the tokens pushed since), so
  slot s holds the token (seen - 1 - s) % W places back; last_n [B] is how many of them the penalties look at.
  mask [B, ceil(V / 32)] uint32, or None: the tokens each row may draw (see the module docstring); None (no
  array at all in the pytree) where no row has a grammar, and then a step may take the fused argmax head.
  bias_ids [B, MAX_LOGIT_BIAS] int32 and bias_values [B, MAX_LOGIT_BIAS] f32, or None (both): each row's logit
  biases (unused pairs: id _NO_BIAS_ID, bias 0); like the mask, a state with them never takes the argmax head.
  wide_top_k (static): some row samples with a top_k above MAX_TOP_K, so sample() runs the wide step; a
  Sampler without it draws such a row among the MAX_TOP_K candidates. Sampler.create sets it from the rows.
  """
  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  min_p: jax.Array
  repeat_penalty: jax.Array
  presence_penalty: jax.Array
  frequency_penalty: jax.Array
  keys: jax.Array
  recent: jax.Array
  seen: jax.Array
  last_n: jax.Array
  mask: jax.Array | None = None
  bias_ids: jax.Array | None = None
  bias_values: jax.Array | None = None
  wide_top_k: bool = dataclasses.field(default=False, metadata=dict(static=True))

  @staticmethod
  def create(params: SamplingParams | Sequence[SamplingParams], batch: int, seed: int = 0,
             history: Sequence[Sequence[int]] | None = None, vocab_size: int = 0,
             masks: np.ndarray | None = None,
             biases: Sequence[Mapping[int, float] | None] | None = None) -> "Sampler":
    """Host arrays for `batch` rows: one SamplingParams for all, or one per row.

    A row's key is made from params.seed when the row sets one, else from seed + row (threefry's seeding,
    computed on the host: jax.random.PRNGKey(s) for s < 2^32).
    history: each row's tokens so far (the prompt), whose last MAX_REPEAT_LAST_N tokens fill the window;
    vocab_size marks empty window slots (any id >= V; 0 leaves the window empty).
    masks: [batch, ceil(V / 32)] uint32 token masks (full_mask for rows without a grammar), or None.
    biases: per row a {token id: bias} map (None or {}: none), or None for no bias arrays at all (bias_table).
    """
    rows = rows_of(params, batch)
    if masks is not None:
      masks = np.asarray(masks)
      if masks.dtype != np.uint32 or masks.ndim != 2 or masks.shape[0] != batch:
        raise ValueError(f"masks must be uint32 [{batch}, ceil(V / {MASK_BITS})], got {masks.dtype} {masks.shape}")
    bias_ids, bias_values = (None, None) if biases is None else bias_table(biases, batch, vocab_size)
    seeds = [p.seed if p.seed is not None else seed + b for b, p in enumerate(rows)]
    if not all(isinstance(s, (int, np.integer)) and 0 <= s < 2 ** 63 for s in seeds):
      raise ValueError(f"seeds must be integers in [0, 2^63), got {seeds[:4]}")
    keys = np.asarray([[(s >> 32) & 0xFFFFFFFF, s & 0xFFFFFFFF] for s in seeds], np.uint32)
    empty = max(vocab_size, 1) if vocab_size else np.iinfo(np.int32).max
    recent = np.full((batch, MAX_REPEAT_LAST_N), empty, np.int32)
    seen = np.zeros((batch,), np.int32)
    for b, hist in enumerate(history or []):
      recent[b] = window_of(hist, empty)
      seen[b] = len(hist)

    def col(name, dtype):
      return np.asarray([getattr(p, name) for p in rows], dtype)
    return Sampler(temperature=col("temperature", np.float32), top_k=col("top_k", np.int32),
                   top_p=col("top_p", np.float32), min_p=col("min_p", np.float32),
                   repeat_penalty=col("repeat_penalty", np.float32),
                   presence_penalty=col("presence_penalty", np.float32),
                   frequency_penalty=col("frequency_penalty", np.float32), keys=keys, recent=recent, seen=seen,
                   last_n=col("repeat_last_n", np.int32), mask=masks, bias_ids=bias_ids,
                   bias_values=bias_values, wide_top_k=any(p.wide_top_k for p in rows))

  def push(self, tokens: jax.Array, index: jax.Array, active: jax.Array) -> "Sampler":
    """Puts each active row's new token (its `index`-th token, [B]) into the penalty window."""
    b = jnp.arange(tokens.shape[0])
    recent = jnp.asarray(self.recent)
    slot = index % recent.shape[1]
    new = jnp.where(active, tokens, recent[b, slot])
    seen = jnp.where(active, index + 1, self.seen).astype(jnp.int32)
    return dataclasses.replace(self, recent=recent.at[b, slot].set(new), seen=seen)


def bias_table(biases: Sequence[Mapping[int, float] | None], batch: int,
               vocab_size: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Per-row logit biases ({token id: bias}, or None) as (ids [batch, MAX_LOGIT_BIAS] int32, biases
  [batch, MAX_LOGIT_BIAS] f32): each row's pairs first, then unused ones (id _NO_BIAS_ID, bias 0).
  Ids must be in [0, vocab_size) (any id >= 0 when vocab_size is 0), biases finite in [-100, 100]."""
  if len(biases) != batch:
    raise ValueError(f"biases must hold one map (or None) per row ({batch}), got {len(biases)}")
  ids = np.full((batch, MAX_LOGIT_BIAS), _NO_BIAS_ID, np.int32)
  values = np.zeros((batch, MAX_LOGIT_BIAS), np.float32)
  for b, row in enumerate(biases):
    row = dict(row or {})
    if len(row) > MAX_LOGIT_BIAS:
      raise ValueError(f"a row takes at most {MAX_LOGIT_BIAS} logit biases, got {len(row)}")
    for j, (t, v) in enumerate(row.items()):
      if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0 or (vocab_size and t >= vocab_size):
        raise ValueError(f"a logit bias's token id must be an integer in [0, {vocab_size or 'V'}), got {t!r}")
      if isinstance(v, bool) or not isinstance(v, numbers.Real) or not -LOGIT_BIAS_RANGE <= v <= LOGIT_BIAS_RANGE:
        raise ValueError(f"a logit bias must be a number in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], "
                         f"got {v!r} for token {t}")
      ids[b, j], values[b, j] = t, v
  return ids, values


def mask_words(vocab_size: int) -> int:
  """Words of a token mask for a vocabulary of vocab_size tokens: ceil(V / 32)."""
  return -(-vocab_size // MASK_BITS)


def full_mask(batch: int, vocab_size: int) -> np.ndarray:
  """Token masks [batch, ceil(V / 32)] uint32 that allow every token (rows without a grammar)."""
  return np.full((batch, mask_words(vocab_size)), 0xFFFFFFFF, np.uint32)


def allowed_tokens(mask: jax.Array, vocab_size: int) -> jax.Array:
  """A packed token mask [B, ceil(V / 32)] uint32 unpacked: [B, V] bool, token t from bit t % 32 of word t // 32."""
  assert mask.shape[-1] == mask_words(vocab_size), (mask.shape, vocab_size)
  bits = (mask[:, :, None] >> jnp.arange(MASK_BITS, dtype=jnp.uint32)) & 1                  # [B, W, 32]
  return bits.reshape(mask.shape[0], -1)[:, :vocab_size].astype(bool)


def window_of(history: Sequence[int], empty: int) -> np.ndarray:
  """The penalty window [W] of a token history: token i sits in slot i % W; slots with no token hold `empty`."""
  out = np.full((MAX_REPEAT_LAST_N,), empty, np.int32)
  n = len(history)
  last = np.asarray(history[max(0, n - MAX_REPEAT_LAST_N):], np.int64)
  out[np.arange(n - len(last), n) % MAX_REPEAT_LAST_N] = last
  return out


def apply_penalties(logits: jax.Array, sampler: Sampler) -> jax.Array:
  """logits [B, V] f32 with the repeat, frequency and presence penalties of each row's last last_n tokens."""
  b, v = logits.shape
  recent = sampler.recent                                                   # [B, W]
  w = recent.shape[1]
  back = (sampler.seen[:, None] - 1 - jnp.arange(w)[None, :]) % w           # [B, W]: 0 = the newest token
  keep = (recent >= 0) & (recent < v) & (back < sampler.last_n[:, None])
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], recent.shape)
  counts = jnp.zeros((b, v), jnp.int32).at[rows, jnp.where(keep, recent, v)].add(1, mode="drop")   # [B, V]
  r = sampler.repeat_penalty[:, None]
  x = jnp.where(logits > 0, logits / r, logits * r)
  x = x - sampler.frequency_penalty[:, None] * counts - sampler.presence_penalty[:, None] * (counts > 0)
  return jnp.where(counts > 0, x, logits)


def top_candidates(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """The k largest values of each row of x [B, V] and their ids, descending: [B, k], [B, k] int32.

  Exact, without sorting V: the blocks holding the top k are among the k blocks with the largest maxima
  (a block whose maximum ranks below k holds no element that does), so top-k runs over V / block maxima
  and then over those k blocks' k * block values. Equal values rank as lax.top_k ranks them (which the
  backend decides); the GPU kernel (candidates) puts the lower id first.
  """
  b, v = x.shape
  c = CANDIDATE_BLOCK
  k = min(k, v)
  n = -(-v // c)
  xp = jnp.pad(x, ((0, 0), (0, n * c - v)), constant_values=-jnp.inf).reshape(b, n, c)
  if n <= k:
    vals, ids = jax.lax.top_k(x, k)
    return vals, ids.astype(jnp.int32)
  _, blocks = jax.lax.top_k(jnp.max(xp, axis=-1), k)                        # [B, k]
  cand = jnp.take_along_axis(xp, blocks[:, :, None], axis=1).reshape(b, k * c)
  vals, at = jax.lax.top_k(cand, k)
  ids = jnp.take_along_axis(blocks, at // c, axis=1) * c + at % c
  return vals, ids.astype(jnp.int32)


def _split_keys(keys: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-row keys [B, 2] -> (next keys, key for the full draw, key for the candidate draw)."""
  split = jax.vmap(lambda k: jax.random.split(k, 3))(keys)                 # [B, 3, 2]
  return split[:, 0], split[:, 1], split[:, 2]


CANDIDATES_ENV = "JAXLLM_CANDIDATES_KERNEL"


def candidates_kernel() -> bool:
  """Whether FFI paths take the candidates from the CUDA kernel (ffi/sampling_cuda.cu) where it runs: yes,
  unless JAXLLM_CANDIDATES_KERNEL=0 in a lab build (jaxllm/lab.py; the jnp path, for comparison)."""
  value = lab.switch(CANDIDATES_ENV, "1").strip() or "1"
  if value not in ("0", "1"):
    raise ValueError(f"{CANDIDATES_ENV} must be 0 or 1, got {value!r}")
  return value == "1"


def candidates(x: jax.Array, k: int, kernels: str = "xla") -> tuple[jax.Array, jax.Array, jax.Array]:
  """top_candidates(x, k) and each row's logsumexp [B]: from the CUDA kernel (one pass over x for both)
  where kernels is an FFI path, the kernel is switched on (candidates_kernel) and it takes x."""
  if kernels != "xla" and candidates_kernel():
    from jaxllm.kernels import ffi
    if ffi.top_candidates_supported(x.shape[-1], k):
      return ffi.top_candidates(x, k)
  return (*top_candidates(x, k), jax.nn.logsumexp(x, axis=-1))


def _order_key(x: jax.Array) -> jax.Array:
  """int32 keys [B, V] in the order of the f32 values x (-0.0 as +0.0): XLA sorts them much faster than floats
  (on the CPU a row of 49152 in 1.8 ms against 11)."""
  bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.int32)
  return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _from_key(key: jax.Array) -> jax.Array:
  """The f32 values of _order_key's keys."""
  return jax.lax.bitcast_convert_type(jnp.where(key < 0, key ^ 0x7FFFFFFF, key), jnp.float32)


def wide_keep(z: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
  """Which tokens top-k, then top-p on what it left, then min-p keep, over the whole vocabulary: [B, V] bool.

  z [B, V] f32 (finite, temperature applied); top_k [B] (0 or >= V: every token), top_p, min_p [B]. The same
  rule as the candidate path's, over all V ranks: the values sorted (descending; equal values rank the lower
  id first), the kept ranks are a prefix of n, and the kept tokens the n best: those above the n-th value,
  then as many of the tokens equal to it as the prefix holds, lower ids first.
  """
  v = z.shape[1]
  key = _order_key(z)                                                         # [B, V]
  desc = jnp.flip(jnp.sort(key, axis=-1), axis=-1)                           # [B, V] descending
  vals = _from_key(desc)
  rank = jnp.arange(v)[None, :]
  keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
  probs = jnp.where(keep, jnp.exp(vals - jax.nn.logsumexp(jnp.where(keep, vals, -jnp.inf), axis=-1,
                                                          keepdims=True)), 0.0)
  before = jnp.cumsum(probs, axis=-1) - probs                               # mass strictly above each
  keep &= (before < top_p[:, None]) | (top_p[:, None] >= 1)                 # 1 = off (f32 sums reach 1 early)
  keep &= probs >= min_p[:, None] * probs[:, :1]
  n = jnp.sum(keep, axis=-1)                                                 # [B] >= 1: rank 0 is always kept
  last = jnp.take_along_axis(desc, (n - 1)[:, None], axis=1)                 # [B, 1] the n-th best key
  above = key > last
  ties = key == last
  room = n[:, None] - jnp.sum(above, axis=-1, keepdims=True)                # ties the prefix holds
  return above | (ties & (jnp.cumsum(ties, axis=-1) <= room))


def sample(logits: jax.Array, sampler: Sampler, *, greedy_only: bool = False, penalties: bool = True,
           kernels: str = "xla") -> tuple[jax.Array, Sampler]:
  """Draws one token per row: logits [B, V] f32 -> (tokens [B] int32, sampler with advanced keys).

  greedy_only (static) compiles just the argmax, for batches where every row is greedy; the settings
  still come from `sampler` (penalties apply), so the result equals the full path's for such rows.
  penalties (static) False promises that no row has a penalty, and skips them.
  kernels: "xla" keeps every op in jnp; an FFI path may take the candidates from the GPU's kernel
  (candidates).
  sampler.wide_top_k (static) adds the wide step: rows whose top_k exceeds MAX_TOP_K are drawn among the
  tokens wide_keep keeps (with the full draw's noise); every other row draws as it would without it.
  sampler.mask, where the Sampler has one, sets the logits of the tokens it masks out to -inf first, so the
  argmax, the full draw, the candidates and the wide step all pass them by (a row has at least one allowed token).
  sampler.bias_ids / bias_values, where the Sampler has them, are added to the logits before that.
  """
  finite = jnp.all(jnp.isfinite(logits), axis=-1)
  if sampler.bias_ids is not None:   # unused pairs' ids lie past V: the scatter drops them
    rows = jnp.arange(logits.shape[0])[:, None]
    logits = logits.at[rows, sampler.bias_ids].add(sampler.bias_values, mode="drop")
  if sampler.mask is not None:
    logits = jnp.where(allowed_tokens(sampler.mask, logits.shape[-1]), logits, -jnp.inf)
  x = apply_penalties(logits, sampler) if penalties else logits
  greedy_tok = jnp.argmax(x, axis=-1).astype(jnp.int32)
  if greedy_only:
    return jnp.where(finite, greedy_tok, NONFINITE), sampler
  keys, k_full, k_cand = _split_keys(sampler.keys)
  t = sampler.temperature
  is_greedy = (t == 0) | (sampler.top_k == 1)
  z = x / jnp.where(t > 0, t, 1.0)[:, None]                                 # [B, V]
  # Exactly from the full softmax: Gumbel-max over all V.
  gumbel = jax.vmap(lambda k: jax.random.gumbel(k, z.shape[1:], jnp.float32))(k_full)
  full_tok = jnp.argmax(z + gumbel, axis=-1).astype(jnp.int32)
  # Among the candidates: top-k, then top-p on what top-k left, then min-p.
  vals, ids, lse = candidates(z, MAX_TOP_K, kernels)                        # [B, K] descending, [B]
  rank = jnp.arange(vals.shape[1])[None, :]
  top_k = sampler.top_k[:, None]
  keep = (top_k == 0) | (rank < top_k)
  denom = jnp.where(top_k > 0, jax.nn.logsumexp(jnp.where(keep, vals, -jnp.inf), axis=-1, keepdims=True),
                    lse[:, None])
  probs = jnp.where(keep, jnp.exp(vals - denom), 0.0)
  before = jnp.cumsum(probs, axis=-1) - probs                               # mass strictly above each
  keep &= (before < sampler.top_p[:, None]) | (sampler.top_p[:, None] >= 1)   # 1 = off (f32 sums reach 1 early)
  keep &= probs >= sampler.min_p[:, None] * probs[:, :1]
  g = jax.vmap(lambda k: jax.random.gumbel(k, vals.shape[1:], jnp.float32))(k_cand)
  pick = jnp.argmax(jnp.where(keep, vals + g, -jnp.inf), axis=-1)
  cand_tok = jnp.take_along_axis(ids, pick[:, None], axis=1)[:, 0]
  if sampler.wide_top_k:   # a row's full-draw noise is unused where it truncates: the wide draw takes it
    kept = wide_keep(z, sampler.top_k, sampler.top_p, sampler.min_p)
    wide_tok = jnp.argmax(jnp.where(kept, z + gumbel, -jnp.inf), axis=-1).astype(jnp.int32)
    cand_tok = jnp.where(sampler.top_k > MAX_TOP_K, wide_tok, cand_tok)
  truncated = (sampler.top_k > 0) | (sampler.top_p < 1) | (sampler.min_p > 0)
  tokens = jnp.where(is_greedy, greedy_tok, jnp.where(truncated, cand_tok, full_tok))
  return jnp.where(finite, tokens, NONFINITE), dataclasses.replace(sampler, keys=keys)
