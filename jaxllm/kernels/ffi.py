"""jaxllm's own kernels through the XLA FFI: registration and one thin binding per kernel.

The extension (`jaxllm._ffi`, built from ffi/ by the package build) exposes CPU handlers always and
CUDA handlers when it was built with a CUDA compiler. The CPU handlers are registered on a GPU machine too, so
that the bindings here reach them for arrays on the host's CPU device (the low-bit and Q6_K kernels exist only
there); which path a model takes still follows the default backend. Each binding validates its inputs up front,
declares its outputs with jax.ShapeDtypeStruct, passes attributes as numpy scalars and always calls its
kernel: no fallbacks here. When a kernel runs instead of its reference is decided in one place per op
(kernels/linear.py, kernels/attention.py, kernels/fused.py), from what the *_supported functions here say
the kernels are built for.

Under `jax.vmap`: the matmul folds a batched activation into M (one kernel call; weights must not be
batched, else it maps sequentially); attention maps sequentially.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.quant import Q6K, Linear, LowBit

ATTN_MAX_SPLITS = 256    # kMaxSplits in cuda_kernels.cu
ATTN_TARGET_BLOCKS = 512 # split blocks wanted across the GPU (one (sequence, kv head, split) each): about
                         # 4 per SM of the H200, as many as fit at once (128 threads, <= 128 registers)
CANDIDATE_BLOCK = 128    # kBlock in sampling_cuda.cu (jaxllm.sampling.CANDIDATE_BLOCK)
MAX_CANDIDATES = 128     # kMaxK there
MAX_CANDIDATE_BLOCKS = 8192   # kMaxBlocks there: V <= 1M
_DTYPES = (jnp.float32, jnp.bfloat16)


def _register_targets(targets: dict, platform: str) -> str | None:
  try:
    for name, capsule in targets.items():
      jax.ffi.register_ffi_target(name, capsule, platform=platform)
  except Exception as e:  # registration failures come as assorted XLA errors
    return f"registering the FFI targets failed ({e})"
  return None


def _extension():
  """(the built extension module, None), or (None, why it cannot be imported)."""
  try:
    from jaxllm import _ffi
  except ImportError as e:
    return None, f"the extension jaxllm._ffi is not built ({e})"
  return _ffi, None


@functools.lru_cache(maxsize=None)
def _register_cpu() -> str | None:
  """Registers the CPU handlers (whatever the default backend); returns why not, or None on success."""
  ext, why = _extension()
  return why if ext is None else _register_targets(ext.cpu_targets(), "cpu")


@functools.lru_cache(maxsize=None)
def _register() -> str | None:
  """Registers the handlers for the default backend (and the CPU's beside a GPU's); returns why the default
  backend's are not there, or None on success."""
  ext, why = _extension()
  if ext is None:
    return why
  backend = jax.default_backend()
  if backend == "cpu":
    return _register_cpu()
  _register_cpu()   # the CPU device beside the accelerator (cpu_unavailable_reason says whether that worked)
  if backend == "gpu" and jax.devices()[0].platform == "gpu" and ext.with_cuda:
    return _register_targets(ext.cuda_targets(), "CUDA")
  if backend == "gpu":
    return "the extension was built without a CUDA compiler"
  return f"no jaxllm kernels for the {backend!r} backend"


def unavailable_reason() -> str | None:
  """None when the FFI kernels are registered for the default backend, else why not."""
  return _register()


def cpu_unavailable_reason() -> str | None:
  """None when the CPU handlers are registered (for the CPU device, on any machine), else why not."""
  return _register_cpu()


def _ensure_registered(cpu_only: bool = False) -> None:
  """Raises unless the default backend's handlers (cpu_only: the CPU's) are registered."""
  reason = _register_cpu() if cpu_only else _register()
  if reason is not None:
    raise RuntimeError(f"jaxllm's FFI kernels are unavailable: {reason}")


def _check_dtype(name: str, x: jax.Array) -> None:
  if x.dtype not in _DTYPES:
    raise ValueError(f"{name} must be float32 or bfloat16, got {x.dtype}")


def _target(name: str, poison: jax.Array | None, n_args: int) -> tuple[str, dict]:
  """The FFI target to call: the "_into" test variant writes into `poison` (aliased to output 0)."""
  if poison is None:
    return name, {}
  return name + "_into", {"input_output_aliases": {n_args: 0}}


