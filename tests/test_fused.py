"""The fused decode-step kernels (jaxllm/kernels/fused.py) against numpy float64, with poisoned outputs.

Each expectation is computed here in float64 from the op's definition, rounding where the op's contract
rounds (the normalized activations and the matmul outputs to the activation dtype), never through jaxllm's
own code. Runs on the CPU handlers in CI and the CUDA handlers on a GPU (bf16 only: the CUDA fused kernels
are built for bf16 activations).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agree import same_or_near_tie
from jaxllm.kernels import ffi, fused
from jaxllm.quant import Linear, quantize_int8

pytestmark = pytest.mark.skipif(ffi.unavailable_reason() is not None,
                                reason=f"FFI kernels unavailable: {ffi.unavailable_reason()}")
ON_GPU = jax.default_backend() == "gpu"
DTYPES = [jnp.bfloat16] if ON_GPU else [jnp.float32, jnp.bfloat16]
MS = (1, 2, 3, 4) if ON_GPU else (1, 3, 5)
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
EPS = 1e-6


@pytest.fixture(autouse=True)
def _exact(lab_switches):
  # The CPU runs the fused step only when asked (a lab switch; the tests' monkeypatch sets the others too).
  lab_switches.setenv("JAXLLM_FUSED_CPU", "1")
  with jax.default_matmul_precision("highest"):
    yield


def _round(a, dtype) -> np.ndarray:
  """float64 values rounded to dtype, as float64."""
  return np.asarray(np.asarray(a, np.float32).astype(dtype), np.float64)


def _quantized(rng, layers, n, k):
  """Random int8 weights and group-of-64 scales of the size quantize_int8 gives unit normals (drawn directly: at
  the 7B-14B shapes quantizing a float matrix took most of a test's time)."""
  q = rng.integers(-127, 128, (layers, n, k), dtype=np.int8)
  s = rng.uniform(0.01, 0.03, (layers, n, k // 64)).astype(np.float32)
  return Linear(w=jnp.asarray(q), scale=jnp.asarray(s))


def _dequant(lin: Linear, layer: int) -> np.ndarray:
  w = np.asarray(lin.w[layer], np.float64)
  s = np.asarray(lin.scale[layer], np.float64)
  return w * np.repeat(s, w.shape[1] // s.shape[1], axis=1)        # [N, K]


def _norm64(x, w, dtype) -> np.ndarray:
  x = np.asarray(x, np.float64)
  h = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * np.asarray(w, np.float64)
  return _round(h, dtype)


def _rel(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))


def _residual_stream(rng, m, k):
  """Rows like a residual stream: large (RMS ~ 3) with a few outliers."""
  x = 3.0 * rng.standard_normal((m, k))
  x[:, rng.integers(0, k, 3)] *= 20
  return jnp.asarray(x, jnp.float32)


# (K, N): Qwen2.5-0.5B qkv, gate+up, SmolLM2-135M qkv, odd sizes; widths whose RMS takes the GPU block more than
# one batch of loads a thread (w8a16::NormRows: K = 2048 at M >= 3, K = 4608 at every M).
NORM_SHAPES = [(896, 1152), (896, 9728), (576, 960), (64, 7), (320, 258), (192, 1000), (2048, 320), (4608, 96)]
if ON_GPU:   # the 1B-14B configurations: rows shared evenly (N < 4096), a warp per 2 rows (N >= 4096)
  NORM_SHAPES += [(3584, 3072), (3584, 4608), (2048, 16384)]


@pytest.mark.parametrize("k, n", NORM_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("epilogue", ["none", "swiglu"])
def test_norm_linear(k, n, dtype, epilogue):
  n += n % 2 if epilogue == "swiglu" else 0   # gate and up halves
  rng = np.random.default_rng(k * 31 + n)
  lin = _quantized(rng, 3, n, k)
  norm_w = jnp.asarray(1 + 0.3 * rng.standard_normal((3, k)), jnp.float32)
  w = _dequant(lin, 2)
  for m in MS:
    x = _residual_stream(rng, m, k)
    out_n = n // 2 if epilogue == "swiglu" else n
    poison = jnp.full((m, out_n), jnp.nan, dtype)
    got = jax.jit(lambda x, p, lin: fused.norm_linear(x, norm_w, EPS, lin, 2, dtype=dtype, epilogue=epilogue,
                                                      poison=p))(x, poison, lin)   # lin an argument, not a constant
    y = _round(_norm64(x, norm_w[2], dtype) @ w.T, dtype)
    if epilogue == "swiglu":
      g, u = y[:, :n // 2], y[:, n // 2:]
      y = g / (1 + np.exp(-g)) * u
    got = np.asarray(got, np.float64)
    assert got.shape == (m, out_n) and not np.isnan(got).any(), f"unwritten outputs at M={m}"
    assert _rel(got, y) < TOL[dtype], (m, _rel(got, y))


@pytest.mark.parametrize("k, n", [(896, 896), (4864, 896), (1536, 576), (64, 5), (320, 257)]
                         + ([(3584, 3584), (18944, 2048)] if ON_GPU else []))
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_residual(k, n, dtype):
  rng = np.random.default_rng(k + n)
  lin = _quantized(rng, 2, n, k)
  w = _dequant(lin, 1)
  for m in MS:
    a = jnp.asarray(rng.standard_normal((m, k)), dtype)
    res = _residual_stream(rng, m, n)
    poison = jnp.full((m, n), jnp.nan, jnp.float32)
    got = jax.jit(lambda a, r, p, lin: fused.linear_residual(a, lin, 1, r, poison=p))(a, res, poison, lin)
    want = np.asarray(res, np.float64) + _round(np.asarray(a, np.float64) @ w.T, dtype)
    assert not np.isnan(np.asarray(got)).any()
    # the residual carries through exactly; the product's share to its tolerance
    assert np.max(np.abs(np.asarray(got, np.float64) - want)) < TOL[dtype] * np.max(np.abs(want - np.asarray(res)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_argmax_picks_the_first_largest(dtype):
  rng = np.random.default_rng(7)
  k, n = 192, 3000
  w = rng.standard_normal((1, n, k)).astype(np.float32)
  x = _residual_stream(rng, max(MS), k)
  h = _norm64(x, np.ones(k), dtype)
  q0, s0 = quantize_int8(w)
  best = int(np.argmax((h @ _dequant(Linear(w=jnp.asarray(q0), scale=jnp.asarray(s0)), 0).T)[0]))
  # Copy row 0's winner to two other places: one before it, one after; argmax takes the earliest.
  early = max(0, best // 2 - 1)
  w[0, early] = w[0, best]
  w[0, n - 1] = w[0, best]
  q, s = quantize_int8(w)
  lin = Linear(w=jnp.asarray(q[0]), scale=jnp.asarray(s[0]))
  logits = _round(h @ _dequant(Linear(w=jnp.asarray(q), scale=jnp.asarray(s)), 0).T, dtype)
  tokens, finite = jax.jit(lambda x, lin: fused.norm_argmax(x, jnp.ones(k), EPS, lin, dtype=dtype))(x, lin)
  tokens, finite = np.asarray(tokens), np.asarray(finite)
  assert finite.all()
  assert tokens[0] == min(early, best), (tokens[0], early, best)
  for r in range(x.shape[0]):
    top = np.max(logits[r])
    # the chosen logit is the row's largest up to the tolerance of the rounded product
    assert logits[r, tokens[r]] >= top - TOL[dtype] * np.max(np.abs(logits[r])), r


def test_norm_argmax_flags_nonfinite_rows():
  rng = np.random.default_rng(8)
  k, n = 128, 500
  lin = _quantized(rng, 1, n, k)
  x = np.array(_residual_stream(rng, 2, k))
  x[1, 5] = np.inf
  dtype = DTYPES[-1]
  _, finite = fused.norm_argmax(jnp.asarray(x), jnp.ones(k), EPS, Linear(w=lin.w[0], scale=lin.scale[0]),
                                dtype=dtype)
  assert np.asarray(finite).tolist() == [True, False]


def _random_head(rng, n, k):
  """An LM head of N rows: int8 weights [N, K] and f32 scales [N, K / 64]."""
  w = rng.integers(-127, 128, (n, k), dtype=np.int8)
  return w, (rng.random((n, k // 64)) * 0.02 + 0.001).astype(np.float32)


def _head64(w, s) -> np.ndarray:
  """_random_head's weights dequantized in float64 [N, K]."""
  return _dequant(Linear(w=w[None], scale=s[None]), 0)


@pytest.mark.gpu
@pytest.mark.parametrize("k, n", [(896, 151936), (576, 49157), (1536, 40003)])
@pytest.mark.parametrize("copies", ["early and last", "last only"])
def test_norm_argmax_at_vocabulary_size(k, n, copies):
  """The greedy head at batch 1 over a real vocabulary (Qwen2.5-0.5B's, SmolLM2's, and K past 1024 with an
  odd N): on the GPU it runs on the blocks resident at once, each walking row groups, so the winner is planted
  where the walk could lose it: its row's scales raised by a quarter above the float64 argmax's, copied to an
  earlier row (argmax takes the earliest) and to the last row of an odd-sized tail, or to the last row only."""
  rng = np.random.default_rng(k + n)
  w, s = _random_head(rng, n, k)
  x = _residual_stream(rng, 1, k)
  h = _norm64(x, np.ones(k), jnp.bfloat16)[0]
  logits = _head64(w, s) @ h
  best = int(np.argmax(logits))
  assert logits[best] > 0
  original = s[best].copy()
  s[best] *= 1.25   # a margin far above the kernel's rounding
  planted = [max(0, best // 3 - 1), n - 1] if copies == "early and last" else [n - 1]
  for row in planted:
    w[row], s[row] = w[best], s[best]
  if copies == "last only" and best != n - 1:
    s[best] = original   # the winner is the last row alone
  want = planted[0]
  lin = Linear(w=jnp.asarray(w), scale=jnp.asarray(s))
  tokens, finite = fused.norm_argmax(x, jnp.ones(k), EPS, lin, dtype=jnp.bfloat16)
  assert np.asarray(finite).tolist() == [True]
  assert int(np.asarray(tokens)[0]) == want, (int(np.asarray(tokens)[0]), planted, best)
  x_bad = np.array(x)   # a non-finite residual row (the int16 staging must not turn it into zeros)
  x_bad[0, 7] = np.nan if copies == "early and last" else np.inf
  _, finite = fused.norm_argmax(jnp.asarray(x_bad), jnp.ones(k), EPS, lin, dtype=jnp.bfloat16)
  assert np.asarray(finite).tolist() == [False]


@pytest.mark.gpu
@pytest.mark.parametrize("k, n", [(896, 151936), (576, 49157), (1536, 40003)])
def test_norm_linear_at_vocabulary_size(k, n):
  """The sampled step's LM head at batch 1 over a real vocabulary: on the GPU it runs on the blocks resident at
  once, each walking row groups, so every logit must be written (poisoned output), the last rows of an odd tail
  included, and agree with numpy float64 to bf16's rounding; its largest logit is the greedy head's token."""
  rng = np.random.default_rng(k * 7 + n)
  w, s = _random_head(rng, n, k)
  x = _residual_stream(rng, 1, k)
  norm_w = jnp.asarray(1 + 0.3 * rng.standard_normal(k), jnp.float32)
  lin = Linear(w=jnp.asarray(w), scale=jnp.asarray(s))
  poison = jnp.full((1, n), jnp.nan, jnp.bfloat16)
  got = jax.jit(lambda x, p, lin: fused.norm_linear(x, norm_w, EPS, lin, dtype=jnp.bfloat16, poison=p))(x, poison, lin)
  got = np.asarray(got, np.float64)[0]
  h = _norm64(x, norm_w, jnp.bfloat16)[0]
  want = _round(_head64(w, s) @ h, jnp.bfloat16)
  assert not np.isnan(got).any(), f"unwritten logits: {np.flatnonzero(np.isnan(got))[:8]}"
  assert _rel(got, want) < 5e-3, _rel(got, want)
  tokens, _ = fused.norm_argmax(x, norm_w, EPS, lin, dtype=jnp.bfloat16)
  assert int(np.asarray(tokens)[0]) == int(np.argmax(got))


def _rope64(x, pos, inv_freq, neox):
  """x [N, Dh] float64 rotated at position pos."""
  half = x.shape[-1] // 2
  # the angle as the op defines it (f32 position times f32 frequency, rounded to f32), then float64
  ang = np.asarray(np.float32(pos) * np.asarray(inv_freq, np.float32), np.float64)
  cos, sin = np.cos(ang), np.sin(ang)
  if neox:
    x1, x2 = x[:, :half], x[:, half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  x1, x2 = x[:, 0::2], x[:, 1::2]
  out = np.empty_like(x)
  out[:, 0::2], out[:, 1::2] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
  return out


@pytest.mark.parametrize("style", ["llama", "qwen2", "qwen3", "qwen3-128"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qkv_epilogue(style, dtype):
  rng = np.random.default_rng(len(style))
  h, g, dh = (16, 8, 128) if style == "qwen3-128" else (14, 2, 64)
  n_layers, b, s = 3, 3, 40
  n = (h + 2 * g) * dh
  neox = style != "llama"
  qkv = jnp.asarray(2 * rng.standard_normal((b, n)), dtype)
  bias = jnp.asarray(rng.standard_normal((n_layers, n)), jnp.float32) if style == "qwen2" else None
  qn = jnp.asarray(1 + 0.2 * rng.standard_normal((n_layers, dh)), jnp.float32) if style.startswith("qwen3") else None
  kn = jnp.asarray(1 + 0.2 * rng.standard_normal((n_layers, dh)), jnp.float32) if qn is not None else None
  inv_freq = jnp.asarray(10000.0 ** (-np.arange(dh // 2) * 2.0 / dh), jnp.float32)
  pos = jnp.asarray([3, 3000, 17], jnp.int32)       # RoPE positions (row 1 far out)
  writes = jnp.asarray([3, 39, s], jnp.int32)       # cache positions; row 2 inactive (S: not written)
  kc0 = jnp.asarray(rng.standard_normal((n_layers, b, g, s, dh)), dtype)
  vc0 = jnp.asarray(rng.standard_normal((n_layers, b, g, s, dh)), dtype)
  fn = jax.jit(lambda qkv, kc, vc: fused.qkv_epilogue(qkv, bias, qn, kn, inv_freq, 1, pos, writes, kc, vc,
                                                      n_heads=h, n_kv_heads=g, neox=neox, pos_scale=1.0, eps=EPS))
  q, kc, vc, counters = fn(qkv, kc0, vc0)
  assert np.all(np.asarray(counters) == 0)
  row = np.asarray(qkv, np.float64)
  if bias is not None:
    row = _round(row + np.asarray(bias[1], np.float64), dtype)
  kc_want, vc_want = np.asarray(kc0, np.float64).copy(), np.asarray(vc0, np.float64).copy()
  tol = 2.0 ** -7 if dtype == jnp.bfloat16 else 1e-5
  for i in range(b):
    heads = row[i].reshape(h + 2 * g, dh)
    qh, kh, vh = heads[:h], heads[h:h + g], heads[h + g:]
    if qn is not None:
      qh = _norm64(qh, qn[1], dtype)
      kh = _norm64(kh, kn[1], dtype)
    p = float(pos[i])
    np.testing.assert_allclose(np.asarray(q[i], np.float64), _rope64(qh, p, inv_freq, neox), rtol=tol,
                               atol=tol * np.max(np.abs(qh)))
    if writes[i] < s:
      kc_want[1, i, :, int(writes[i])] = _rope64(kh, p, inv_freq, neox)
      vc_want[1, i, :, int(writes[i])] = vh
  # Everything but the written slots is untouched (bit for bit); the slots hold the rotated keys/values.
  np.testing.assert_allclose(np.asarray(kc, np.float64), kc_want, rtol=tol, atol=tol * 4)
  np.testing.assert_array_equal(np.asarray(vc, np.float64), _round(vc_want, dtype))
  mask = np.ones(kc_want.shape, bool)
  for i in range(b):
    if writes[i] < s:
      mask[1, i, :, int(writes[i])] = False
  np.testing.assert_array_equal(np.asarray(kc, np.float64)[mask], np.asarray(kc0, np.float64)[mask])


def _attention64(q, k, v, lengths):
  """q [B, H, Dh], caches [B, G, S, Dh] float64 -> [B, H, Dh]: softmax over the first lengths[b] keys."""
  b, h, dh = q.shape
  g = k.shape[1]
  out = np.zeros((b, h, dh))
  for i in range(b):
    n = int(np.clip(lengths[i], 1, k.shape[2]))
    for j in range(h):
      kk, vv = k[i, j // (h // g), :n], v[i, j // (h // g), :n]
      sc = kk @ q[i, j] / np.sqrt(dh)
      p = np.exp(sc - sc.max())
      out[i, j] = p @ vv / p.sum()
  return out


@pytest.mark.parametrize("h, g, dh", [(14, 2, 64), (16, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [None, 3, 6, 12])
def test_merged_attention(h, g, dh, dtype, splits):
  """One tile (the lone block writes the output), a few, and many splits: merged in a cluster (on the H200:
  clusters of 2 for 3 splits with one idle block, 4 for 6, 8 for 12 and the default), then across clusters by
  the last block. At head dim 128, C + 1 to 2C visible tiles are walked by the first cluster (clusters of 8: 129,
  200; of 4: 65 and 127-128)."""
  rng = np.random.default_rng(h * g + dh)
  s = 2048
  b = 4
  k = jnp.asarray(rng.standard_normal((2, b, g, s, dh)), dtype)
  v = jnp.asarray(rng.standard_normal((2, b, g, s, dh)), dtype)
  q = jnp.asarray(2 * rng.standard_normal((b, h, dh)), dtype)
  fn = jax.jit(lambda q, k, v, lengths: fused.decode_attention_merged(q, k, v, 1, lengths,
                                                                      jnp.zeros((b, g), jnp.int32), splits=splits))
  # (the last set: 9-32 tiles at head dim 128, 9-16 at 64, bf16)
  for lengths in ([1, 63, 64, 65], [127, 128, 129, 700], [2048, 1999, 3000, 1500], [257, 300, 200, 512]):
    got = np.asarray(fn(q, k, v, jnp.asarray(lengths, jnp.int32)), np.float64)
    want = _attention64(np.asarray(q, np.float64), np.asarray(k[1], np.float64), np.asarray(v[1], np.float64),
                        lengths)
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert err < (2 ** -7 if dtype == jnp.bfloat16 else 1e-5), (lengths, err)


def _synthetic(name):
  """A real model's geometry (two layers, a 4096-token vocabulary) with random W8A16 weights."""
  from jaxllm.load import default_dtype
  from jaxllm.presets import preset
  from jaxllm.weights import random_weights
  config = preset(name).replace(n_layers=2, vocab_size=4096)
  return config, random_weights(config, seed=1, quant="w8a16", dtype=default_dtype())


SYNTHETIC = ["qwen2.5-0.5b", "qwen3-0.6b", "smollm2-135m"]
# The GPU also runs the step at the widths of a large preset (the 1B-14B shapes' kernel configurations; each
# matmul shape of every preset is in test_kernels.py).
SYNTHETIC_STEP = SYNTHETIC + (["qwen2.5-7b"] if ON_GPU else [])


def test_step_runs_the_fused_kernels_and_the_argmax_head(monkeypatch):
  """kernels="ffi": four fused matmuls, one QKV epilogue and one attention per layer, and for plain greedy
  the argmax head (no logits); "ffi-unfused" none of them; a penalized greedy step keeps the logits.
  (One FFI call per op here; on the GPU the step's default is one call for all layers, tested below.)"""
  monkeypatch.setenv("JAXLLM_LAYERS_CALL", "0")
  from jaxllm.decode import decode_step
  from jaxllm.engine import Engine
  config, weights = _synthetic("qwen2.5-0.5b")
  engine = Engine(config, weights, None, max_context=64, kernels="ffi")
  state = engine._state_spec(1)

  def hlo(**kw):
    fn = jax.jit(lambda w, st: decode_step(config, w, st, **kw))
    return fn.lower(weights, state).as_text()

  text = hlo(greedy_only=True, penalties=False, kernels="ffi")
  n = config.n_layers
  assert text.count("@jaxllm_w8a16_fused(") == 4 * n + 1
  assert text.count("@jaxllm_qkv_epilogue(") == n and text.count("@jaxllm_decode_attention_merged(") == n
  assert text.count("mode = 2 : i64") == 1                 # the argmax head
  penalized = hlo(greedy_only=True, penalties=True, kernels="ffi")
  assert "mode = 2 : i64" not in penalized and penalized.count("mode = 0 : i64") == n + 1
  assert "jaxllm_w8a16_fused" not in hlo(greedy_only=True, penalties=False, kernels="ffi-unfused")


@pytest.mark.parametrize("name", SYNTHETIC_STEP)
def test_fused_step_logits_match_unfused(name):
  """Teacher-forced: 20 decode steps of a batch of two (one row inactive for a while) through the fused
  step and the unfused FFI step, fed the same tokens: logits and caches agree to the activation dtype's
  rounding at every step."""
  from jaxllm.model import forward, forward_decode_fused, logits
  config, weights = _synthetic(name)
  cache_f = cache_u = _cache(config)
  dtype = cache_f.compute_dtype
  tol = TOL[jnp.dtype(dtype).type] if jnp.dtype(dtype) == jnp.bfloat16 else 1e-4
  rng = np.random.default_rng(3)
  # The weights are arguments, not constants folded into the programs (a 7B layer's are ~0.5 GB to compile in).
  fused_step = jax.jit(lambda w, c, t, p, a: forward_decode_fused(config, w, c, t, p, a))
  unfused_step = jax.jit(lambda w, c, t, p, a: forward(config, w, c, t[:, None], p, a[:, None],
                                                      kernels="ffi-unfused"))
  head = jax.jit(lambda w, x: fused.norm_linear(x, w.out_norm, config.rms_eps, w.head, dtype=dtype))
  for t in range(20):
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, 2), jnp.int32)
    pos = jnp.asarray([t, max(0, t - 5)], jnp.int32)
    active = jnp.asarray([True, t >= 5])
    x, cache_f = fused_step(weights, cache_f, tokens, pos, active)
    hidden, cache_u = unfused_step(weights, cache_u, tokens, pos, active)
    lf = np.asarray(head(weights, x), np.float64)
    lu = np.asarray(logits(weights, hidden[:, 0], dtype, kernels="ffi-unfused"), np.float64)
    assert _rel(lf, lu) < tol, (t, _rel(lf, lu))
    assert _rel(cache_f.k, cache_u.k) < tol and _rel(cache_f.v, cache_u.v) < tol, t


@pytest.mark.parametrize("name", SYNTHETIC_STEP)
def test_batched_step_attention_block_matches_unfused(name):
  """The step model.forward runs at batch > 1 (the GPU's fused step takes batch 1): with kernels "ffi" its
  attention block is one QKV epilogue and one merged attention a layer (none with "ffi-unfused"). Teacher-forced,
  12 steps of a batch of 5 (the GPU's tensor-core matmul range) from different positions, one row inactive
  for a while: the hidden states and caches agree with "ffi-unfused" to the activation dtype's rounding."""
  from jaxllm.model import forward
  from jaxllm.rope import llama3_rope_freqs
  config, weights = _synthetic(name)
  # Per-layer q/k norms that differ (random_weights' are ones) and Llama 3.1's RoPE divisors, so a swapped norm,
  # another layer's, or dropped divisors show.
  rng = np.random.default_rng(4)
  extra = {"rope_freqs": llama3_rope_freqs(config, original_context=64)}
  for f in ("q_norm", "k_norm"):
    if getattr(weights, f) is not None:
      extra[f] = jnp.asarray(rng.uniform(0.5, 1.5, getattr(weights, f).shape), jnp.float32)
  weights = dataclasses.replace(weights, **extra)
  batch = 5
  cache_f = cache_u = _cache(config, batch)
  dtype = cache_f.compute_dtype
  tol = TOL[jnp.dtype(dtype).type] if jnp.dtype(dtype) == jnp.bfloat16 else 1e-4
  steps = {k: jax.jit(lambda w, c, t, p, a, k=k: forward(config, w, c, t[:, None], p, a[:, None], kernels=k,
                                                         layers="unrolled"))
           for k in ("ffi", "ffi-unfused")}
  tokens = jnp.zeros((batch,), jnp.int32)
  spec = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (tokens, tokens, tokens.astype(bool))]
  taken = fused.attention_block_reason(config, cache_f, batch) is None   # on the GPU: head dim 64 only
  assert taken or ON_GPU
  texts = {k: steps[k].lower(weights, cache_f, *spec).as_text() for k in steps}
  for kernels, n in (("ffi", config.n_layers if taken else 0), ("ffi-unfused", 0)):
    assert texts[kernels].count("@jaxllm_qkv_epilogue(") == n
    assert texts[kernels].count("@jaxllm_decode_attention_merged(") == n
  if not taken:   # the GPU at head dim 128: both programs are the same one
    assert texts["ffi"] == texts["ffi-unfused"]
    return
  for t in range(12):
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, batch), jnp.int32)
    pos = jnp.asarray([t, t + 3, t + 17, max(0, t - 4), 2 * t], jnp.int32)
    active = jnp.asarray([True, True, True, t >= 4, True])
    hf, cache_f = steps["ffi"](weights, cache_f, tokens, pos, active)
    hu, cache_u = steps["ffi-unfused"](weights, cache_u, tokens, pos, active)
    assert np.isfinite(np.asarray(hf)).all()
    assert _rel(hf, hu) < tol, (t, _rel(hf, hu))
    assert _rel(cache_f.k, cache_u.k) < tol and _rel(cache_f.v, cache_u.v) < tol, t

  # jax.vmap over the step (a batch of steps): the fused ops map one call at a time
  def vstep(kernels):
    fn = lambda t, p: forward(config, weights, _cache(config, 2, 32), t[:, None], p, kernels=kernels,
                              layers="unrolled")[0]
    return jax.jit(jax.vmap(fn))(jnp.asarray(rng.integers(0, config.vocab_size, (3, 2)), jnp.int32) * 0 + 7,
                                 jnp.asarray([[0, 3], [5, 1], [2, 2]], jnp.int32))
  assert _rel(vstep("ffi"), vstep("ffi-unfused")) < tol


def test_attention_block_gate_says_why_not():
  """attention_block_reason: a cache kept in another dtype than the activations is refused (the epilogue writes
  the activation dtype); on the GPU so are a batch above GPU_BLOCK_MAX_BATCH and a head dim other than 64; the
  batch sizes it takes, taken."""
  config, _ = _synthetic("qwen2.5-0.5b")
  wide, _ = _synthetic("qwen3-0.6b")   # head dim 128
  assert (fused.attention_block_reason(wide, _cache(wide, 4), 4) is not None) == ON_GPU
  cache = _cache(config, 4)
  assert fused.attention_block_reason(config, cache, 4) is None
  other = jnp.float32 if cache.k.dtype == jnp.bfloat16 else jnp.bfloat16
  odd = dataclasses.replace(cache, k=cache.k.astype(other), v=cache.v.astype(other),
                            compute=jnp.dtype(cache.compute_dtype).name)
  assert "activation dtype" in fused.attention_block_reason(config, odd, 4)
  big = fused.attention_block_reason(config, cache, fused.GPU_BLOCK_MAX_BATCH + 1)
  assert (big is not None and "measured slower" in big) if ON_GPU else big is None
  assert fused.attention_block_reason(config, cache, fused.GPU_BLOCK_MAX_BATCH) is None


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "smollm2-135m"])   # head dim 64: the GPU's attention block runs
def test_batched_engine_tokens_match_unfused(name):
  """A batch of 16 through the engine (GPU: the tensor-core matmuls and the fused attention block): greedy and
  penalized greedy, prompts of different lengths; every row's tokens on "ffi" are "ffi-unfused"'s argmax or a near
  tie (agree.same_or_near_tie)."""
  from jaxllm.engine import Engine
  from jaxllm.sampling import SamplingParams
  config, weights = _synthetic(name)
  assert fused.attention_block_reason(config, _cache(config, 16), 16) is None
  prompts = [[1 + i, 5, 9, 3, 4][: 2 + i % 4] for i in range(16)]
  engines = {k: Engine(config, weights, None, max_context=48, kernels=k) for k in ("ffi", "ffi-unfused")}
  for params in (SamplingParams(), SamplingParams(repeat_penalty=1.3)):
    ids = {k: [r.ids for r in e.generate_batch(prompts, 16, params, ignore_eos=True)] for k, e in engines.items()}
    for p, got, want in zip(prompts, ids["ffi"], ids["ffi-unfused"]):
      same_or_near_tie(engines["ffi-unfused"], p, got, want, params=params)


@pytest.mark.parametrize("name", SYNTHETIC)
def test_fused_engine_tokens_match_unfused_and_xla(name):
  """Greedy and penalized greedy, two prompts of different lengths: the same tokens on the fused, unfused FFI
  and XLA paths. On the CPU (f32) as a batch of two, exactly; on the GPU (bf16, whose fused step runs one row)
  each prompt alone, every token of every path the reference's argmax or a near tie (agree.same_or_near_tie)."""
  from jaxllm.engine import Engine
  from jaxllm.model import use_fused
  from jaxllm.sampling import SamplingParams
  config, weights = _synthetic(name)
  prompts, batch = [[1, 5, 9, 3, 4], [7, 2]], 1 if ON_GPU else 2
  engines = {k: Engine(config, weights, None, max_context=48, kernels=k) for k in ("ffi", "ffi-unfused", "xla")}
  assert use_fused(config, weights, _cache(config, batch), batch, engines["ffi"].kernels)   # the fused step runs
  for params in (SamplingParams(), SamplingParams(repeat_penalty=1.3)):
    ids = {}
    for kernels, e in engines.items():
      if ON_GPU:
        ids[kernels] = [e.generate(p, 24, params, ignore_eos=True).ids for p in prompts]
      else:
        ids[kernels] = [r.ids for r in e.generate_batch(prompts, 24, params, ignore_eos=True)]
    for other in ("ffi-unfused", "xla"):
      for p, got, want in zip(prompts, ids["ffi"], ids[other]):
        same_or_near_tie(engines[other], p, got, want, params=params)


def _cache(config, batch=2, max_len=48):
  from jaxllm.cache import create_cache
  from jaxllm.load import default_dtype
  return create_cache(config, batch, max_len, default_dtype())


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [3, 1])
@pytest.mark.parametrize("name", SYNTHETIC_STEP)
def test_layers_call_equals_per_op_calls_whatever_the_launch(monkeypatch, name, batch):
  """On the GPU the fused step runs every layer from one FFI call: the per-op kernels with the QKV epilogue
  folded into the attention (whose block holding the write position appends the new key and value), with
  programmatic dependent launch. The same bits as one call per op, with PDL on or off; positions over
  several attention splits, one at a split's first tile, one row inactive (writes nothing); random
  caches; the LM head (greedy and logits) the call's last kernel, bit for bit the head's own call. Batch 1
  is the configuration the GPU's fused step runs (fused.GPU_FUSED_BATCH)."""
  from jaxllm.model import forward_decode_fused, forward_decode_fused_head
  config, weights = _synthetic(name)
  rng = np.random.default_rng(5)
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, batch), jnp.int32)
  pos = jnp.asarray([300, 32, 5][:batch], jnp.int32)
  active = jnp.asarray([True, True, False][:batch])
  base = _cache(config, batch, 640)
  k0 = jnp.asarray(rng.standard_normal(base.k.shape), base.k.dtype)
  v0 = jnp.asarray(rng.standard_normal(base.v.shape), base.v.dtype)
  outs = {}
  for one, pdl in (("1", "1"), ("1", "0"), ("0", "1")):
    monkeypatch.setenv("JAXLLM_LAYERS_CALL", one)
    monkeypatch.setenv("JAXLLM_PDL", pdl)
    cache = dataclasses.replace(base, k=k0 + 0, v=v0 + 0)
    # The weights are arguments, not constants folded into the programs (as in the engine's step).
    fn = jax.jit(lambda w, c: forward_decode_fused(config, w, c, tokens, pos, active))
    text = fn.lower(weights, cache).as_text()
    assert text.count("@jaxllm_decode_layers(") == (1 if one == "1" else 0)
    x, kv = fn(weights, cache)
    outs[(one, pdl)] = (np.asarray(x), np.asarray(kv.k, np.float32), np.asarray(kv.v, np.float32))
    for greedy in (True, False):   # the head: the layers call's last kernel, else its own call
      hfn = jax.jit(lambda w, c: forward_decode_fused_head(config, w, c, tokens, pos, active, greedy=greedy)[0])
      cache = dataclasses.replace(base, k=k0 + 0, v=v0 + 0)
      count = hfn.lower(weights, cache).as_text().count("@jaxllm_w8a16_fused(")
      assert count == (0 if one == "1" else 4 * config.n_layers + 1)
      outs[(one, pdl)] += tuple(np.asarray(a) for a in jax.tree.leaves(hfn(weights, cache)))
  ref = outs[("0", "1")]
  logits = ref[-1]
  assert logits.shape == (batch, config.vocab_size) and np.isfinite(logits).all()
  np.testing.assert_array_equal(ref[3], np.argmax(logits, axis=-1))   # the argmax head's tokens: the logits' argmax
  k_old = np.asarray(k0, np.float32)
  assert not np.array_equal(ref[1][:, 0, :, 300], k_old[:, 0, :, 300])   # the new key went in
  if batch == 3:
    np.testing.assert_array_equal(ref[1][:, 2], k_old[:, 2])             # the inactive row wrote nothing
  for key, got in outs.items():
    for a, b in zip(got, ref):
      np.testing.assert_array_equal(a, b, err_msg=str(key))


@pytest.mark.parametrize("one", ["1", "0"] if ON_GPU else ["1"])
def test_fused_step_under_vmap_equals_each_state_alone(monkeypatch, one):
  """jax.vmap over batch-1 fused steps (a user's program mapping independent states). The per-op calls (the CPU's
  fused step; on the GPU with the lab switch JAXLLM_LAYERS_CALL=0) map one state at a time (vmap_method
  "sequential"): every state's logits and cache are the bits its own step gives. Until the handlers copied an
  aliased input into an output XLA gave a buffer of its own (test_aliased_ops_under_vmap_keep_their_inputs), the
  GPU's per-op step failed here (H200, 2026-12-06; a lab build with that copy off, H100, 2026-12-07); with it,
  it passed (H100, 2026-12-07). The GPU's one layers call ("1") maps sequentially too: it gave other logits than
  each state alone before that copy (H100, 2026-12-06) and was refused until the copy was in."""
  from jaxllm.model import forward_decode_fused_head
  monkeypatch.setenv("JAXLLM_LAYERS_CALL", one)   # read: _exact's lab_switches fixture, in any build
  config, weights = _synthetic("qwen2.5-0.5b")
  rng = np.random.default_rng(6)
  states = 3
  base = _cache(config, 1, 64)
  k0 = jnp.asarray(rng.standard_normal((states,) + base.k.shape), base.k.dtype)
  v0 = jnp.asarray(rng.standard_normal((states,) + base.v.shape), base.v.dtype)
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (states, 1)), jnp.int32)
  pos = jnp.asarray([[40], [7], [0]], jnp.int32)
  active = jnp.ones((states, 1), bool)

  def step(w, k, v, t, p, a):
    out, cache = forward_decode_fused_head(config, w, dataclasses.replace(base, k=k, v=v), t, p, a, greedy=False)
    return out, cache.k, cache.v

  mapped = jax.jit(jax.vmap(step, in_axes=(None, 0, 0, 0, 0, 0)))(weights, k0, v0, tokens, pos, active)
  assert np.isfinite(np.asarray(mapped[0])).all()
  alone = jax.jit(step)
  for i in range(states):
    for got, want in zip(mapped, alone(weights, k0[i], v0[i], tokens[i], pos[i], active[i])):
      np.testing.assert_array_equal(np.asarray(got[i], np.float32), np.asarray(want, np.float32), err_msg=str(i))



def _epilogue_attention(rng):
  """The QKV epilogue then the one-kernel attention at the 0.5B shape's attention geometry (14 heads, 2 KV heads,
  dim 64, a q/k/v bias) for layer 1 of 2: (n, op) with n the QKV row's width and op(qkv, kc, vc, pos, alias=True)
  -> (q, kc, vc, attention out, counters), pos [B] the RoPE and write position."""
  h, g, dh, layers = 14, 2, 64, 2
  n = (h + 2 * g) * dh
  bias = jnp.asarray(rng.standard_normal((layers, n)), jnp.float32)
  inv_freq = jnp.asarray(10000.0 ** (-np.arange(dh // 2) * 2.0 / dh), jnp.float32)

  def op(qkv, kc, vc, pos, alias=True):
    q, kc, vc, counters = fused.qkv_epilogue(qkv, bias, None, None, inv_freq, 1, pos, pos, kc, vc, n_heads=h,
                                             n_kv_heads=g, neox=True, pos_scale=1.0, eps=EPS, alias=alias)
    out, counters = fused.decode_attention_merged(q, kc, vc, 1, pos + 1, counters, with_counters=True, alias=alias)
    return q, kc, vc, out, counters
  return n, op


def test_aliased_ops_under_vmap_keep_their_inputs():
  """jax.vmap over the QKV epilogue and the one-kernel attention with mapped caches and counters (their outputs
  aliased to those inputs; vmap_method "sequential"): each state's outputs are the bits of its own call, and a
  mapped cache is its input but for the slot written. On the GPU XLA gives these outputs buffers of their own
  under the sequential map, and the handlers copy the input in first (HoldAlias, ffi/common.h): with that copy
  off (lab switch JAXLLM_ALIAS_COPY=0, H100, 2026-12-07) the mapped caches of a QKV epilogue of this geometry
  (docs/results/2026-12-07-h100-vmap-alias/vmap_study.py) differed from each state's own in 97,536 places, and
  the per-op fused step's logits in 4,094 of 4,096. (The CPU keeps the alias: test_unaliased_outputs_hold_their_
  inputs below is the check of the copy itself that fails on either backend.)"""
  rng = np.random.default_rng(11)
  dtype = jnp.bfloat16 if ON_GPU else jnp.float32
  n, op = _epilogue_attention(rng)
  states, cache = 3, (2, 1, 2, 64, 64)   # [L, B, G, S, Dh] a state
  qkv = jnp.asarray(rng.standard_normal((states, 1, n)), dtype)
  kc0 = jnp.asarray(rng.standard_normal((states,) + cache), dtype)
  vc0 = jnp.asarray(rng.standard_normal((states,) + cache), dtype)
  pos = jnp.asarray([[40], [7], [0]], jnp.int32)

  mapped = jax.jit(jax.vmap(op))(qkv, kc0, vc0, pos)
  alone = jax.jit(op)
  for i in range(states):
    for j, (got, want) in enumerate(zip(mapped, alone(qkv[i], kc0[i], vc0[i], pos[i]))):
      np.testing.assert_array_equal(np.asarray(got[i], np.float32), np.asarray(want, np.float32), err_msg=f"{i} {j}")
    for got, before in ((mapped[1][i], kc0[i]), (mapped[2][i], vc0[i])):
      kept = np.ones(before.shape, bool)
      kept[1, 0, :, int(pos[i, 0])] = False                 # the one slot this call writes
      np.testing.assert_array_equal(np.asarray(got, np.float32)[kept], np.asarray(before, np.float32)[kept])
  assert np.all(np.asarray(mapped[4]) == 0)               # the attention leaves its counters zero


def test_unaliased_outputs_hold_their_inputs():
  """The QKV epilogue and the one-kernel attention with their caches' and counters' outputs not aliased to the
  inputs (alias=False: XLA gives them buffers of their own, as it did under jax.vmap on the GPU): the handlers
  copy the inputs in first, so every result is the aliased call's bits, the caches their inputs but for the
  written slots, the counters zero. Without that copy (HoldAlias, HoldAliasHost) the outputs hold whatever their
  buffers held: this test failed on the CPU with it removed."""
  rng = np.random.default_rng(12)
  dtype = jnp.bfloat16 if ON_GPU else jnp.float32
  n, op = _epilogue_attention(rng)
  b = 3
  qkv = jnp.asarray(rng.standard_normal((b, n)), dtype)
  kc0 = jnp.asarray(rng.standard_normal((2, b, 2, 48, 64)), dtype)   # [L, B, G, S, Dh]
  vc0 = jnp.asarray(rng.standard_normal((2, b, 2, 48, 64)), dtype)
  pos = jnp.asarray([30, 5, 47], jnp.int32)

  want = jax.jit(lambda *a: op(*a, pos, True))(qkv, kc0, vc0)
  got = jax.jit(lambda *a: op(*a, pos, False))(qkv, kc0, vc0)
  for j, (a, w) in enumerate(zip(got, want)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(w, np.float32), err_msg=str(j))
  kept = np.ones(kc0.shape, bool)
  kept[1, np.arange(b), :, np.asarray(pos)] = False        # the slot each row writes
  for a, before in ((got[1], kc0), (got[2], vc0)):
    np.testing.assert_array_equal(np.asarray(a, np.float32)[kept], np.asarray(before, np.float32)[kept])
  assert np.all(np.asarray(got[4]) == 0)


@pytest.mark.parametrize("alias", [True, False])
def test_epilogue_and_attention_on_the_first_rows_of_larger_caches(alias):
  """The QKV epilogue and the one-kernel attention of B = 3 rows on caches of N = 5 (a server's decode call on 3
  of its 5 slots): the same bits as on the caches cut to rows [0, B), rows [B, N) untouched; also with the caches'
  outputs not aliased (the handlers copy the whole input in). With the caches' strides taken from B, the CPU's
  epilogue wrote elsewhere and this test failed."""
  rng = np.random.default_rng(13)
  dtype = jnp.bfloat16 if ON_GPU else jnp.float32
  n, op = _epilogue_attention(rng)
  b, rows = 3, 5
  qkv = jnp.asarray(rng.standard_normal((b, n)), dtype)
  kc0 = jnp.asarray(rng.standard_normal((2, rows, 2, 300, 64)), dtype)   # [L, N, G, S, Dh]
  vc0 = jnp.asarray(rng.standard_normal((2, rows, 2, 300, 64)), dtype)
  pos = jnp.asarray([280, 5, 130], jnp.int32)

  fn = jax.jit(lambda *a: op(*a, pos, alias))
  whole, cut = fn(qkv, kc0, vc0), fn(qkv, kc0[:, :b], vc0[:, :b])
  for j in (0, 3, 4):   # q, the attention's output, the counters
    np.testing.assert_array_equal(np.asarray(whole[j], np.float32), np.asarray(cut[j], np.float32), err_msg=str(j))
  for j, before in ((1, kc0), (2, vc0)):
    got = np.asarray(whole[j], np.float32)
    np.testing.assert_array_equal(got[:, :b], np.asarray(cut[j], np.float32), err_msg=str(j))
    np.testing.assert_array_equal(got[:, b:], np.asarray(before[:, b:], np.float32), err_msg=str(j))
    assert not np.array_equal(got[1, 0, :, 280], np.asarray(before[1, 0, :, 280], np.float32))   # written


def test_caches_of_fewer_rows_than_the_batch_are_refused():
  """The QKV epilogue and the one-kernel attention of B = 3 rows on caches of 2: each handler says what it needs."""
  rng = np.random.default_rng(14)
  dtype = jnp.bfloat16 if ON_GPU else jnp.float32
  n, op = _epilogue_attention(rng)
  qkv = jnp.asarray(rng.standard_normal((3, n)), dtype)
  kc = jnp.zeros((2, 2, 2, 48, 64), dtype)
  pos = jnp.asarray([3, 4, 5], jnp.int32)
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"jaxllm_qkv_epilogue: the caches \[L, N, G, S, Dh\] need at "
                                                       r"least the B = 3 rows of qkv \(N >= B\); got qkv \[3, 1152\], "
                                                       r"caches \[2, 2, 2, 48, 64\]"):
    jax.block_until_ready(jax.jit(lambda *a: op(*a, pos))(qkv, kc, kc))
  q = jnp.zeros((3, 14, 64), dtype)
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"need at least the B = 3 rows of q \(N >= B\); got q "
                                                       r"\[3, 14, 64\], caches \[2, 2, 2, 48, 64\]"):
    jax.block_until_ready(fused.decode_attention_merged(q, kc, kc, 1, pos + 1, jnp.zeros((3, 2), jnp.int32)))


@pytest.mark.gpu
def test_layers_call_refuses_caches_of_fewer_rows_than_the_batch():
  """The GPU's layers call of B = 2 rows on caches of 1 row: refused, saying what it needs (its step on more rows
  than B is tests/test_step_rows.py's)."""
  from jaxllm.rope import rope_inv_freq
  config, weights = _synthetic("qwen2.5-0.5b")
  cache = _cache(config, 1, 64)
  x = jnp.zeros((2, config.d_model), jnp.float32)
  pos = jnp.asarray([3, 4], jnp.int32)
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"jaxllm_decode_layers: the caches \[L, N, G, S, Dh\] need "
                                                       r"at least the B = 2 rows of x \(N >= B\)"):
    jax.block_until_ready(fused.decode_layers(config, weights, x, pos, pos, pos + 1, rope_inv_freq(config, None), 1.0,
                                              cache.k, cache.v))
