"""The GGUF file's own 4/5-bit weights (quant="gguf", jaxllm.quant.LowBit): exact conversion of the blocks,
the CPU kernel against numpy float64, and whole models against the independent numpy forward."""
import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import GGUFFile, create_cache, sequence_logits
from jaxllm.kernels import ffi
from jaxllm.kernels.linear import linear_reference
from jaxllm.model import forward, logits
from jaxllm.quant import Q6K, Linear, LowBit, Mixed, implicit_min_stack, lowbit_bits, lowbit_from_blocks, q6k_from_blocks
from jaxllm.weights import load_weights, plan_pieces
from tiny import numpy_forward, random_k_blocks, write_tiny_model

TOKENS = [5, 77, 200, 259, 31, 140, 12, 256, 99, 3, 18, 240, 66]
T = gguf.GGMLQuantizationType
needs_cpu_ffi = pytest.mark.skipif(ffi.cpu_unavailable_reason() is not None, reason="the CPU handlers are not built")


@pytest.fixture
def on_the_cpu():
  """The CPU's kernels run on the CPU device: on a GPU machine the test's arrays and programs go there (the FFI
  registers the CPU handlers beside the GPU's); on the CPU it is the default device already."""
  try:
    cpu = jax.devices("cpu")[0]
  except RuntimeError as e:   # JAX_PLATFORMS without cpu
    pytest.skip(f"no CPU device: {e}")
  with jax.default_device(cpu):
    yield


@pytest.mark.parametrize("ggml_type, bits, store_min", [("Q4_0", 4, True), ("Q4_1", 4, True), ("Q4_0", 5, True),
                                                        ("Q4_1", 5, True), ("Q5_0", 5, True), ("Q5_1", 5, True),
                                                        ("Q4_0", 4, False), ("Q5_0", 5, False)])
def test_blocks_convert_exactly(ggml_type, bits, store_min):
  """LowBit of a tensor's blocks dequantizes to exactly what gguf-py's dequantizer gives, also with the min
  left out (a Q4_0 or Q5_0 stack: -8 or -16 times the scale)."""
  rng = np.random.default_rng(1)
  w = (rng.standard_normal((9, 160)) * rng.uniform(0.01, 3, (9, 1))).astype(np.float32)
  raw = gguf.quants.quantize(w, T[ggml_type])
  lin = LowBit(*map(jnp.asarray, lowbit_from_blocks(raw, ggml_type, bits, store_min)))
  assert lin.bits == bits and lin.q.shape == (9, 80) and lin.scale.shape == (9, 5)
  assert lin.min.shape == ((9, 5) if store_min else (9, 0))
  np.testing.assert_array_equal(np.asarray(lin.dequantize()), gguf.quants.dequantize(raw, T[ggml_type]))


@pytest.mark.parametrize("bits", [4, 5])
def test_q4_k_blocks_convert_to_f16_products(bits):
  """Q4_K as LowBit: gguf-py's dequantization of random super-blocks to within the f16 rounding of each
  group's scale d * sc and min dmin * m (a relative 2^-11 of each), and 4-bit values in the right places
  (a nibble out of place is off by a whole step)."""
  rng = np.random.default_rng(3)
  raw = random_k_blocks(rng, 9, 768, "Q4_K", 0.5)
  lin = LowBit(*map(jnp.asarray, lowbit_from_blocks(raw, "Q4_K", bits, True)))
  assert lin.bits == bits and lin.q.shape == (9, 384) and lin.scale.shape == (9, 24) and lin.min.shape == (9, 24)
  ref = gguf.quants.dequantize(raw, T.Q4_K).astype(np.float64)
  scale = np.abs(np.asarray(lin.scale, np.float64)).repeat(32, axis=1)
  minv = np.abs(np.asarray(lin.min, np.float64)).repeat(32, axis=1)
  bound = 2.0 ** -11 * (15 * scale + minv) * 1.01 + 1e-6 * np.abs(ref)
  err = np.abs(np.asarray(lin.dequantize(), np.float64) - ref)
  assert np.all(err <= bound), float((err / bound).max())
  assert np.median(scale) > 0 and err.max() > 0   # the products are rounded, and the bound is not vacuous
  huge = raw.copy()
  huge[0, 0:2] = np.array([60000.0], np.float16).view(np.uint8)   # d * sc overflows f16: not held
  huge[0, 4] = 63
  assert lowbit_from_blocks(huge, "Q4_K", 4, True) is None


