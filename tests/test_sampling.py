"""Device sampling: greedy, temperature, top-k, top-p, checked by their distributions on fresh keys."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.sampling import SamplingParams, sample

N = 20000


def _draws(logits, params, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), N)
  out = jax.vmap(lambda k: sample(jnp.asarray(logits)[None], k, params)[0])(keys)
  return np.bincount(np.asarray(out), minlength=len(logits)) / N


def test_greedy_is_argmax():
  logits = jax.random.normal(jax.random.PRNGKey(1), (7, 1000))
  got = sample(logits, jax.random.PRNGKey(2), SamplingParams())
  np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(logits, -1)))
  assert SamplingParams(temperature=0.9, top_k=1).greedy


def test_temperature_matches_softmax():
  logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
  freq = _draws(logits, SamplingParams(temperature=2.0))
  want = np.exp(logits / 2) / np.exp(logits / 2).sum()
  np.testing.assert_allclose(freq, want, atol=0.015)


def test_top_k_keeps_k_best():
  logits = np.array([1.0, 3.0, 2.0, 0.5, 2.5])
  freq = _draws(logits, SamplingParams(temperature=1.0, top_k=2))
  assert freq[[0, 2, 3]].sum() == 0
  want = np.exp([3.0, 2.5]) / np.exp([3.0, 2.5]).sum()
  np.testing.assert_allclose(freq[[1, 4]], want, atol=0.015)


@pytest.mark.parametrize("top_p, kept", [(0.7, [0, 1]), (0.5, [0]), (0.9, [0, 1, 2]), (1.0, [0, 1, 2, 3])])
def test_top_p_keeps_smallest_nucleus(top_p, kept):
  probs = np.array([0.5, 0.3, 0.15, 0.05])
  freq = _draws(np.log(probs), SamplingParams(temperature=1.0, top_p=top_p))
  want = np.zeros(4)
  want[kept] = probs[kept] / probs[kept].sum()
  np.testing.assert_allclose(freq, want, atol=0.015)


def test_top_k_then_top_p():
  probs = np.array([0.4, 0.3, 0.2, 0.1])
  freq = _draws(np.log(probs), SamplingParams(temperature=1.0, top_k=3, top_p=0.6))
  # top-3 renormalized: 0.444, 0.333, 0.222; nucleus 0.6 keeps the first two
  np.testing.assert_allclose(freq, [4 / 7, 3 / 7, 0, 0], atol=0.015)


def test_seeded_sampling_is_reproducible():
  logits = jax.random.normal(jax.random.PRNGKey(3), (2, 500))
  p = SamplingParams(temperature=1.0, top_p=0.9)
  a = sample(logits, jax.random.PRNGKey(11), p)
  b = sample(logits, jax.random.PRNGKey(11), p)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
