"""Each FFI kernel against its pure-jnp reference on fresh random inputs, with poisoned outputs.

Runs on whatever backend JAX has: the CPU handlers in CI, the CUDA handlers on a GPU.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import decode_attention_reference, ffi, linear, linear_reference, prefill_attention_reference
from jaxllm.kernels.linear import max_m
from jaxllm.quant import Linear, quantize_int8

pytestmark = pytest.mark.skipif(ffi.unavailable_reason() is not None,
                                reason=f"FFI kernels unavailable: {ffi.unavailable_reason()}")


@pytest.fixture(autouse=True)
def _exact_reference():
  """XLA's GPU dots default to TF32 for f32 inputs; the references must be full f32."""
  with jax.default_matmul_precision("highest"):
    yield
ON_GPU = jax.default_backend() == "gpu"
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}

# (K, N): Qwen2.5-0.5B (qkv, o, gate+up, down), SmolLM2-135M (qkv, gate+up, down), odd sizes (4099: many
# rows shared unevenly between the GPU's blocks).
MATMUL_SHAPES = [(896, 1152), (896, 896), (896, 9728), (4864, 896), (576, 960), (576, 3072), (1536, 576),
                 (64, 1), (64, 7), (128, 33), (192, 1000), (320, 257), (896, 4099)]


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


def _attention_error(got, ref, dtype) -> float:
  """How far got is from ref in units of what the output's rounding explains (<= 1 passes).

  The kernels compute in f32 from the same inputs the f32 reference reads; a bf16 output then carries at
  most half a bf16 ulp (2^-9 relative) per element, so bf16 is allowed 2^-8 |ref| per element plus 1e-5 of
  the largest; f32 (whose accumulation order differs) 4e-5 of the largest.
  """
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  big = np.max(np.abs(ref))
  allowed = 2.0 ** -8 * np.abs(ref) + 1e-5 * big if dtype == jnp.bfloat16 else 4e-5 * big + 0 * ref
  return float(np.max(np.abs(got - ref) / allowed))


def _quantized(rng, layers, n, k):
  q, s = quantize_int8(rng.standard_normal((layers, n, k)).astype(np.float32))
  return Linear(w=jax.device_put(q), scale=jax.device_put(s))


def _poison(shape, dtype) -> jax.Array:
  """A NaN-filled device buffer for a kernel to write into, made on the host and put on the device as it is (an
  eager jnp.full, or jnp.asarray of a numpy array on jax 0.10-0.11, compiles a program for every new shape)."""
  return jax.device_put(np.full(shape, np.nan, np.dtype(dtype)))


def _on_leading_rows(lin, xs, ms, dtype, layer=1):
  """The kernel on the first m rows of xs for each m in ms, in one compiled program (one compile per shape, not
  per M), each output poisoned with NaN before the kernel writes it; as float32 numpy arrays."""
  n = lin.w.shape[-2]
  call = jax.jit(lambda xs, lin, poisons: [ffi.w8a16_matmul(xs[:m], lin, layer, poison=p)
                                           for m, p in zip(ms, poisons)])
  return [np.asarray(y, np.float32) for y in call(xs, lin, [_poison((m, n), dtype) for m in ms])]


def _float64_reference(x, lin, layer) -> np.ndarray:
  """x [M, K] @ dequantize(lin)[layer].T in float64 numpy on the host, the kernel's independent expectation. No
  compile: on the GPU an XLA f32 dot at HIGHEST precision is one more program a shape to compile (and tune)
  beside fifteen other test processes; on an H100 run of 2026-12-05 the W8A16 cases still took 24-47 s each
  with their operands and references jitted."""
  w, s = np.asarray(lin.w), np.asarray(lin.scale, np.float64)
  if layer is not None:
    w, s = w[layer], s[layer]
  dense = w.astype(np.float64, order="C")                                   # [N, K], scaled in place
  dense.reshape(*s.shape, -1)[...] *= s[..., None]
  return np.asarray(np.asarray(x, np.float32), np.float64) @ dense.T