def test_plan_pieces_of_a_q4_k_m_file():
  """llama.cpp's Q4_K_M mix: a layer whose v is Q8_0 splits its fused qkv into a LowBit and a W8A16 piece;
  Q4_K and Q6_K layers of ffn_down are held apart."""
  qkv = {0: [("q", "Q5_0"), ("k", "Q5_0"), ("v", "Q8_0")], 1: [("q", "Q5_0"), ("k", "Q5_0"), ("v", "Q5_0")],
         2: [("q", "Q8_0"), ("k", "Q4_1"), ("v", "Q8_0")]}
  plan = plan_pieces(qkv)
  assert [[names for _, names in layer] for layer in plan] == [[["q", "k"], ["v"]], [["q", "k", "v"]],
                                                                [["q"], ["k"], ["v"]]]
  assert [k[1] for k, _ in plan[0]] == [("lowbit", 5, False), ("w8a16", 0, False)]
  assert plan[1][0][0][1] == ("lowbit", 5, False)
  assert [k[1] for k, _ in plan[2]] == [("w8a16", 0, False), ("lowbit", 4, True), ("w8a16", 0, False)]
  down = plan_pieces({0: [("d", "Q6_K")], 1: [("d", "Q4_K")], 2: [("d", "Q4_K")]})
  assert down[0][0][0] != down[1][0][0] == down[2][0][0]   # two stacks: the Q4_K layers share one
  assert down[0][0][0][1] == ("q6k", 6, False) and down[1][0][0][1] == ("lowbit", 4, True)
  assert [k[1][0] for k, _ in plan_pieces({0: [("q", "Q6_K"), ("k", "Q4_K"), ("v", "F16")]})[0]] == ["q6k", "lowbit",
                                                                                                   "w8a16"]


def test_which_stacks_stay_low_bit():
  assert lowbit_bits(["Q4_0", "Q4_1"]) == 4
  assert lowbit_bits(["Q4_1", "Q5_0"]) == 5
  assert lowbit_bits(["Q5_1"]) == 5
  assert lowbit_bits(["Q4_0", "Q8_0"]) is None
  assert lowbit_bits(["Q4_K"]) == 4 and lowbit_bits(["Q4_K", "Q5_0"]) == 5
  assert lowbit_bits(["Q6_K"]) is None
  assert lowbit_bits([]) is None
  assert implicit_min_stack(["Q4_0", "Q4_0"], 4) and implicit_min_stack(["Q5_0"], 5)
  assert not implicit_min_stack(["Q4_0", "Q4_1"], 4) and not implicit_min_stack(["Q4_0", "Q5_0"], 5)
  assert not implicit_min_stack(["Q4_0"], 5)            # a 4-bit block in a 5-bit stack keeps its -8 scale


