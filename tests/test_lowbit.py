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
from jaxllm.quant import Linear, LowBit, implicit_min_stack, lowbit_bits, lowbit_from_blocks
from jaxllm.weights import load_weights
from tiny import numpy_forward, write_tiny_model

TOKENS = [5, 77, 200, 259, 31, 140, 12, 256, 99, 3, 18, 240, 66]
T = gguf.GGMLQuantizationType
needs_ffi = pytest.mark.skipif(ffi.unavailable_reason() is not None, reason="FFI extension not built")


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


def test_which_stacks_stay_low_bit():
  assert lowbit_bits(["Q4_0", "Q4_1"]) == 4
  assert lowbit_bits(["Q4_1", "Q5_0"]) == 5
  assert lowbit_bits(["Q5_1"]) == 5
  assert lowbit_bits(["Q4_0", "Q8_0"]) is None
  assert lowbit_bits(["Q4_K"]) is None
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


@needs_ffi
@pytest.mark.parametrize("bits", [4, 5])
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("k, n", [(64, 37), (96, 130), (576, 200)])   # 96: an odd number of groups
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cpu_kernel_matches_float64(bits, m, k, n, dtype):
  if jax.default_backend() != "cpu":
    pytest.skip("the low-bit kernel is the CPU's")
  rng = np.random.default_rng(k + n + m + bits)
  lin = _random_lowbit(rng, 3, n, k, bits)
  x = jnp.asarray(rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1)), dtype)
  poison = jnp.full((m, n), jnp.nan, dtype)
  y = np.asarray(jax.jit(lambda x, p: ffi.lowbit_matmul(x, lin, 2, poison=p))(x, poison), np.float64)
  w = _dequant64(lin, 2)
  xf = np.asarray(x.astype(jnp.float32), np.float64)
  want = xf @ w.T
  bound = np.abs(xf) @ np.abs(w).T     # what the products add up to in magnitude
  tol = 2e-4 if dtype == jnp.float32 else 8e-3   # int16 x (2^-15 of each group's largest); bf16 output
  assert np.all(np.isfinite(y))
  assert np.all(np.abs(y - want) <= tol * bound + 1e-6), np.max(np.abs(y - want) / bound)
  # The jnp reference (what the GPU and --kernels xla run) against the same expectation.
  ref = np.asarray(jax.jit(lambda x: linear_reference(x, lin, 2))(x), np.float64)
  assert np.all(np.abs(ref - want) <= tol * bound + 1e-6)


@needs_ffi
@pytest.mark.parametrize("bits", [4, 5])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cpu_kernel_without_stored_min(bits, m, dtype):
  """A stack of Q4_0 or Q5_0 blocks stores no min: both of the kernel's paths (one row, several) take
  -8 or -16 times the scale, against numpy float64 of GGUF's definition."""
  if jax.default_backend() != "cpu":
    pytest.skip("the low-bit kernel is the CPU's")
  rng = np.random.default_rng(40 + bits + m)
  lin = _random_lowbit(rng, 2, 130, 192, bits, store_min=False)
  x = jnp.asarray(rng.standard_normal((m, 192)) * 3, dtype)
  poison = jnp.full((m, 130), jnp.nan, dtype)
  y = np.asarray(jax.jit(lambda x, p: ffi.lowbit_matmul(x, lin, 1, poison=p))(x, poison), np.float64)
  w = _dequant64(lin, 1)
  xf = np.asarray(x.astype(jnp.float32), np.float64)
  bound = np.abs(xf) @ np.abs(w).T
  tol = 2e-4 if dtype == jnp.float32 else 8e-3
  assert np.all(np.abs(y - xf @ w.T) <= tol * bound + 1e-6), np.max(np.abs(y - xf @ w.T) / bound)


@needs_ffi
def test_cpu_kernel_propagates_nonfinite_x():
  if jax.default_backend() != "cpu":
    pytest.skip("the low-bit kernel is the CPU's")
  lin = _random_lowbit(np.random.default_rng(0), 1, 8, 64, 4)
  x = jnp.ones((1, 64), jnp.float32).at[0, 3].set(jnp.nan)
  assert np.all(np.isnan(np.asarray(ffi.lowbit_matmul(x, lin, 0))))


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
    step = jax.jit(lambda c, t, p: sequence_logits(config, weights, c, t, p, kernels="ffi"))
    rows = []
    for i, t in enumerate(TOKENS):
      out, cache = step(cache, jnp.asarray([[t]], jnp.int32), jnp.asarray([i], jnp.int32))
      rows.append(np.asarray(out[0, 0]))
    steps = np.stack(rows)
    assert np.linalg.norm(steps - ref) / np.linalg.norm(ref) < 1e-3
    assert (steps.argmax(-1) == ref.argmax(-1)).all()


def test_gguf_quant_mixed_layers(tmp_path):
  """A stack stays low-bit only where every layer's parts are 4/5-bit blocks: a Q8_0 v makes the fused qkv
  W8A16; Q4_1 and Q5_0 layers share a 5-bit stack; the model still matches the numpy forward closely."""
  types = {"blk.1.attn_v.weight": "Q8_0", "blk.0.ffn_down.weight": "Q5_0", "blk.1.ffn_gate.weight": "Q5_1"}
  path = write_tiny_model(tmp_path / "m.gguf", "llama", tensor_type="Q4_1", tensor_types=types)
  gf = GGUFFile(path)
  config, weights = gf.config, load_weights(gf, quant="gguf", dtype=jnp.float32, progress=False)
  assert isinstance(weights.wqkv, Linear) and weights.wqkv.quantized
  assert isinstance(weights.wo, LowBit) and weights.wo.bits == 4
  assert isinstance(weights.w_down, LowBit) and weights.w_down.bits == 5
  assert isinstance(weights.w_gate_up, LowBit) and weights.w_gate_up.bits == 5
  ref = numpy_forward(path, TOKENS)
  cache = create_cache(config, 1, 32, jnp.float32)
  full, _ = sequence_logits(config, weights, cache, jnp.asarray([TOKENS], jnp.int32), jnp.zeros((1,), jnp.int32))
  assert np.linalg.norm(np.asarray(full[0]) - ref) / np.linalg.norm(ref) < 0.02   # the W8A16 qkv's error