@pytest.mark.parametrize("k, n", MATMUL_SHAPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_w8a16_matches_reference(k, n, dtype):
  rng = np.random.default_rng(k * 7919 + n)
  lin = _quantized(rng, 2, n, k)
  # The CUDA dispatch: M = 1, 2, tiles of 4 (full and partial); bf16 from 5 rows the tensor-core kernel (its
  # configurations up to 8, 16, 32 and 64 rows, tiles of 8 rows of x full and partial; 70: a second column
  # of blocks).
  ms = (1, 2, 3, 4, 6, 16) + ((9, 20, 33, 64, 70) if ON_GPU else ())
  xs = jax.device_put(rng.standard_normal((max(ms), k)).astype(np.dtype(dtype)))
  ref = _float64_reference(xs, lin, 1)   # rows apart: row i is ref[i] for every M
  for m, got in zip(ms, _on_leading_rows(lin, xs, ms, dtype)):
    assert not np.isnan(got).any(), f"unwritten outputs at M={m}"
    assert _rel(got, ref[:m]) < TOL[dtype], (m, _rel(got, ref[:m]))


@pytest.mark.parametrize("group", [16, 32, 128])
def test_w8a16_other_group_sizes(group):
  """Scales per 16/32/128 inputs (jaxllm itself writes 64) take the handlers' general path."""
  rng = np.random.default_rng(group)
  q, s = quantize_int8(rng.standard_normal((2, 100, 256)).astype(np.float32), group=group)
  lin = Linear(w=jnp.asarray(q), scale=jnp.asarray(s))
  for m in (1, 4):
    x = jnp.asarray(rng.standard_normal((m, 256)), jnp.float32)
    got = ffi.w8a16_matmul(x, lin, 1, poison=jnp.full((m, 100), jnp.nan, jnp.float32))
    assert _rel(got, linear_reference(x, lin, 1)) < TOL[jnp.float32]


def _preset_matmul_shapes():
  """(K, N) of every matmul of every preset not in MATMUL_SHAPES (q/k/v, O, gate+up, down, the LM head), and a
  gate at K 2048 (many rows, short K)."""
  from jaxllm.presets import PRESETS
  shapes = set()
  for c in PRESETS.values():
    shapes |= {(c.d_model, c.q_dim + 2 * c.kv_dim), (c.q_dim, c.d_model), (c.d_model, 2 * c.d_ff),
               (c.d_ff, c.d_model), (c.d_model, c.vocab_size)}
  return sorted((shapes | {(2048, 8192)}) - set(MATMUL_SHAPES))


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _preset_operands(key, cols, k, n, head):
  """One preset shape's operands, made in one compiled program: the weight (an LM head one [N, K] matrix; else
  two stacked layers, layer 0's weights zeros and its scales other than layer 1's, so a kernel reading the wrong
  layer's weights or scales gives a wrong result), the columns `cols` of the layer the kernel reads (sub, for the
  reference), and x for bf16 (64 rows) and f32 (1 row)."""
  from jaxllm.weights import _randint
  kw, ks, kx = jax.random.split(key, 3)
  w = _randint(kw, (n, k), -127, 128, jnp.int8)
  scale = jax.random.uniform(ks, (1 if head else 2, n, k // 64), jnp.float32, 1e-3, 1e-2)   # each layer its own
  sub = Linear(w=w[cols], scale=scale[-1][cols])
  lin = Linear(w=w, scale=scale[0]) if head else Linear(w=jnp.stack([jnp.zeros_like(w), w]), scale=scale)
  xs = (jax.random.normal(kx, (64, k), jnp.float32).astype(jnp.bfloat16), jax.random.normal(kx, (1, k), jnp.float32))
  return lin, sub, xs


@pytest.mark.skipif(not ON_GPU, reason="the CUDA dispatch's shapes (the CPU's kernel has one configuration)")
@pytest.mark.parametrize("k, n", _preset_matmul_shapes())
def test_w8a16_matches_reference_at_preset_shapes(k, n):
  """The configurations the CUDA dispatch picks for the 1B-14B presets' shapes (a 14B LM head is 780M weights).
  Memory: sixteen test processes share a card, so the weights are drawn in row blocks (weights._randint: JAX's
  threefry draws 32 bits an element, 4.6 GB for an 8B LM head's two layers drawn whole, and an H100 run of
  2026-12-05 ran out of memory there), and an LM head is one [N, K] matrix, as in a model (two layers of a 14B
  head ran out of an H100 test process's 4.5 GB). The float64 reference (numpy) covers the first and last 256
  columns (the edge tiles) and every s-th between them (s odd, ~N / 2048: a column in every block of s, at every
  offset mod a power of two), not a 6 GB float copy. Every output is checked written. Time: made eagerly, the
  operands and an f32 reference compiled some 40 programs a shape, and the 44 shapes took 1,485 s of an H100
  run's processes; here the operands are one program (_preset_operands), the kernels one a dtype."""
  from jaxllm.presets import PRESETS
  head = (k, n) in {(c.d_model, c.vocab_size) for c in PRESETS.values()}
  step = n // 2048 | 1
  edges = np.concatenate([np.arange(min(n, 256)), np.arange(max(0, n - 256), n)])
  cols = np.unique(np.concatenate([edges, np.arange(k % step, n, step)]))
  lin, sub, xs = _preset_operands(jax.random.PRNGKey(k * 7919 + n), cols, k, n, head)
  # Both x's rows through one float64 reference (its dense weight made once): rows apart, every M's rows are ref's.
  refs = np.split(_float64_reference(np.concatenate([np.asarray(x, np.float32) for x in xs]), sub, None), [64])
  for dtype, ms, x, ref in zip((jnp.bfloat16, jnp.float32), ((1, 2, 4, 8, 16, 32, 64), (1,)), xs, refs):
    for m, got in zip(ms, _on_leading_rows(lin, x, ms, dtype, None if head else 1)):   # GEMV kernels to
      assert not np.isnan(got).any(), f"unwritten outputs at M={m}"                          # M 4, then tensor cores
      assert _rel(got[:, cols], ref[:m]) < TOL[dtype], (dtype, m, _rel(got[:, cols], ref[:m]))


def test_w8a16_unstacked_and_leading_dims():
  rng = np.random.default_rng(1)
  lin = _quantized(rng, 1, 96, 128)
  flat = Linear(w=lin.w[0], scale=lin.scale[0])
  x = jnp.asarray(rng.standard_normal((2, 3, 128)), jnp.float32)
  got = ffi.w8a16_matmul(x, flat)
  assert got.shape == (2, 3, 96) and _rel(got, linear_reference(x, flat)) < 2e-5


def test_w8a16_large_m_falls_back_to_xla():
  """linear() hands more than max_m() rows to XLA's dot; the binding itself always calls its kernel."""
  rng = np.random.default_rng(2)
  lin = _quantized(rng, 1, 64, 128)
  x = jnp.asarray(rng.standard_normal((max_m() + 1, 128)), jnp.float32)
  text = jax.jit(lambda x: linear(x, lin, 0, kernels="ffi")).lower(x).as_text()
  assert "jaxllm_w8a16" not in text
  assert _rel(linear(x, lin, 0, kernels="ffi"), linear_reference(x, lin, 0)) < 2e-5
  assert "jaxllm_w8a16" in jax.jit(lambda x: linear(x[:max_m()], lin, 0, kernels="ffi")).lower(x).as_text()
  assert "jaxllm_w8a16" in jax.jit(lambda x: ffi.w8a16_matmul(x, lin, 0)).lower(x).as_text()


def test_w8a16_under_vmap_folds_into_m():
  rng = np.random.default_rng(3)
  lin = _quantized(rng, 3, 200, 192)
  xs = jnp.asarray(rng.standard_normal((2, 2, 192)), jnp.float32)   # M = 4 <= linear.max_m() everywhere
  fn = jax.vmap(lambda x: ffi.w8a16_matmul(x, lin, 2))
  assert _rel(fn(xs), jax.vmap(lambda x: linear_reference(x, lin, 2))(xs)) < 2e-5
  assert jax.jit(fn).lower(xs).as_text().count("jaxllm_w8a16") == 1   # one call for the whole batch


def test_w8a16_rejects_bad_input():
  rng = np.random.default_rng(4)
  lin = _quantized(rng, 2, 32, 128)
  with pytest.raises(ValueError, match="x has K=64 but the weight has K=128"):
    ffi.w8a16_matmul(jnp.ones((1, 64)), lin, 0)
  with pytest.raises(ValueError, match="layer must index the 2 stacked weights, got 5"):
    ffi.w8a16_matmul(jnp.ones((1, 128)), lin, 5)
  with pytest.raises(ValueError, match="x must be float32 or bfloat16, got int32"):
    ffi.w8a16_matmul(jnp.ones((1, 128), jnp.int32), lin, 0)
  with pytest.raises(ValueError, match="needs int8 weights"):
    ffi.w8a16_matmul(jnp.ones((1, 128)), Linear(w=jnp.ones((32, 128))), 0)
  empty = Linear(w=jnp.zeros((1, 32, 0), jnp.int8), scale=jnp.ones((1, 32, 1), jnp.float32))
  with pytest.raises(ValueError, match="expected K >= 1"):
    ffi.w8a16_matmul(jnp.ones((1, 0)), empty, 0)


# (B, H, G, S, Dh): Qwen2.5-0.5B, SmolLM2, Qwen3-0.6B / Llama-3.2-1B-like, odd sizes.
ATTN_SHAPES = [(1, 14, 2, 4096, 64), (2, 9, 3, 300, 64), (3, 16, 8, 513, 128), (1, 32, 8, 1024, 128),
               (4, 4, 4, 17, 64), (1, 16, 1, 2000, 128)]
if ON_GPU:   # a long context: each CUDA split walks several chunks
  ATTN_SHAPES += [(1, 14, 2, 32768, 64)]


def _attention_float64(q, k_cache, v_cache, layer: int, start) -> np.ndarray:
  """prefill_attention_reference's contract in float64 numpy on the host (no compile: see _float64_reference):
  q [B, T, H, Dh]; caches [L, B, G, S, Dh]; start [B] -> [B, T, H, Dh], query t of row b seeing the keys up to
  start[b] + t (clipped to the cache)."""
  f64 = lambda a: np.asarray(np.asarray(a, np.float32), np.float64)
  q, k, v, start = f64(q), f64(k_cache[layer]), f64(v_cache[layer]), np.asarray(start)
  b, t, h, dh = q.shape
  g, s = k.shape[1], k.shape[2]
  qg = q.reshape(b, t, g, h // g, dh).transpose(0, 2, 3, 1, 4)                 # [B, G, R, T, Dh]
  scores = qg @ k[:, :, None].swapaxes(-1, -2) * dh ** -0.5                     # [B, G, R, T, S]
  last = np.clip(start[:, None] + np.arange(t)[None, :], 0, s - 1)            # [B, T]
  scores = np.where((np.arange(s) <= last[:, :, None])[:, None, None], scores, -np.inf)
  p = np.exp(scores - scores.max(axis=-1, keepdims=True))
  out = (p / p.sum(axis=-1, keepdims=True)) @ v[:, :, None]                    # [B, G, R, T, Dh]
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh)


def test_the_jnp_references_equal_the_float64_ones():
  """linear_reference and prefill_attention_reference (the XLA path's definitions) against the float64 numpy
  references the kernel tests compare with, in f32 at HIGHEST precision: one definition for both."""
  rng = np.random.default_rng(11)
  lin = _quantized(rng, 2, 96, 192)
  x = rng.standard_normal((5, 192)).astype(np.float32)
  np.testing.assert_allclose(np.asarray(linear_reference(jnp.asarray(x), lin, 1)), _float64_reference(x, lin, 1),
                             rtol=1e-5, atol=1e-5)
  q = rng.standard_normal((2, 7, 6, 64)).astype(np.float32)
  k, v = (rng.standard_normal((2, 2, 3, 40, 64)).astype(np.float32) for _ in range(2))
  st = np.asarray([0, 36], np.int32)   # 36 + 6 > 39: the last queries of row 1 see the whole (clipped) cache
  got = prefill_attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), 1, jnp.asarray(st))
  np.testing.assert_allclose(np.asarray(got), _attention_float64(q, k, v, 1, st), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("b, h, g, s, d", ATTN_SHAPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_attention_matches_reference(b, h, g, s, d, dtype):
  rng = np.random.default_rng(b * 1000 + s)
  layers = 2
  k = rng.standard_normal((layers, b, g, s, d)).astype(np.dtype(dtype))
  v = rng.standard_normal((layers, b, g, s, d)).astype(np.dtype(dtype))
  call = jax.jit(lambda q, k, v, n, p: ffi.decode_attention(q, k, v, 1, n, poison=p))
  reference = lambda q, n: _attention_float64(q[:, None], k, v, 1, np.clip(n, 1, s) - 1)[:, 0]
  kd, vd = jax.device_put(k), jax.device_put(v)
  # 1, full, random, and around the CUDA kernel's tiles (32 positions) and chunks (128 for bf16, Dh 64).
  for lens in ([1] * b, [s] * b, list(rng.integers(1, s + 1, b)), [min(s, 33)] * b, [min(s, 256)] * b,
               [min(s, 257)] * b):
    q = rng.standard_normal((b, h, d)).astype(np.dtype(dtype))
    n = np.asarray(lens, np.int32)
    got = call(q, kd, vd, n, _poison((b, h, d), dtype))
    ref = reference(q, n)
    assert not np.isnan(np.asarray(got, np.float32)).any(), f"unwritten outputs for lengths {lens}"
    assert _attention_error(got, ref, dtype) <= 1, (lens, _attention_error(got, ref, dtype))
    if min(lens) >= 1024:   # the bound is tight enough to catch a kernel that drops the last visible key
      short = reference(q, n - 1).astype(np.dtype(dtype))
      assert _attention_error(short, ref, dtype) > 1, (lens, _attention_error(short, ref, dtype))


def test_decode_attention_ignores_stale_cache():
  """Positions past the visible length must not matter: fill them with huge values."""
  rng = np.random.default_rng(5)
  k = rng.standard_normal((1, 2, 2, 600, 64)).astype(np.float32)
  v = rng.standard_normal((1, 2, 2, 600, 64)).astype(np.float32)
  lens = jnp.asarray([100, 300], jnp.int32)
  q = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.float32)
  clean = ffi.decode_attention(q, jnp.asarray(k), jnp.asarray(v), 0, lens)
  k[0, 0, :, 100:] = 1e4
  v[0, 1, :, 300:] = -1e4
  dirty = ffi.decode_attention(q, jnp.asarray(k), jnp.asarray(v), 0, lens)
  np.testing.assert_array_equal(np.asarray(clean), np.asarray(dirty))


def test_decode_attention_clips_lengths_to_the_cache():
  """Lengths outside [1, S] are clipped (the contract of every path): 0 sees one key, S + 5 sees S."""
  rng = np.random.default_rng(6)
  k = jnp.asarray(rng.standard_normal((1, 2, 2, 40, 64)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((1, 2, 2, 40, 64)), jnp.float32)
  q = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.float32)
  got = ffi.decode_attention(q, k, v, 0, jnp.asarray([0, 45], jnp.int32))
  want = decode_attention_reference(q, k, v, 0, jnp.asarray([1, 40], jnp.int32))
  assert _attention_error(got, want, jnp.float32) <= 1


def test_decode_attention_rejects_bad_input():
  q = jnp.ones((2, 6, 64))
  cache = jnp.ones((1, 2, 4, 32, 64))
  with pytest.raises(ValueError, match="does not fit caches"):
    ffi.decode_attention(q, cache, cache, 0, jnp.ones((2,), jnp.int32))
  with pytest.raises(ValueError, match="layer must be in"):
    ffi.decode_attention(jnp.ones((2, 8, 64)), cache, cache, 3, jnp.ones((2,), jnp.int32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_attention_reads_the_first_rows_of_larger_caches(dtype):
  """Caches of N = 5 rows for q of B = 3 (a server's decode call on 3 of its 5 slots): the kernel reads rows
  [0, B) in place, the same bits as on the caches cut to those rows, at lengths over several chunks and splits;
  the reference the same."""
  rng = np.random.default_rng(21)
  b, n, h, g, s, d = 3, 5, 8, 2, 700, 64
  k, v = (jnp.asarray(rng.standard_normal((2, n, g, s, d)), dtype) for _ in range(2))
  q = jnp.asarray(rng.standard_normal((b, h, d)), dtype)
  lens = jnp.asarray([700, 1, 259], jnp.int32)
  call = jax.jit(lambda q, k, v: ffi.decode_attention(q, k, v, 1, lens))
  whole, cut = call(q, k, v), call(q, k[:, :b], v[:, :b])
  np.testing.assert_array_equal(np.asarray(whole, np.float32), np.asarray(cut, np.float32))
  ref = decode_attention_reference(q, k, v, 1, lens)
  np.testing.assert_array_equal(np.asarray(ref, np.float32),
                                np.asarray(decode_attention_reference(q, k[:, :b], v[:, :b], 1, lens), np.float32))
  assert _attention_error(whole, _attention_float64(q[:, None], k[:, :b], v[:, :b], 1, np.asarray(lens) - 1)[:, 0],
                          dtype) <= 1


def test_caches_of_fewer_rows_than_q_are_refused():
  """Caches of N = 2 rows for q of B = 3: the binding says so, and so does the handler's own check (the binding
  bypassed); the flash prefill kernel takes caches of exactly B rows."""
  q = jnp.ones((3, 8, 64))
  cache = jnp.ones((1, 2, 2, 32, 64))
  lens = jnp.ones((3,), jnp.int32)
  with pytest.raises(ValueError, match=r"must hold at least B = 3 rows \(q's\); got q \(3, 8, 64\), caches "
                                       r"\(1, 2, 2, 32, 64\)"):
    ffi.decode_attention(q, cache, cache, 0, lens)
  outs = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((3, 8, 1, 66), jnp.float32))
  raw = jax.ffi.ffi_call("jaxllm_decode_attention", outs)
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"the caches \[L, N, G, S, Dh\] need at least the B = 3 "
                                                       r"rows of q \(N >= B\); got q \[3, 8, 64\], caches "
                                                       r"\[1, 2, 2, 32, 64\]"):
    jax.block_until_ready(raw(q, cache, cache, lens, layer=np.int64(0)))
  bf = jnp.ones((2, 4, 8, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"must hold B = 2 rows"):
    ffi.prefill_attention(bf, jnp.ones((1, 3, 2, 32, 64), jnp.bfloat16), jnp.ones((1, 3, 2, 32, 64), jnp.bfloat16),
                          0, jnp.zeros((2,), jnp.int32))


@pytest.mark.parametrize("b, g, s, itemsize, d", [(1, 2, 4096, 2, 64), (1, 2, 32768, 2, 64), (64, 2, 4096, 2, 64),
                                                    (3, 8, 513, 4, 128), (1, 1, 17, 2, 128), (16, 8, 100000, 2, 128)])
def test_attention_splits_fill_the_gpu_within_the_cache(b, g, s, itemsize, d):
  """Splits: at least one, at most the kernel's limit and the cache's chunks, and enough blocks to fill the
  GPU whenever the cache has the chunks for it."""
  p = ffi.attention_splits(b, g, s, itemsize, d)
  chunks = -(-s // ffi.attention_chunk(itemsize, d))
  assert 1 <= p <= min(ffi.ATTN_MAX_SPLITS, chunks)
  assert b * g * p >= min(ffi.ATTN_TARGET_BLOCKS, b * g * min(chunks, ffi.ATTN_MAX_SPLITS))


def test_attention_supported_on_gpu_geometries(monkeypatch):
  """The CUDA attention takes head dims 64/128 and up to 16 query heads per kv head; others run the reference."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert ffi.attention_supported(64, 14, 2) and ffi.attention_supported(128, 16, 1)
  assert not ffi.attention_supported(32, 8, 2)
  assert not ffi.attention_supported(128, 32, 1)
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  assert ffi.attention_supported(32, 32, 1)


# (B, T, H, G, S, Dh, starts): Qwen2.5-0.5B and Qwen3/Llama geometries, chunks after a prefix, odd sizes.
PREFILL_SHAPES = [(1, 256, 14, 2, 1024, 64, [0]), (1, 100, 14, 2, 1000, 64, [700]), (2, 77, 16, 8, 600, 128, [0, 333]),
                  (1, 64, 32, 8, 256, 128, [64]), (3, 33, 9, 3, 200, 64, [0, 17, 150]), (1, 1, 4, 4, 70, 64, [69]),
                  (1, 300, 4, 1, 300, 128, [0])]


@pytest.mark.gpu
@pytest.mark.parametrize("b, t, h, g, s, d, starts", PREFILL_SHAPES)
def test_flash_prefill_attention_matches_reference(b, t, h, g, s, d, starts):
  """The CUDA flash prefill kernel (bf16) against the float64 masked-softmax reference, poisoned output; the
  cache past the chunk's last position is filled with huge values that must not reach the result."""
  rng = np.random.default_rng(t * 31 + s)
  k = rng.standard_normal((2, b, g, s, d)).astype(np.float32)
  v = rng.standard_normal((2, b, g, s, d)).astype(np.float32)
  for r, st in enumerate(starts):
    k[1, r, :, st + t:] = 3e4
    v[1, r, :, st + t:] = -3e4
  bf16 = np.dtype(jnp.bfloat16)
  k, v, q = k.astype(bf16), v.astype(bf16), rng.standard_normal((b, t, h, d)).astype(bf16)
  st = np.asarray(starts, np.int32)
  call = jax.jit(lambda q, k, v, st, p: ffi.prefill_attention(q, k, v, 1, st, poison=p))
  got = call(q, k, v, st, _poison((b, t, h, d), jnp.bfloat16))
  ref = _attention_float64(q, k, v, 1, st)
  assert not np.isnan(np.asarray(got, np.float32)).any(), "unwritten outputs"
  # P is rounded to bf16 before it meets v (as in FlashAttention): allow 2^-7 relative beyond the output's own.
  err = np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64))
  allowed = 2.0 ** -7 * np.abs(np.asarray(ref, np.float64)) + 4e-3 * np.max(np.abs(np.asarray(ref)))
  assert np.max(err / allowed) <= 1, float(np.max(err / allowed))