def _random_lowbit(rng, layers, n, k, bits, store_min=True):
  g = k // 32
  high = rng.integers(0, 2 ** 32, (layers, n, g if bits == 5 else 0), dtype=np.uint32)
  return LowBit(q=jnp.asarray(rng.integers(0, 256, (layers, n, k // 2), dtype=np.uint8)), high=jnp.asarray(high),
                scale=jnp.asarray(rng.uniform(0.002, 0.02, (layers, n, g)).astype(np.float16)),
                min=jnp.asarray(rng.uniform(-0.2, 0.05, (layers, n, g if store_min else 0)).astype(np.float16)))


def _dequant64(lin: LowBit, layer: int) -> np.ndarray:
  """An independent dequantization in float64, from the documented layout."""
  q = np.asarray(lin.q[layer]).astype(np.int64)
  n, half = q.shape
  g = half // 16
  b = q.reshape(n, g, 16)
  vals = np.concatenate([b & 15, b >> 4], axis=-1)
  if lin.bits == 5:
    h = np.asarray(lin.high[layer]).astype(np.int64)
    vals = vals + 16 * ((h[..., None] >> np.arange(32)) & 1)
  scale = np.asarray(lin.scale[layer], np.float64)
  # No min stored: the Q4_0 / Q5_0 blocks' -8 / -16 times the scale (GGUF's definition of those types).
  minv = np.asarray(lin.min[layer], np.float64) if lin.min.shape[-1] else -(8 if lin.bits == 4 else 16) * scale
  w = vals * scale[..., None] + minv[..., None]
  return w.reshape(n, 2 * half)


@pytest.mark.usefixtures("on_the_cpu")
@needs_cpu_ffi
@pytest.mark.parametrize("bits", [4, 5])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 37])   # several rows: tiles of 4 rows of x and of 4 weight rows
@pytest.mark.parametrize("k, n", [(64, 37), (96, 130), (576, 200)])   # 96: an odd number of groups
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cpu_kernel_matches_float64(bits, m, k, n, dtype):
  rng = np.random.default_rng(k + n + m + bits)
  lin = _random_lowbit(rng, 3, n, k, bits)
  x = jnp.asarray(rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1)), dtype)
  poison = jnp.full((m, n), jnp.nan, dtype)
  y = np.asarray(jax.jit(lambda x, p, lin: ffi.lowbit_matmul(x, lin, 2, poison=p))(x, poison, lin), np.float64)
  w = _dequant64(lin, 2)
  xf = np.asarray(x.astype(jnp.float32), np.float64)
  want = xf @ w.T
  bound = np.abs(xf) @ np.abs(w).T     # what the products add up to in magnitude
  tol = 2e-4 if dtype == jnp.float32 else 8e-3   # int16 x (2^-15 of each group's largest); bf16 output
  assert np.all(np.isfinite(y))
  assert np.all(np.abs(y - want) <= tol * bound + 1e-6), np.max(np.abs(y - want) / bound)
  # The jnp reference (what the GPU and --kernels xla run) against the same expectation.
  ref = np.asarray(jax.jit(lambda x, lin: linear_reference(x, lin, 2))(x, lin), np.float64)
  assert np.all(np.abs(ref - want) <= tol * bound + 1e-6)


@pytest.mark.usefixtures("on_the_cpu")
@needs_cpu_ffi
@pytest.mark.parametrize("bits", [4, 5])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cpu_kernel_without_stored_min(bits, m, dtype):
  """A stack of Q4_0 or Q5_0 blocks stores no min: both of the kernel's paths (one row, several) take
  -8 or -16 times the scale, against numpy float64 of GGUF's definition."""
  rng = np.random.default_rng(40 + bits + m)
  lin = _random_lowbit(rng, 2, 130, 192, bits, store_min=False)
  x = jnp.asarray(rng.standard_normal((m, 192)) * 3, dtype)
  poison = jnp.full((m, 130), jnp.nan, dtype)
  y = np.asarray(jax.jit(lambda x, p, lin: ffi.lowbit_matmul(x, lin, 1, poison=p))(x, poison, lin), np.float64)
  w = _dequant64(lin, 1)
  xf = np.asarray(x.astype(jnp.float32), np.float64)
  bound = np.abs(xf) @ np.abs(w).T
  tol = 2e-4 if dtype == jnp.float32 else 8e-3
  assert np.all(np.abs(y - xf @ w.T) <= tol * bound + 1e-6), np.max(np.abs(y - xf @ w.T) / bound)