@functools.lru_cache(maxsize=None)
def _matmul_call(target: str, layer: int, attrs: tuple = ()):
  """An FFI matmul (x [M, K] and stacked weight arrays, each [L, N, ...] -> [M, N]) for one layer index and more
  attributes ((name, value), ...), batched under vmap by folding into M (an `mma` choice then -1, the rule);
  batched weights map sequentially."""

  @jax.custom_batching.custom_vmap
  def call(x, *w):
    out = jax.ShapeDtypeStruct((x.shape[0], w[0].shape[1]), x.dtype)
    return jax.ffi.ffi_call(target, out)(x, *w, layer=np.int64(layer), **dict(attrs))

  @call.def_vmap
  def _batched(axis_size, in_batched, x, *w):
    if any(in_batched[1:]):
      xs = x if in_batched[0] else jnp.broadcast_to(x, (axis_size, *x.shape))
      ws = [a if b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, b in zip(w, in_batched[1:])]
      return jax.lax.map(lambda a: call(*a), (xs, *ws)), True
    m, k = x.shape[-2:]
    # Rows folded into M: a configuration chosen for m rows may not suit axis_size * m, so the rule picks.
    fold = _matmul_call(target, layer, tuple((a, np.int64(-1)) if a == "mma" else (a, v) for a, v in attrs))
    return fold(x.reshape(axis_size * m, k), *w).reshape(axis_size, m, w[0].shape[1]), True

  return call


def _matmul(target: str, x: jax.Array, weights: tuple, layer: int, poison, attrs: tuple = ()) -> jax.Array:
  """x [..., K] through the FFI matmul `target` on the stacked weight arrays (each [L, N, ...]) -> [..., N];
  into `poison` (the test variant) when given. attrs: more attributes, as ((name, value), ...)."""
  k, n = x.shape[-1], weights[0].shape[1]
  lead = x.shape[:-1]
  m = int(np.prod(lead)) if lead else 1
  if poison is not None:
    name, kw = _target(target, poison, 1 + len(weights))
    y = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((m, n), x.dtype), **kw)(x.reshape(m, k), *weights, poison,
                                                                             layer=np.int64(layer), **dict(attrs))
  else:
    y = _matmul_call(target, int(layer), attrs)(x.reshape(m, k), *weights)
  return y.reshape(*lead, n)


