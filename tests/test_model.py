"""The JAX model against an independent numpy float64 forward, and decode against prefill."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import GGUFFile, Tokenizer, create_cache, sequence_logits
from jaxllm.weights import load_weights
from tiny import numpy_forward, write_tiny_model

TOKENS = [5, 77, 200, 259, 31, 140, 12, 256, 99, 3, 18, 240, 66, 130, 8, 201, 44, 90, 257]


def _load(path, quant="none"):
  gf = GGUFFile(path)
  return gf.config, load_weights(gf, quant=quant, dtype=jnp.float32, progress=False)


def _prefill_logits(config, weights, tokens, max_len=32):
  cache = create_cache(config, 1, max_len, jnp.float32)
  run = jax.jit(lambda w, c, t, p: sequence_logits(config, w, c, t, p))   # compiled whole, not op by op
  out, _ = run(weights, cache, jnp.asarray([tokens], jnp.int32), jnp.zeros((1,), jnp.int32))
  return np.asarray(out[0])


def _stepwise_logits(config, weights, tokens, max_len=32):
  cache = create_cache(config, 1, max_len, jnp.float32)
  step = jax.jit(lambda c, t, p: sequence_logits(config, weights, c, t, p))
  rows = []
  for i, t in enumerate(tokens):
    out, cache = step(cache, jnp.asarray([[t]], jnp.int32), jnp.asarray([i], jnp.int32))
    rows.append(np.asarray(out[0, 0]))
  return np.stack(rows)


def _rel(a, b):
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_prefill_matches_numpy_float64(tiny_path):
  config, weights = _load(tiny_path)
  ours = _prefill_logits(config, weights, TOKENS)
  ref = numpy_forward(tiny_path, TOKENS)
  assert _rel(ours, ref) < 1e-5, _rel(ours, ref)
  assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_decode_matches_prefill(tiny_path):
  """Step-by-step decode (the decode-attention path, T=1) equals one prefill of the whole sequence."""
  config, weights = _load(tiny_path)
  full = _prefill_logits(config, weights, TOKENS)
  steps = _stepwise_logits(config, weights, TOKENS)
  assert _rel(steps, full) < 1e-5, _rel(steps, full)
  np.testing.assert_allclose(steps, full, rtol=1e-4, atol=1e-4)


def test_decode_matches_prefill_w8a16(tiny_path):
  config, weights = _load(tiny_path, quant="w8a16")
  full = _prefill_logits(config, weights, TOKENS)
  steps = _stepwise_logits(config, weights, TOKENS)
  np.testing.assert_allclose(steps, full, rtol=1e-4, atol=1e-4)


def test_w8a16_close_to_float(tiny_path):
  config, wf = _load(tiny_path)
  _, wq = _load(tiny_path, quant="w8a16")
  lf, lq = _prefill_logits(config, wf, TOKENS), _prefill_logits(config, wq, TOKENS)
  assert _rel(lq, lf) < 0.05, _rel(lq, lf)


@pytest.mark.parametrize("tensor_type", ["F16", "Q8_0"])
def test_quantized_gguf_types_match_numpy(tmp_path, tensor_type):
  path = write_tiny_model(tmp_path / "m.gguf", "qwen2", tensor_type=tensor_type)
  config, weights = _load(path)
  assert _rel(_prefill_logits(config, weights, TOKENS), numpy_forward(path, TOKENS)) < 1e-5


def test_linear_rope_scaling_matches_numpy(tmp_path):
  path = write_tiny_model(tmp_path / "m.gguf", "llama", rope_scale=4.0)
  config, weights = _load(path)
  assert config.rope_scaling == "linear" and config.rope_scale == 4.0
  assert _rel(_prefill_logits(config, weights, TOKENS), numpy_forward(path, TOKENS)) < 1e-5


def test_config_from_metadata(tiny_models):
  for arch, path in tiny_models.items():
    c = GGUFFile(path).config
    assert c.arch == arch and c.n_layers == 2 and c.n_heads == 4 and c.n_kv_heads == 2
    assert c.tied_embeddings == (arch == "llama")
    assert c.qkv_bias == (arch == "qwen2") and c.qk_norm == (arch == "qwen3")
    assert c.rope_style == ("normal" if arch == "llama" else "neox")
    assert Tokenizer(GGUFFile(path).metadata).eog_ids >= {c.eos_id}


def _run_layers(config, weights, layers, kernels, prompt=12):
  """Logits of a prefill of TOKENS[:prompt] (T > 1), then of each later token decoded alone (T = 1)."""
  cache = create_cache(config, 1, 32, jnp.float32)
  run = jax.jit(lambda c, t, p: sequence_logits(config, weights, c, t, p, kernels=kernels, layers=layers))
  full, cache = run(cache, jnp.asarray([TOKENS[:prompt]], jnp.int32), jnp.zeros((1,), jnp.int32))
  rows = []
  for i in range(prompt, len(TOKENS)):
    out, cache = run(cache, jnp.asarray([[TOKENS[i]]], jnp.int32), jnp.asarray([i], jnp.int32))
    rows.append(np.asarray(out[0, 0]))
  return np.asarray(full[0]), np.stack(rows), np.asarray(cache.k)


@pytest.mark.parametrize("quant, kernels", [("none", "xla"), ("w8a16", "xla"), ("w8a16", "ffi")])
def test_scanned_layers_match_unrolled(tiny_path, quant, kernels):
  """The layers under lax.scan (the CPU's default) compute what the unrolled loop does, in prefill and in
  decode (a traced layer index into the cache): the same logits to f32 rounding, the same cache."""
  config, weights = _load(tiny_path, quant)
  scanned, unrolled = _run_layers(config, weights, "scan", kernels), _run_layers(config, weights, "unrolled", kernels)
  for a, b in zip(scanned, unrolled):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_cpu_default_scans_the_layers(tiny_models):
  """On the CPU the functional API's prefill and decode step run their layers under one lax.scan (they
  compile in a fraction of the unrolled time); layers="unrolled" keeps the Python loop (as the GPU does)."""
  from jaxllm import Sampler, SamplingParams, decode_step, prefill
  config, weights = _load(tiny_models["llama"])
  cache = create_cache(config, 1, 32, jnp.float32)
  sampler = Sampler.create(SamplingParams(), batch=1)

  def scans(**kw):
    state = jax.eval_shape(lambda c: prefill(config, weights, c, jnp.ones((1, 8), jnp.int32),
                                             jnp.asarray([8], jnp.int32), sampler, **kw), cache)
    pre = str(jax.make_jaxpr(lambda c: prefill(config, weights, c, jnp.ones((1, 8), jnp.int32),
                                               jnp.asarray([8], jnp.int32), sampler, **kw))(cache))
    step = str(jax.make_jaxpr(lambda s: decode_step(config, weights, s, **kw))(state))
    return pre.count(" scan["), step.count(" scan[")
  if jax.default_backend() == "cpu":
    assert scans() == (1, 1)
  assert scans(layers="scan") == (1, 1)
  assert scans(layers="unrolled") == (0, 0)
  with pytest.raises(ValueError, match="layers must be one of"):
    scans(layers="rolled")


@pytest.mark.parametrize("quant", ["w8a16", "none"])
def test_conversion_in_row_blocks_on_threads_equals_whole_tensors(tmp_path, monkeypatch, quant):
  """convert() splits each tensor into row blocks that threads convert at once: with blocks of 3 rows (most
  tensors end in a partial block) on 4 threads, every array equals its whole tensors converted in one go
  (q, k, v and gate, up fused in row order; every layer; the embedding and untied head)."""
  from jaxllm import quant as q
  from jaxllm import weights as w
  path = write_tiny_model(tmp_path / "m.gguf", "qwen2", tensor_type="Q8_0", n_layers=3)
  gf = GGUFFile(path)
  c = gf.config
  monkeypatch.setattr(w, "BLOCK", 3 * c.d_model)
  monkeypatch.setattr(w, "pool_threads", lambda: 4)
  progress = []
  got = w.convert(gf, quant, jnp.float32, on_progress=progress.append)
  assert sum(progress) == w.progress_total(c)
  whole = (lambda a: (a,)) if quant == "none" else q.quantize_int8
  parts = {"wqkv": ("attn_q", "attn_k", "attn_v"), "wo": ("attn_output",), "w_gate_up": ("ffn_gate", "ffn_up"),
           "w_down": ("ffn_down",)}
  for name, tensors in parts.items():
    for i in range(c.n_layers):
      want = whole(np.concatenate([gf.tensor(f"blk.{i}.{t}.weight") for t in tensors]))
      assert np.array_equal(got[name + ".w"][i], want[0]), (name, i)
      if quant != "none":
        assert np.array_equal(got[name + ".scale"][i], want[1]), (name, i)
  for tensor, name in (("token_embd.weight", "embed"), ("output.weight", "head")):
    if tensor in gf.tensor_names():
      want = whole(gf.tensor(tensor))
      assert np.array_equal(got[name + ".w"], want[0]), name
      if quant != "none":
        assert np.array_equal(got[name + ".scale"], want[1]), name


def test_a_prefill_program_holds_one_layers_dequantized_weights_at_a_time(monkeypatch):
  """XLA's dot on dequantized W8A16 weights (prefill chunks past the kernels' rows, --kernels xla): the backend's
  default prefill program holds about one layer's dequantized weights at a time, not every layer's. The
  compiler's own accounting of the program's temporaries. On the GPU (unrolled layers) that is the barrier in
  linear_reference, shown by taking it away; on the CPU the scanned layers hold one layer's whatever the barrier."""
  import math

  from jaxllm.decode import extend
  from jaxllm.load import default_dtype
  from jaxllm.presets import preset
  from jaxllm.weights import random_weights
  config = preset("smollm2-135m").replace(n_layers=8, vocab_size=256)
  weights = random_weights(config, seed=0)
  dtype = default_dtype()
  cache = create_cache(config, 1, 72, dtype)
  args = (jnp.zeros((1, 64), jnp.int32), jnp.full((1,), 64, jnp.int32), jnp.zeros((1,), jnp.int32))

  def temporaries():
    run = jax.jit(lambda w, c, t, n, s: extend(config, w, c, t, n, s, kernels="xla"))
    return run.lower(weights, cache, *args).compile().memory_analysis().temp_size_in_bytes

  stacked = [a for a in jax.tree.leaves(weights) if a.dtype == jnp.int8 and a.ndim == 3 and a.shape[0] == 8]
  assert len(stacked) == 4   # q/k/v, o, gate/up, down
  one_layer = sum(math.prod(a.shape[1:]) for a in stacked) * jnp.dtype(dtype).itemsize
  assert temporaries() < 2 * one_layer, one_layer
  if jax.default_backend() == "gpu":
    monkeypatch.setattr(jax.lax, "optimization_barrier", lambda t: t)
    assert temporaries() > 4 * one_layer, one_layer