def _q6k_dequant64(raw: np.ndarray) -> np.ndarray:
  """Q6_K rows [N, bytes] dequantized in float64 from ggml's block_q6_K, written out independently: per half of
  128 values, value l + 32 i takes ql's nibble (byte l or l + 32, low or high) and qh's 2 bits at 2 i."""
  n = raw.shape[0]
  b = raw.reshape(n, -1, 210).astype(np.int64)
  ql, qh = b[..., :128], b[..., 128:192]
  sc = raw.reshape(n, -1, 210)[..., 192:208].view(np.int8).astype(np.float64)
  d = raw.reshape(n, -1, 210)[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float64)
  out = np.empty((n, b.shape[1], 256))
  for h in range(2):
    for i in range(4):
      for l in range(32):
        byte = ql[..., 64 * h + l + 32 * (i % 2)]
        nib = byte & 15 if i < 2 else byte >> 4
        q = nib | (((qh[..., 32 * h + l] >> (2 * i)) & 3) << 4)
        j = 128 * h + 32 * i + l
        out[..., j] = d * sc[..., j // 16] * (q - 32)
  return out.reshape(n, -1)


def test_q6k_blocks_convert_exactly():
  rng = np.random.default_rng(5)
  raw = random_k_blocks(rng, 7, 512, "Q6_K", 0.3)
  lin = Q6K(*map(jnp.asarray, q6k_from_blocks(raw)))
  assert lin.ql.shape == (7, 256) and lin.qh.shape == (7, 128) and lin.sc.shape == (7, 32) and lin.d.shape == (7, 2)
  want = _q6k_dequant64(raw)
  np.testing.assert_array_equal(np.asarray(lin.dequantize(), np.float64), want.astype(np.float32))
  np.testing.assert_array_equal(gguf.quants.dequantize(raw, T.Q6_K), want.astype(np.float32))


@pytest.mark.usefixtures("on_the_cpu")
@needs_cpu_ffi
@pytest.mark.parametrize("m", [1, 2, 4, 7, 37])
@pytest.mark.parametrize("k, n", [(256, 37), (768, 130)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_q6k_cpu_kernel_matches_float64(m, k, n, dtype):
  """The Q6_K kernel (one row: int16 x in vpdpwssd; several: dequantized rows) against numpy float64, into a
  poisoned output, on layer 2 of a stack of 3."""
  rng = np.random.default_rng(k + n + m)
  raws = [random_k_blocks(rng, n, k, "Q6_K", 0.05) for _ in range(3)]
  lin = Q6K(*(jnp.asarray(np.stack(a)) for a in zip(*map(q6k_from_blocks, raws))))
  x = jnp.asarray(rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1)), dtype)
  poison = jnp.full((m, n), jnp.nan, dtype)
  y = np.asarray(jax.jit(lambda x, p, lin: ffi.q6k_matmul(x, lin, 2, poison=p))(x, poison, lin), np.float64)
  w = _q6k_dequant64(raws[2])
  xf = np.asarray(x.astype(jnp.float32), np.float64)
  bound = np.abs(xf) @ np.abs(w).T
  tol = 2e-4 if dtype == jnp.float32 else 8e-3
  assert np.all(np.isfinite(y))
  assert np.all(np.abs(y - xf @ w.T) <= tol * bound + 1e-6), np.max(np.abs(y - xf @ w.T) / bound)
  ref = np.asarray(jax.jit(lambda x, lin: linear_reference(x, lin, 2))(x, lin), np.float64)
  assert np.all(np.abs(ref - xf @ w.T) <= tol * bound + 1e-6)


@pytest.mark.usefixtures("on_the_cpu")
@needs_cpu_ffi
def test_cpu_kernel_propagates_nonfinite_x():
  lin = _random_lowbit(np.random.default_rng(0), 1, 8, 64, 4)
  x = jnp.ones((1, 64), jnp.float32).at[0, 3].set(jnp.nan)
  assert np.all(np.isnan(np.asarray(ffi.lowbit_matmul(x, lin, 0))))


def _ffi_decode_steps(config, weights, cache) -> np.ndarray:
  """Logits [len(TOKENS), V] of TOKENS fed one decode step at a time through the FFI kernels."""
  step = jax.jit(lambda c, t, p: sequence_logits(config, weights, c, t, p, kernels="ffi"))
  rows = []
  for i, t in enumerate(TOKENS):
    out, cache = step(cache, jnp.asarray([[t]], jnp.int32), jnp.asarray([i], jnp.int32))
    rows.append(np.asarray(out[0, 0]))
  return np.stack(rows)


@pytest.mark.parametrize("tensor_type", ["Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_gguf_quant_model_matches_numpy(tmp_path, tensor_type):
  """A model of the file's own blocks: every matrix LowBit; the jnp path equals the numpy float64 forward
  of the same file (every weight exact: the embedding and head on the W8A16 grid), the FFI decode steps
  nearly so."""
  heads = {"token_embd.weight": "F32-int8", "output.weight": "F32-int8"}
  path = write_tiny_model(tmp_path / "m.gguf", "qwen2", tensor_type=tensor_type, tensor_types=heads)
  gf = GGUFFile(path)
  config, weights = gf.config, load_weights(gf, quant="gguf", dtype=jnp.float32, progress=False)
  for name in ("wqkv", "wo", "w_gate_up", "w_down"):
    lin = getattr(weights, name)
    assert isinstance(lin, LowBit) and lin.bits == (5 if tensor_type.startswith("Q5") else 4), name
    assert lin.min.shape[-1] == (0 if tensor_type.endswith("_0") else lin.scale.shape[-1]), name   # -8 / -16 scale
  ref = numpy_forward(path, TOKENS)
  cache = create_cache(config, 1, 32, jnp.float32)
  full, _ = sequence_logits(config, weights, cache, jnp.asarray([TOKENS], jnp.int32), jnp.zeros((1,), jnp.int32))
  full = np.asarray(full[0])
  assert np.linalg.norm(full - ref) / np.linalg.norm(ref) < 1e-5
  if ffi.unavailable_reason() is None:
    steps = _ffi_decode_steps(config, weights, cache)
    assert np.linalg.norm(steps - ref) / np.linalg.norm(ref) < 1e-3
    assert (steps.argmax(-1) == ref.argmax(-1)).all()


def test_gguf_quant_mixed_layers(tmp_path):
  """Layers held in different ways: a Q8_0 v makes that layer's qkv a 4-bit piece and a W8A16 one; a Q5_0
  layer and a Q4_1 layer of ffn_down are a 5-bit and a 4-bit stack; the model still matches the numpy
  forward closely."""
  types = {"blk.1.attn_v.weight": "Q8_0", "blk.0.ffn_down.weight": "Q5_0", "blk.1.ffn_gate.weight": "Q5_1"}
  path = write_tiny_model(tmp_path / "m.gguf", "llama", tensor_type="Q4_1", tensor_types=types)
  gf = GGUFFile(path)
  config, weights = gf.config, load_weights(gf, quant="gguf", dtype=jnp.float32, progress=False)
  def kinds(lin, i):
    return [(type(p).__name__, p.bits if isinstance(p, LowBit) else 8) for p, _ in lin.pieces(i)]
  assert isinstance(weights.wo, LowBit) and weights.wo.bits == 4
  assert isinstance(weights.wqkv, Mixed) and kinds(weights.wqkv, 0) == [("LowBit", 4)]
  assert kinds(weights.wqkv, 1) == [("LowBit", 4), ("Linear", 8)]
  assert kinds(weights.w_down, 0) == [("LowBit", 5)] and kinds(weights.w_down, 1) == [("LowBit", 4)]
  assert kinds(weights.w_gate_up, 0) == [("LowBit", 4)] and kinds(weights.w_gate_up, 1) == [("LowBit", 5)]
  ref = numpy_forward(path, TOKENS)
  cache = create_cache(config, 1, 32, jnp.float32)
  full, _ = sequence_logits(config, weights, cache, jnp.asarray([TOKENS], jnp.int32), jnp.zeros((1,), jnp.int32))
  assert np.linalg.norm(np.asarray(full[0]) - ref) / np.linalg.norm(ref) < 0.02   # the W8A16 qkv's error


def test_gguf_quant_q4_k_m_mix(tmp_path):
  """A file mixed as llama.cpp's Q4_K_M is: Q5_0 matrices, ffn_down Q6_K in layers 0 and 2 and Q4_K in 1 and
  3, attn_v Q8_0 in layers 1 and 3. Mixed stacks of LowBit (Q5_0 and Q4_K), Q6K and W8A16 (Q8_0) pieces;
  the jnp path, the FFI decode steps and the CPU's scanned prefill (each layer's pieces picked by a traced
  index) each match the numpy float64 forward of the file to the W8A16 pieces' error."""
  types = {"token_embd.weight": "F32-int8", "output.weight": "F32-int8"}
  for i in range(4):
    types[f"blk.{i}.ffn_down.weight"] = "Q6_K" if i % 2 == 0 else "Q4_K"
    if i % 2:
      types[f"blk.{i}.attn_v.weight"] = "Q8_0"
  path = write_tiny_model(tmp_path / "m.gguf", "qwen2", tensor_type="Q5_0", tensor_types=types, d_ff=256,
                          n_layers=4)
  gf = GGUFFile(path)
  config, weights = gf.config, load_weights(gf, quant="gguf", dtype=jnp.float32, progress=False)
  down, qkv = weights.w_down, weights.wqkv
  assert isinstance(down, Mixed) and isinstance(qkv, Mixed) and isinstance(weights.wo, LowBit)
  assert [type(p) for p, _ in down.pieces(0)] == [Q6K] and [type(p) for p, _ in down.pieces(1)] == [LowBit]
  assert down.pieces(1)[0][0].min.shape[-1] > 0                                  # Q4_K's own mins
  assert [type(p) for p, _ in qkv.pieces(0)] == [LowBit]                         # q, k, v all Q5_0
  assert [(type(p), p.scale.shape[-2]) for p, _ in qkv.pieces(3)] == [(LowBit, 96), (Linear, 32)]
  assert down.layout[3] == ((down.layout[1][0][0], 1),)                          # the Q4_K stack's second layer
  ref = numpy_forward(path, TOKENS)
  tol = 0.02                                                                     # the W8A16 pieces' error
  cache = create_cache(config, 1, 32, jnp.float32)
  full, _ = sequence_logits(config, weights, cache, jnp.asarray([TOKENS], jnp.int32), jnp.zeros((1,), jnp.int32))
  full = np.asarray(full[0])
  assert np.linalg.norm(full - ref) / np.linalg.norm(ref) < tol
  assert (full.argmax(-1) == ref.argmax(-1)).mean() > 0.9
  for kernels in ("xla", "ffi") if ffi.unavailable_reason() is None else ("xla",):
    hidden, _ = jax.jit(lambda c, t: forward(config, weights, c, t, jnp.zeros((1,), jnp.int32), kernels=kernels,
                                             layers="scan"))(cache, jnp.asarray([TOKENS], jnp.int32))
    scanned = np.asarray(logits(weights, hidden, jnp.float32, kernels=kernels)[0])
    assert np.linalg.norm(scanned - ref) / np.linalg.norm(ref) < tol, kernels
  if ffi.unavailable_reason() is None:
    assert np.linalg.norm(_ffi_decode_steps(config, weights, cache) - ref) / np.linalg.norm(ref) < tol