def w8a16_matmul(x: jax.Array, lin: Linear, layer: int | None = None, *,
                 poison: jax.Array | None = None, mma: int | None = None) -> jax.Array:
  """x [..., K] @ dequantize(lin)[layer].T -> [..., N] with jaxllm's kernel, whatever M (linear.linear runs
  the reference past linear.max_m() rows, where XLA's dot is faster).

  mma: for 5-64 rows of bf16 x on the GPU, the tensor-core configuration (an index of ffi/w8a16_mma.cuh's
  kCandidates, below tuning_count(); -1 or None: its rule). linear() passes jaxllm.tuning's measured choice.
  `poison` (tests only): an [M, N] buffer the kernel writes into, to catch unwritten outputs.
  """
  _ensure_registered()
  if not lin.quantized:
    raise ValueError("w8a16_matmul needs int8 weights with scales (quant='w8a16')")
  _check_dtype("x", x)
  w, scale = lin.w, lin.scale
  if w.ndim == 2:
    w, scale, layer = w[None], scale[None], 0
  if w.ndim != 3 or w.dtype != jnp.int8 or scale.shape != (*w.shape[:2], scale.shape[-1]):
    raise ValueError(f"expected w [L, N, K] int8 and scale [L, N, G]; got w {w.shape} {w.dtype}, "
                     f"scale {scale.shape}")
  if layer is None or not 0 <= layer < w.shape[0]:
    raise ValueError(f"layer must index the {w.shape[0]} stacked weights, got {layer!r}")
  k = x.shape[-1]
  if k != w.shape[2]:
    raise ValueError(f"x has K={k} but the weight has K={w.shape[2]}")
  if k < 1 or w.shape[1] < 1 or k % scale.shape[-1] or (k // scale.shape[-1]) % 16:
    raise ValueError(f"expected K >= 1 and N >= 1 with K a multiple of the scale groups (each a multiple of "
                     f"16 inputs); got w {w.shape}, scale {scale.shape}")
  if mma is None:
    mma = -1
  elif isinstance(mma, bool) or not isinstance(mma, (int, np.integer)) or not -1 <= mma < tuning_count():
    raise ValueError(f"mma must be -1 (the rule) or a configuration index below {tuning_count()}, got {mma!r}")
  return _matmul("jaxllm_w8a16", x, (w, scale.astype(jnp.float32)), layer, poison, (("mma", np.int64(mma)),))


def tuning_count() -> int:
  """The tensor-core configurations the GPU's matmul can be given (0 in a build without CUDA)."""
  _ensure_registered()
  from jaxllm import _ffi
  return int(getattr(_ffi, "mma_candidates", 0))


def w8a16_tune(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
  """Microseconds a call of each tensor-core configuration (ffi/tune_cuda.cu; GPU only) on x [M, K] bf16 (5-64
  rows) and the weight copies w [C, N, K] int8, scale [C, N, K / 64] f32, the calls rotating over the copies;
  -> [tuning_count()] f32, +inf for the configurations of another row bucket than M's."""
  _ensure_registered()
  if jax.default_backend() != "gpu" or tuning_count() == 0:
    raise ValueError("w8a16_tune times the CUDA tensor-core kernel: it needs the GPU and a build with CUDA")
  if (x.ndim != 2 or x.dtype != jnp.bfloat16 or not 5 <= x.shape[0] <= 64 or x.shape[1] % 64 or w.ndim != 3
      or w.dtype != jnp.int8 or w.shape[2] != x.shape[1] or scale.dtype != jnp.float32
      or scale.shape != (*w.shape[:2], x.shape[1] // 64)):
    raise ValueError(f"expected x [M, K] bf16 with 5-64 rows and K a multiple of 64, w [C, N, K] int8 and scale "
                     f"[C, N, K / 64] f32; got x {x.shape} {x.dtype}, w {w.shape} {w.dtype}, "
                     f"scale {scale.shape} {scale.dtype}")
  m, n = x.shape[0], w.shape[1]
  out = (jax.ShapeDtypeStruct((m, n), jnp.bfloat16), jax.ShapeDtypeStruct((tuning_count(),), jnp.float32))
  return jax.ffi.ffi_call("jaxllm_w8a16_tune", out)(x, w, scale)[1]


def lowbit_supported() -> bool:
  """Whether the FFI takes LowBit weights on the default backend (the CPU handler; the GPU runs them
  through the reference: its fused kernels take W8A16)."""
  return jax.default_backend() == "cpu" and unavailable_reason() is None


def lowbit_matmul(x: jax.Array, lin: LowBit, layer: int | None = None, *,
                  poison: jax.Array | None = None) -> jax.Array:
  """x [..., K] @ lin.dequantize()[layer].T -> [..., N] with the CPU's low-bit kernel, whatever M (linear.linear
  runs the reference past linear.lowbit_max_m() rows).

  `poison` (tests only): an [M, N] buffer the kernel writes into, to catch unwritten outputs.
  """
  _ensure_registered(cpu_only=True)
  _check_dtype("x", x)
  arrays = (lin.q, lin.high, lin.scale, lin.min)
  if lin.q.ndim == 2:
    arrays, layer = tuple(a[None] for a in arrays), 0
  q = arrays[0]
  if layer is None or not 0 <= layer < q.shape[0]:
    raise ValueError(f"layer must index the {q.shape[0]} stacked weights, got {layer!r}")
  k = x.shape[-1]
  if k != 2 * q.shape[2]:
    raise ValueError(f"x has K={k} but the weight has K={2 * q.shape[2]}")
  return _matmul("jaxllm_lowbit", x, arrays, layer, poison)


def q6k_matmul(x: jax.Array, lin: Q6K, layer: int | None = None, *, poison: jax.Array | None = None) -> jax.Array:
  """x [..., K] @ lin.dequantize()[layer].T -> [..., N] with the CPU's Q6_K kernel, whatever M (linear.linear
  runs the reference past linear.lowbit_max_m() rows). `poison` (tests only): an [M, N] buffer the kernel
  writes into."""
  _ensure_registered(cpu_only=True)
  _check_dtype("x", x)
  arrays = (lin.ql, lin.qh, lin.sc, lin.d)
  if lin.ql.ndim == 2:
    arrays, layer = tuple(a[None] for a in arrays), 0
  if layer is None or not 0 <= layer < arrays[0].shape[0]:
    raise ValueError(f"layer must index the {arrays[0].shape[0]} stacked weights, got {layer!r}")
  k = x.shape[-1]
  if k != 2 * arrays[0].shape[2]:
    raise ValueError(f"x has K={k} but the weight has K={2 * arrays[0].shape[2]}")
  return _matmul("jaxllm_q6k", x, arrays, layer, poison)


def _check_caches(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, q_layout: str, *,
                  more_rows: bool = False) -> tuple[int, ...]:
  """(L, B, G, S, Dh) of caches [L, N, G, S, Dh] that queries laid out as q_layout ("[B, H, Dh]" or
  "[B, T, H, Dh]": batch first, heads and head dim last) fit, B the queries' rows: N == B, or N >= B where
  more_rows (a kernel that reads rows [0, B) of a larger cache); ValueError naming both shapes otherwise."""
  if q.ndim != q_layout.count(",") + 1 or k_cache.ndim != 5 or k_cache.shape != v_cache.shape:
    raise ValueError(f"expected q {q_layout} and caches [L, N, G, S, Dh]; got q {q.shape}, "
                     f"k {k_cache.shape}, v {v_cache.shape}")
  n_layers, n, g, s, dh = k_cache.shape
  b = q.shape[0]
  if n < b or (n != b and not more_rows):
    rows = "at least B" if more_rows else "B"
    raise ValueError(f"the caches [L, N, G, S, Dh] must hold {rows} = {b} rows (q's); got q {q.shape}, "
                     f"caches {k_cache.shape}")
  if q.shape[-1] != dh or q.shape[-2] % g:
    raise ValueError(f"q {q.shape} does not fit caches {k_cache.shape}")
  return n_layers, b, g, s, dh


CUDA_HEAD_DIMS = (64, 128)   # head dims the CUDA attention kernel is built for
CUDA_MAX_GROUP = 16          # query heads per kv head one CUDA block takes (kMaxGroup in cuda_kernels.cu)


def attention_supported(head_dim: int, n_heads: int, n_kv_heads: int) -> bool:
  """Whether the FFI attention takes this geometry on the default backend (the CPU handler takes any)."""
  if jax.default_backend() != "gpu":
    return True
  return head_dim in CUDA_HEAD_DIMS and n_heads // n_kv_heads <= CUDA_MAX_GROUP


def attention_chunk(itemsize: int, head_dim: int) -> int:
  """Cache positions per chunk of the CUDA attention's split kernel (AttnGeometry::kChunk in
  cuda_kernels.cu): 4 warps, each a tile of 32 / (lanes per position) positions, a lane holding 128 bytes
  of a key row."""
  return 4 * 32 * (128 // itemsize) // head_dim


def attention_splits(b: int, g: int, s: int, itemsize: int, head_dim: int) -> int:
  """How many splits the CUDA attention cuts each sequence into: enough (sequence, kv head, split) blocks
  to fill the GPU, no more chunks than the cache has, at most ATTN_MAX_SPLITS (the workspace's dim 2)."""
  chunks = -(-s // attention_chunk(itemsize, head_dim))
  return max(1, min(chunks, ATTN_MAX_SPLITS, -(-ATTN_TARGET_BLOCKS // (b * g))))


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: int,
                     lengths: jax.Array, *, poison: jax.Array | None = None) -> jax.Array:
  """jaxllm's decode attention; see attention.decode_attention_reference for the contract. The caches
  [L, N, G, S, Dh] may hold more rows than q (N >= B): the kernel reads rows [0, B) in place.

  `poison` (tests only): a [B, H, Dh] buffer the kernel writes into, to catch unwritten outputs.
  """
  _ensure_registered()
  _check_dtype("q", q)
  n_layers, b, g, s, dh = _check_caches(q, k_cache, v_cache, "[B, H, Dh]", more_rows=True)
  _check_dtype("the cache", k_cache)
  if v_cache.dtype != k_cache.dtype:
    raise ValueError(f"k and v caches must share a dtype, got {k_cache.dtype}, {v_cache.dtype}")
  out_dtype = q.dtype
  if k_cache.dtype != q.dtype and jax.default_backend() != "cpu":   # the CUDA kernel reads q in the cache's dtype
    q = q.astype(k_cache.dtype)
  if lengths.shape != (b,):
    raise ValueError(f"lengths must be [B]={b}, got {lengths.shape}")
  if not 0 <= layer < n_layers:
    raise ValueError(f"layer must be in [0, {n_layers}), got {layer!r}")
  splits = attention_splits(b, g, s, k_cache.dtype.itemsize, dh)
  out_types = (jax.ShapeDtypeStruct(q.shape, q.dtype),
               jax.ShapeDtypeStruct((b, q.shape[1], splits, dh + 2), jnp.float32))
  name, kw = _target("jaxllm_decode_attention", poison, 4)
  args = (q, k_cache, v_cache, lengths.astype(jnp.int32)) + ((poison,) if poison is not None else ())
  out, _ = jax.ffi.ffi_call(name, out_types, vmap_method="sequential", **kw)(*args, layer=np.int64(layer))
  return out.astype(out_dtype)


PREFILL_HEAD_DIMS = (64, 128)   # head dims the CUDA flash prefill kernel is built for


def prefill_attention_supported(head_dim: int, n_heads: int, n_kv_heads: int, dtype) -> bool:
  """Whether the CUDA flash prefill attention takes this geometry (GPU, built, bf16, Dh 64 or 128).

  The CPU has no FFI prefill kernel: it runs the blocked jnp form (attention.prefill_attention_blocked)."""
  if jax.default_backend() != "gpu" or unavailable_reason() is not None:
    return False
  from jaxllm import _ffi
  return (_ffi.with_cuda and jnp.dtype(dtype) == jnp.bfloat16 and head_dim in PREFILL_HEAD_DIMS
          and n_heads % n_kv_heads == 0)


def prefill_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: int, start: jax.Array, *,
                      poison: jax.Array | None = None) -> jax.Array:
  """jaxllm's flash prefill attention (CUDA); see attention.prefill_attention_reference for the contract.

  q [B, T, H, Dh] bf16, caches [L, B, G, S, Dh] bf16, start [B] int32 -> [B, T, H, Dh].
  `poison` (tests only): a [B, T, H, Dh] buffer the kernel writes into, to catch unwritten outputs.
  """
  _ensure_registered()
  n_layers, b, g, s, dh = _check_caches(q, k_cache, v_cache, "[B, T, H, Dh]")
  if q.dtype != jnp.bfloat16 or k_cache.dtype != jnp.bfloat16 or v_cache.dtype != jnp.bfloat16:
    raise ValueError(f"the flash prefill kernel takes bf16 q and caches, got {q.dtype}, {k_cache.dtype}")
  if start.shape != (b,):
    raise ValueError(f"start must be [B]={b}, got {start.shape}")
  if not 0 <= layer < n_layers:
    raise ValueError(f"layer must be in [0, {n_layers}), got {layer!r}")
  name, kw = _target("jaxllm_prefill_attention", poison, 4)
  args = (q, k_cache, v_cache, start.astype(jnp.int32)) + ((poison,) if poison is not None else ())
  return jax.ffi.ffi_call(name, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential",
                          **kw)(*args, layer=np.int64(layer))


def _candidates_shape_ok(v: int, k: int) -> bool:
  """Whether the candidates kernel takes rows of v logits and k candidates (at least k blocks of V)."""
  return 1 <= k <= MAX_CANDIDATES and k <= -(-v // CANDIDATE_BLOCK) <= MAX_CANDIDATE_BLOCKS


def top_candidates_supported(v: int, k: int) -> bool:
  """Whether the CUDA candidates kernel takes rows of v logits and k candidates (on this backend)."""
  return jax.default_backend() == "gpu" and _candidates_shape_ok(v, k) and unavailable_reason() is None


def top_candidates(x: jax.Array, k: int, *,
                   poison: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The k largest values of each row of x [B, V] and their ids, descending, and each row's logsumexp:
  vals [B, k] f32, ids [B, k] int32, lse [B] f32.

  jaxllm.sampling.top_candidates' result (ties: the lower id first) from the CUDA kernel of
  ffi/sampling_cuda.cu (block maxima and sums, then radix selects in shared memory) instead of XLA's sorts;
  the logsumexp from the same pass over x (NaN where a row holds NaN or inf, -inf where all of it is -inf).
  `poison` (tests only): a [B, k] f32 buffer the kernel writes vals into, to catch unwritten outputs.
  """
  _ensure_registered()
  if x.ndim != 2:
    raise ValueError(f"x must be [B, V], got {x.shape}")
  b, v = x.shape
  n = -(-v // CANDIDATE_BLOCK)
  if not _candidates_shape_ok(v, k):
    raise ValueError(f"top_candidates: k must be in [1, {MAX_CANDIDATES}] and V / {CANDIDATE_BLOCK} in [k, "
                     f"{MAX_CANDIDATE_BLOCKS}], got k={k}, V={v}")
  outs = (jax.ShapeDtypeStruct((b, k), jnp.float32), jax.ShapeDtypeStruct((b, k), jnp.int32),
          jax.ShapeDtypeStruct((b,), jnp.float32), jax.ShapeDtypeStruct((b, 3 * n), jnp.uint32))
  name, alias = _target("jaxllm_top_candidates", poison, 1)
  args = (x.astype(jnp.float32),) if poison is None else (x.astype(jnp.float32), poison)
  vals, ids, lse, _ = jax.ffi.ffi_call(name, outs, vmap_method="sequential", **alias)(*args)
  return vals, ids, lse
