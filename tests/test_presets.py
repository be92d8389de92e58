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
