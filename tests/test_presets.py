"""The synthetic presets have the published models' shapes, and Llama 3.1's RoPE scaling is HF's."""
import numpy as np
import pytest

from jaxllm.presets import PRESETS
from jaxllm.rope import llama3_rope_freqs, rope_inv_freq

# Parameter counts from the model cards (billions, embeddings included once when tied). qwen2.5-0.5b is left
# out: its preset keeps a separate LM head (as every 0.5B benchmark since 2026-11-29 ran it), where the real
# model ties it to the embedding; a decode step reads the same bytes either way.
PUBLISHED = {"qwen2.5-1.5b": 1.54, "qwen2.5-3b": 3.09, "qwen2.5-7b": 7.62,
             "llama-3.2-1b": 1.24, "llama-3.1-8b": 8.03, "qwen3-8b": 8.19, "qwen2.5-14b": 14.77,
             "qwen3-0.6b": 0.6, "qwen2.5-32b": 32.5}


def _parameters(c) -> int:
  attn = c.d_model * (c.q_dim + 2 * c.kv_dim) + c.q_dim * c.d_model
  bias = c.q_dim + 2 * c.kv_dim if c.qkv_bias else 0
  norms = 2 * c.d_model + (2 * c.head_dim if c.qk_norm else 0)
  layer = attn + bias + 3 * c.d_model * c.d_ff + norms
  embed = c.vocab_size * c.d_model * (1 if c.tied_embeddings else 2)
  return c.n_layers * layer + embed + c.d_model


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_has_the_published_size(name):
  got = _parameters(PRESETS[name]) / 1e9
  assert abs(got - PUBLISHED[name]) < 0.01 * PUBLISHED[name] + 0.006, (name, got)


def test_llama3_rope_scaling_matches_transformers():
  """The divisors written as rope_freqs.weight, applied to the base frequencies, give HF's llama3 inv_freq."""
  torch = pytest.importorskip("torch")
  from transformers import LlamaConfig
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  c = PRESETS["llama-3.1-8b"]
  scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192, "rope_theta": c.rope_base}
  hf = LlamaConfig(hidden_size=c.d_model, num_attention_heads=c.n_heads, head_dim=c.head_dim,
                   max_position_embeddings=c.context_length, rope_theta=c.rope_base, rope_scaling=scaling,
                   rope_parameters=scaling)
  want = ROPE_INIT_FUNCTIONS["llama3"](hf, torch.device("cpu"))[0].double().numpy()
  freqs = llama3_rope_freqs(c)
  got = np.asarray(rope_inv_freq(c, freqs), np.float64)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  f = np.asarray(freqs)
  assert f[0] == 1.0 and f[-1] == 8.0 and (np.diff(f) >= 0).all() and ((f > 1) & (f < 8)).any()


def test_random_weights_carry_llama3_factors():
  from jaxllm.weights import random_weights
  config = PRESETS["llama-3.1-8b"].replace(n_layers=1, vocab_size=256, d_model=256, n_heads=2, n_kv_heads=1,
                                           d_ff=512)
  w = random_weights(config, seed=0)
  assert w.rope_freqs is not None and w.rope_freqs.shape == (config.head_dim // 2,)
  np.testing.assert_array_equal(np.asarray(w.rope_freqs), np.asarray(llama3_rope_freqs(config)))
  assert random_weights(PRESETS["tiny"], seed=0).rope_freqs is None


_DRAW = """
import resource, sys, jax, jax.numpy as jnp, numpy as np
from jaxllm.weights import _randint
jax.block_until_ready(jax.random.randint(jax.random.PRNGKey(1), (8,), 0, 9))   # JAX's own start-up memory
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
shape = tuple(int(a) for a in sys.argv[1:])
q = jax.block_until_ready(_randint(jax.random.PRNGKey(0), shape, -127, 128, jnp.int8))
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
v = np.asarray(q).reshape(-1, shape[-1])
print(grown / q.nbytes, q.dtype, q.shape == shape, v.min(), v.max(), len({r.tobytes() for r in v}) == len(v))
"""


@pytest.mark.parametrize("shape", [(4, 8192, 8192), (151936, 1792)])
def test_large_random_weights_peak_near_their_bytes(shape):
  """A synthetic model's int8 weights are drawn a slice at a time: JAX's threefry draws 32 bits an element, and
  drawing a 1.5B shape's weights whole peaked at 18.8 GB of memory for a 1.9 GB model (a 7B's at ~21 GB on a GPU,
  reported by the bench as the model's peak). In a fresh process (the CPU is the device) the draw of a 256M-
  element array (stacked layers; a vocabulary's rows) grows the peak by at most 1.5 times its bytes (its
  compile included); its values span [-127, 127] and no two rows are equal (one key a slice)."""
  import subprocess
  import sys
  out = subprocess.run([sys.executable, "-c", _DRAW, *map(str, shape)], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  ratio, dtype, same_shape, lo, hi, differ = out.stdout.split()
  assert float(ratio) < 1.5 and dtype == "int8" and same_shape == "True", out.stdout
  assert (int(lo), int(hi), differ) == (-127, 127, "True"), out.stdout


def test_rows_longer_than_a_slice_are_drawn_a_row_at_a_time():
  """Two rows of 17M elements (more than 16 slices in all, each row longer than a slice): one row a block."""
  import jax
  import jax.numpy as jnp
  from jaxllm.weights import _randint
  q = np.asarray(_randint(jax.random.PRNGKey(0), (1, 2, 17 << 20), -127, 128, jnp.int8))
  assert q.shape == (1, 2, 17 << 20) and q.dtype == np.int8 and (q.min(), q.max()) == (-127, 127)
  assert (q[0, 0] != q[0, 1]).mean() > 0.99
