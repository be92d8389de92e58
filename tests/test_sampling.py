"""Device sampling against independent expectations: numpy argmax, the softmax the settings define (by the
frequencies of many draws), llama.cpp's penalty formula written in numpy; settings as data (one compiled
sampler serves them all) and non-finite logits reported, not sampled."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.sampling import (MAX_LOGIT_BIAS, MAX_REPEAT_LAST_N, MAX_TOP_K, NONFINITE, REPEAT_LAST_N, Sampler,
                             SamplingParams, apply_penalties, bias_table, mask_words, sample, top_candidates,
                             window_of)

N = 20000


def _draws(logits, params):
  """Frequencies of N draws for one row of logits, each draw with its own seed (one compiled call)."""
  logits = np.asarray(logits, np.float32)
  sampler = Sampler.create([params] * N, N, seed=0)
  tokens, _ = jax.jit(sample)(jnp.broadcast_to(jnp.asarray(logits), (N, len(logits))), sampler)
  return np.bincount(np.asarray(tokens), minlength=len(logits)) / N


def test_greedy_is_numpy_argmax():
  rng = np.random.default_rng(1)
  logits = rng.standard_normal((7, 1000)).astype(np.float32)
  for params in (SamplingParams(), SamplingParams(temperature=0.9, top_k=1)):
    for greedy_only in (False, True):
      got, _ = sample(jnp.asarray(logits), Sampler.create(params, 7), greedy_only=greedy_only)
      np.testing.assert_array_equal(np.asarray(got), logits.argmax(-1))


def test_temperature_matches_softmax_over_the_full_vocabulary():
  logits = np.log(np.array([0.5, 0.3, 0.15, 0.05] + [1e-3] * 200))   # tail mass ~0.17: not truncated
  freq = _draws(logits, SamplingParams(temperature=2.0))
  want = np.exp(logits / 2) / np.exp(logits / 2).sum()
  np.testing.assert_allclose(freq[:4], want[:4], atol=0.012)
  assert abs(freq[4:].sum() - want[4:].sum()) < 0.012


def test_top_k_keeps_k_best():
  logits = np.array([1.0, 3.0, 2.0, 0.5, 2.5])
  freq = _draws(logits, SamplingParams(temperature=1.0, top_k=2))
  assert freq[[0, 2, 3]].sum() == 0
  want = np.exp([3.0, 2.5]) / np.exp([3.0, 2.5]).sum()
  np.testing.assert_allclose(freq[[1, 4]], want, atol=0.015)


@pytest.mark.parametrize("top_p, kept", [(0.7, [0, 1]), (0.45, [0]), (0.9, [0, 1, 2]), (1.0, [0, 1, 2, 3])])
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


def test_min_p_drops_tokens_below_its_share_of_the_best():
  probs = np.array([0.5, 0.3, 0.12, 0.08])
  freq = _draws(np.log(probs), SamplingParams(temperature=1.0, min_p=0.2))   # keeps p >= 0.1
  np.testing.assert_allclose(freq, [0.5 / 0.92, 0.3 / 0.92, 0.12 / 0.92, 0], atol=0.015)


def _numpy_penalties(logits, history, r, f, p, last_n=REPEAT_LAST_N):
  """llama.cpp's penalties over the last last_n tokens, written independently."""
  out = logits.astype(np.float64).copy()
  window = list(history[max(0, len(history) - last_n):]) if last_n else []
  for tok in set(window):
    count = window.count(tok)
    x = out[tok]
    x = x / r if x > 0 else x * r
    out[tok] = x - count * f - p
  return out


@pytest.mark.parametrize("r, f, p", [(1.3, 0.0, 0.0), (1.0, 0.4, 0.0), (1.0, 0.0, 0.7), (1.1, 0.2, 0.3)])
def test_penalties_match_llama_cpp_formula(r, f, p):
  rng = np.random.default_rng(7)
  v = 300
  logits = rng.standard_normal((2, v)).astype(np.float32) * 3
  histories = [list(rng.integers(0, 40, 100)), [5, 5, 5, 9]]
  params = SamplingParams(repeat_penalty=r, frequency_penalty=f, presence_penalty=p)
  sampler = Sampler.create(params, 2, history=histories, vocab_size=v)
  got = np.asarray(apply_penalties(jnp.asarray(logits), sampler))
  for b in range(2):
    np.testing.assert_allclose(got[b], _numpy_penalties(logits[b], histories[b], r, f, p), rtol=1e-6, atol=1e-6)
  tokens, _ = sample(jnp.asarray(logits), sampler)
  np.testing.assert_array_equal(np.asarray(tokens), [_numpy_penalties(logits[b], histories[b], r, f, p).argmax()
                                                     for b in range(2)])


def test_window_holds_the_last_tokens():
  hist = list(range(100, 100 + MAX_REPEAT_LAST_N + 70))
  w = window_of(hist, -9)
  assert sorted(w.tolist()) == hist[-MAX_REPEAT_LAST_N:]
  assert [w[i % MAX_REPEAT_LAST_N] for i in range(70, len(hist))] == hist[70:]
  assert sorted(window_of([1, 2, 3], -9).tolist()) == [-9] * (MAX_REPEAT_LAST_N - 3) + [1, 2, 3]


def _candidate_rows(v, ties=False):
  """Rows for the candidates: random, the best in one block, -inf, the top values packed into the last
  blocks; with ties, also rows of many equal values (lax.top_k orders those as the backend decides, the CUDA
  kernel the lower id first)."""
  rng = np.random.default_rng(v)
  x = rng.standard_normal((7 if ties else 4, v)).astype(np.float32) * 3
  x[1, :50] += 10                                  # the best all in one block
  x[2, ::3] = -np.inf
  x[3] = np.sort(x[3])                             # the top values packed into the last blocks
  if ties:
    x[4] = np.round(x[4])                          # ties everywhere
    x[5] = 0.5                                     # one value: the first k ids
    x[6, rng.integers(0, v, 300)] = 7.0            # 300 ties at the top
  return x


@pytest.mark.parametrize("v, k", [(151936, MAX_TOP_K), (49152, 40), (1000, 128), (100, 128), (5000, 1)])
def test_top_candidates_equal_a_full_sort(v, k):
  x = _candidate_rows(v)
  vals, ids = top_candidates(jnp.asarray(x), k)
  want = np.argsort(-x, axis=-1, kind="stable")[:, :min(k, v)]
  np.testing.assert_array_equal(np.asarray(ids), want)
  np.testing.assert_array_equal(np.asarray(vals), np.take_along_axis(x, want, -1))


@pytest.mark.gpu
@pytest.mark.parametrize("v, k", [(151936, MAX_TOP_K), (32003, MAX_TOP_K), (16384, MAX_TOP_K), (49152, 40),
                                  (20000, 1)])
def test_cuda_top_candidates_equal_a_full_sort(v, k):
  """The GPU kernel against numpy's stable sort, every value and id (vals written into a NaN-poisoned buffer)."""
  from jaxllm.kernels import ffi
  x = _candidate_rows(v, ties=True)
  poison = jnp.full((x.shape[0], k), jnp.nan, jnp.float32)
  vals, ids, _ = jax.jit(lambda x, p: ffi.top_candidates(x, k, poison=p))(jnp.asarray(x), poison)
  want = np.argsort(-x, axis=-1, kind="stable")[:, :k]
  np.testing.assert_array_equal(np.asarray(ids), want)
  np.testing.assert_array_equal(np.asarray(vals), np.take_along_axis(x, want, -1))
  untied = _candidate_rows(v)
  _, jnp_ids = jax.jit(lambda x: top_candidates(x, k))(jnp.asarray(untied))   # the jnp path, on the GPU too
  np.testing.assert_array_equal(np.asarray(jnp_ids), np.argsort(-untied, axis=-1, kind="stable")[:, :k])


def _logsumexp64(x):
  x = np.asarray(x, np.float64)
  m = np.max(x, axis=-1, keepdims=True)
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(np.isneginf(m[:, 0]), -np.inf, (m + np.log(np.sum(np.exp(x - m), -1, keepdims=True)))[:, 0])


@pytest.mark.gpu
@pytest.mark.parametrize("v", [151936, 32003, 16384])
def test_cuda_candidates_logsumexp(v):
  """The kernel's logsumexp against numpy's in float64: random rows, large values, -inf entries, a row of
  -inf (-inf), and rows with NaN or inf (NaN: such rows sample no token)."""
  from jaxllm.kernels import ffi
  x = _candidate_rows(v)
  big = x[0] + 80.0                                # exp would overflow without the maximum taken out
  rows = np.concatenate([x, big[None], np.full((1, v), -np.inf, np.float32), x[:2]]).astype(np.float32)
  rows[-2, 777] = np.nan
  rows[-1, 5] = np.inf
  _, _, lse = jax.jit(lambda x: ffi.top_candidates(x, MAX_TOP_K))(jnp.asarray(rows))
  lse = np.asarray(lse)
  want = _logsumexp64(rows[:-2])
  np.testing.assert_allclose(lse[:-3], want[:-1], rtol=2e-6)
  assert lse[-3] == -np.inf
  assert np.isnan(lse[-2]) and np.isnan(lse[-1])


@pytest.mark.gpu
def test_sample_draws_the_same_tokens_on_the_kernel_path():
  """With the same keys and tie-free logits, the FFI path (candidates from the CUDA kernel) draws what the
  jnp path draws, for every kind of setting."""
  x = jnp.asarray(_candidate_rows(151936)[:, None, :].repeat(4, 1).reshape(16, 151936))
  rows = [SamplingParams(temperature=0.7, top_p=0.9, seed=1), SamplingParams(temperature=1.0, top_k=40, seed=2),
          SamplingParams(temperature=0.8, min_p=0.05, seed=3), SamplingParams(temperature=1.2, seed=4)] * 4
  smp = Sampler.create(rows, 16)
  want, _ = jax.jit(lambda x, s: sample(x, s))(x, smp)
  got, _ = jax.jit(lambda x, s: sample(x, s, kernels="ffi"))(x, smp)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_candidates_take_the_jnp_path_where_no_kernel_runs(lab_switches):
  from jaxllm.sampling import candidates
  x = _candidate_rows(20000)
  want = np.argsort(-x, axis=-1, kind="stable")[:, :MAX_TOP_K]
  for env in ("0", "1"):
    lab_switches.setenv("JAXLLM_CANDIDATES_KERNEL", env)
    for kernels in ("xla", "ffi"):
      _, ids, lse = candidates(jnp.asarray(x), MAX_TOP_K, kernels)
      np.testing.assert_array_equal(np.asarray(ids), want)
      np.testing.assert_allclose(np.asarray(lse), _logsumexp64(x), rtol=2e-6)
  lab_switches.setenv("JAXLLM_CANDIDATES_KERNEL", "yes")
  with pytest.raises(ValueError, match="JAXLLM_CANDIDATES_KERNEL must be 0 or 1"):
    candidates(jnp.asarray(x), MAX_TOP_K, "ffi")


def test_leaving_out_unset_penalties_draws_the_same_tokens():
  """penalties=False (a promise that no row has a penalty, as the greedy argmax step makes) draws what the
  full path draws."""
  x = jnp.asarray(_candidate_rows(5000))
  rows = [SamplingParams(temperature=0.7, top_p=0.9, seed=1), SamplingParams(temperature=1.0, top_k=40, seed=2),
          SamplingParams(temperature=0.8, min_p=0.05, seed=3), SamplingParams(temperature=1.2, seed=4)]
  smp = Sampler.create(rows, 4, history=[[1, 2, 3]] * 4, vocab_size=5000)
  want, _ = sample(x, smp)
  got, _ = sample(x, smp, penalties=False)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_greedy_mode_names_the_step_a_batch_needs():
  from jaxllm.programs import _step_flags, greedy_mode
  plain, pen = SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=0.7, repeat_penalty=1.1)
  cases = [([SamplingParams()], True, {"greedy_only": True, "penalties": False}),
           ([SamplingParams(repeat_penalty=1.1)], "penalized", {"greedy_only": True, "penalties": True}),
           ([plain, SamplingParams()], "sampled", {"greedy_only": False, "penalties": False}),
           ([plain, SamplingParams(presence_penalty=0.5)], False, {"greedy_only": False, "penalties": True}),
           ([pen], False, {"greedy_only": False, "penalties": True}),
           ([SamplingParams(repeat_penalty=1.3, repeat_last_n=0)], True, {"greedy_only": True, "penalties": False}),
           ([plain, SamplingParams(temperature=0.7, top_k=MAX_TOP_K + 1)], "wide",
            {"greedy_only": False, "penalties": False}),
           ([pen, SamplingParams(temperature=0.7, top_k=10 ** 6)], "wide-penalized",
            {"greedy_only": False, "penalties": True}),
           ([SamplingParams(top_k=500), SamplingParams(temperature=0.7, top_k=MAX_TOP_K)], "sampled",
            {"greedy_only": False, "penalties": False})]     # a greedy row's top_k is never drawn from
  for rows, mode, flags in cases:
    assert greedy_mode(rows) == mode and type(greedy_mode(rows)) is type(mode)
    assert _step_flags(mode) == flags
    assert Sampler.create(rows, len(rows)).wide_top_k == (mode in ("wide", "wide-penalized"))


def test_a_row_is_drawn_the_same_in_any_batch():
  """Each row has its own key: its draw does not depend on the other rows or its position."""
  rng = np.random.default_rng(3)
  logits = rng.standard_normal((4, 500)).astype(np.float32)
  p = [SamplingParams(temperature=1.0, top_p=0.9, seed=s) for s in (11, 12, 13, 14)]
  together, _ = sample(jnp.asarray(logits), Sampler.create(p, 4))
  alone = [int(sample(jnp.asarray(logits[b:b + 1]), Sampler.create([p[b]], 1))[0][0]) for b in range(4)]
  assert np.asarray(together).tolist() == alone
  swapped, _ = sample(jnp.asarray(logits[::-1]), Sampler.create(p[::-1], 4))
  assert np.asarray(swapped).tolist() == alone[::-1]
  other, _ = sample(jnp.asarray(logits), Sampler.create([SamplingParams(temperature=1.0, seed=s) for s in
                                                         (21, 22, 23, 24)], 4))
  assert np.asarray(other).tolist() != alone


def test_non_finite_logits_are_reported_not_sampled():
  logits = np.zeros((3, 50), np.float32)
  logits[0, 7] = np.nan
  logits[1, 3] = np.inf
  logits[2, 9] = 5.0
  for params in (SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9)):
    got, _ = sample(jnp.asarray(logits), Sampler.create(params, 3))
    assert np.asarray(got).tolist()[:2] == [NONFINITE, NONFINITE]
    assert 0 <= int(got[2]) < 50


def test_one_compiled_sampler_serves_every_setting():
  """Settings are arrays: a jitted sample() compiles once for any temperature, top-k, top-p or seed."""
  def draw(logits, sampler):      # a function of its own: jit's cache then holds this test's entries only
    return sample(logits, sampler)
  fn = jax.jit(draw)
  logits = jnp.asarray(np.random.default_rng(0).standard_normal((2, 100)), jnp.float32)
  for params in (SamplingParams(temperature=0.7, top_p=0.9, seed=1), SamplingParams(temperature=1.3, top_k=5),
                 SamplingParams(min_p=0.1, temperature=0.5, repeat_penalty=1.2)):
    fn(logits, Sampler.create(params, 2))
  assert fn._cache_size() == 1


@pytest.mark.parametrize("kw, msg", [
    (dict(temperature=-1.0), r"temperature must be 0 \(greedy\) or a number in \[0.001, 1000.0\], got -1.0"),
    (dict(temperature=float("nan")), r"temperature must be 0 \(greedy\) or a number in \[0.001, 1000.0\], got nan"),
    (dict(temperature=1e-38), r"temperature must be 0 \(greedy\) or a number in \[0.001, 1000.0\], got 1e-38"),
    (dict(top_k=-3), r"top_k must be an integer in \[0, 2147483647\] \(0 = off; at least the vocabulary keeps "
                     r"every token\), got -3"),
    (dict(top_k=2.5), r"top_k must be an integer in \[0, 2147483647\] .*, got 2.5"),
    (dict(top_k=2 ** 31), r"top_k must be an integer in \[0, 2147483647\]"),
    (dict(repeat_last_n=-1), r"repeat_last_n must be an integer in \[0, 4096\] \(the last tokens the penalties "
                             r"look at; 0 = penalties off\), got -1"),
    (dict(repeat_last_n=4097), r"repeat_last_n must be an integer in \[0, 4096\] .*, got 4097"),
    (dict(repeat_last_n=True), r"repeat_last_n must be an integer in \[0, 4096\] .*, got True"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(min_p=1.0), r"min_p must be in \[0, 1\), got 1.0"),
    (dict(repeat_penalty=0.0), r"repeat_penalty must be a number in \[0.01, 100.0\] \(1 = off\), got 0.0"),
    (dict(repeat_penalty=1e-38), r"repeat_penalty must be a number in \[0.01, 100.0\] \(1 = off\), got 1e-38"),
    (dict(repeat_penalty=1e9), r"repeat_penalty must be a number in \[0.01, 100.0\]"),
    (dict(presence_penalty=float("inf")), r"presence_penalty must be a number in \[-100.0, 100.0\] \(0 = off\)"),
    (dict(frequency_penalty=-1e30), r"frequency_penalty must be a number in \[-100.0, 100.0\] \(0 = off\)"),
    (dict(seed=-1), r"seed must be an integer in \[0, 2\^63\) or None, got -1"),
])
def test_bad_sampling_values(kw, msg):
  with pytest.raises(ValueError, match=msg):
    SamplingParams(**kw)


# Top-k beyond the candidates (issue 37, item 7) -----------------------------------------------------

def _kept_by_numpy(x, top_k=0, top_p=1.0, min_p=0.0):
  """The tokens top-k, top-p on what it left, then min-p keep, in float64 over a stable sort (equal values:
  the lower id first)."""
  order = np.argsort(-x, kind="stable")
  k = len(x) if top_k <= 0 else min(top_k, len(x))
  vals = x[order[:k]].astype(np.float64)
  p = np.exp(vals - vals.max())
  p /= p.sum()
  keep = (np.cumsum(p) - p < top_p) & (p >= min_p * p[0])
  return set(order[:k][keep].tolist())


def test_top_k_beyond_the_candidates_draws_exactly_from_the_top_k():
  """top_k 300 of 400 random logits: every draw among the 300 best, ranks past MAX_TOP_K drawn as often as the
  distribution top-k defines (a chi-square over the 300 tokens); it was refused (at most 128) before."""
  rng = np.random.default_rng(11)
  logits = rng.standard_normal(400) * 0.7
  params = SamplingParams(temperature=1.0, top_k=300)
  from jaxllm.programs import greedy_mode
  assert greedy_mode(params) == "wide"
  freq = _draws(logits, params)
  order = np.argsort(-logits)
  assert freq[order[300:]].sum() == 0
  p = np.exp(logits[order[:300]] - logits.max())
  p /= p.sum()
  assert abs(freq[order[MAX_TOP_K:300]].sum() - p[MAX_TOP_K:].sum()) < 0.01 and p[MAX_TOP_K:].sum() > 0.2
  chi2 = np.sum((freq[order[:300]] - p) ** 2 / p) * N
  assert chi2 < 299 + 6 * np.sqrt(2 * 299), chi2


def test_wide_keep_is_the_rule_over_the_whole_vocabulary():
  """The wide step's kept set against numpy's float64 (random rows and rows of ties; top-k, top-p, min-p and
  their mixes; k up to past V), and the draw: ties at the k-th value kept lower ids first."""
  from jaxllm.sampling import wide_keep
  rng = np.random.default_rng(5)
  v = 3000
  x = (rng.standard_normal((4, v)) * 2).astype(np.float32)
  x[1] = np.round(x[1])                        # a few values, thousands of ties
  x[2] = 0.25                                  # one value
  x[3, :500] = 9.0                             # 500 ties at the top
  settings = [(200, 1.0, 0.0), (2999, 1.0, 0.0), (v + 10, 1.0, 0.0), (0, 0.97, 0.0), (1000, 0.9, 0.0),
              (700, 1.0, 0.002), (1500, 0.95, 0.001), (129, 0.5, 0.0)]
  for top_k, top_p, min_p in settings:
    rows = lambda a: jnp.full((4,), a)    # noqa: E731
    got = np.asarray(wide_keep(jnp.asarray(x), rows(top_k).astype(jnp.int32), rows(top_p).astype(jnp.float32),
                               rows(min_p).astype(jnp.float32)))
    for b in range(4):
      if b == 2 and top_p < 1:      # a uniform row's nucleus ends on a sum equal to top_p: f32 rounding decides
        continue
      want = _kept_by_numpy(x[b], top_k, top_p, min_p)
      assert set(np.flatnonzero(got[b]).tolist()) == want, (b, top_k, top_p, min_p)
  freq = _draws(np.zeros(300), SamplingParams(temperature=1.0, top_k=150))    # all equal: the first 150 ids
  assert freq[150:].sum() == 0 and freq[:150].min() > 0


def test_top_k_at_least_the_vocabulary_draws_what_no_top_k_draws():
  """llama.cpp's rule: k >= V keeps every token; the wide step then draws exactly top_k 0's token."""
  logits = jnp.asarray(np.random.default_rng(2).standard_normal((64, 500)), jnp.float32)
  off = [SamplingParams(temperature=0.8, seed=s) for s in range(64)]
  full = [SamplingParams(temperature=0.8, top_k=500 + s, seed=s) for s in range(64)]
  want, _ = sample(logits, Sampler.create(off, 64))
  got, _ = sample(logits, Sampler.create(full, 64))
  assert Sampler.create(full, 64).wide_top_k
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_wide_step_leaves_the_other_rows_draws_alone():
  """A row whose top_k exceeds the candidates puts its batch on the wide step; every other row draws there
  what it draws on the candidate step (the same keys, the same candidates)."""
  import dataclasses
  x = jnp.asarray(_candidate_rows(5000))
  rows = [SamplingParams(temperature=0.7, top_p=0.9, seed=1), SamplingParams(temperature=1.0, top_k=40, seed=2),
          SamplingParams(temperature=0.8, min_p=0.05, seed=3), SamplingParams(temperature=1.2, top_k=1000, seed=4)]
  wide = Sampler.create(rows, 4)
  assert wide.wide_top_k
  narrow = dataclasses.replace(wide, wide_top_k=False)
  a, _ = sample(x, wide)
  b, _ = sample(x, narrow)
  np.testing.assert_array_equal(np.asarray(a)[:3], np.asarray(b)[:3])
  assert np.asarray(a)[3] in np.argsort(-np.asarray(x[3]) / 1.2, kind="stable")[:1000]


def test_the_wide_step_compiles_once_under_its_own_key(tiny_models):
  """A request with a top_k above the candidates compiles the wide prefill and decode programs (their keys
  name the mode), which then serve every such k; the candidate step's executables stay as they were."""
  import jaxllm
  from jaxllm.engine import Engine
  config, weights, tok = jaxllm.load(tiny_models["qwen2"], progress=False, dtype=jnp.float32)
  engine = Engine(config, weights, tok, max_context=64, kernels="xla", dtype=jnp.float32)
  prompt = [5, 6, 7, 5, 6, 9, 11, 5]
  engine.generate(prompt, 8, SamplingParams(temperature=1.0, top_k=40, seed=1), ignore_eos=True)
  before = engine.executables()
  out = engine.generate(prompt, 8, SamplingParams(temperature=1.0, top_k=200, seed=1), ignore_eos=True)
  keys = set(engine.executables()) - set(before)
  assert keys and all("wide" in key for key in keys) and set(before) <= set(engine.executables()), keys
  assert any(key[0] == "prefill" for key in keys) and any(key[0] in ("step", "steps") for key in keys)
  assert len(out.ids) == 8 and all(0 <= t < config.vocab_size for t in out.ids)
  n = len(engine.executables())
  engine.generate(prompt, 8, SamplingParams(temperature=0.5, top_k=260, top_p=0.9, seed=2), ignore_eos=True)
  assert len(engine.executables()) == n


# The penalty window as data (issue 37, item 7) ------------------------------------------------------

def test_penalties_look_at_each_rows_last_n_tokens_in_one_executable():
  """Every row its own window length (0 to MAX_REPEAT_LAST_N, histories shorter and longer than the window),
  against numpy's float64 over history[-N:]; after new tokens are pushed (one row inactive) and with other
  lengths, the same executable: no compile (repeat_last_n was fixed at 64 before)."""
  import dataclasses
  rng = np.random.default_rng(9)
  v = 5000
  lengths = [0, 1, 7, 64, 100, 1000, MAX_REPEAT_LAST_N, MAX_REPEAT_LAST_N]
  hist_lens = [50, 3000, 5, 6000, 90, 2500, MAX_REPEAT_LAST_N + 777, 4000]
  histories = [rng.integers(0, v // 10 if i % 2 else v, n).tolist() for i, n in enumerate(hist_lens)]
  logits = (rng.standard_normal((8, v)) * 3).astype(np.float32)
  r, f, p = 1.3, 0.2, 0.3
  fn = jax.jit(apply_penalties)

  def check(histories, lengths, sampler):
    got = np.asarray(fn(jnp.asarray(logits), jax.device_put(sampler)))
    for b, (hist, n) in enumerate(zip(histories, lengths)):
      np.testing.assert_allclose(got[b], _numpy_penalties(logits[b], hist, r, f, p, n), rtol=1e-6, atol=1e-5)

  rows = [SamplingParams(repeat_penalty=r, frequency_penalty=f, presence_penalty=p, repeat_last_n=n) for n in lengths]
  sampler = Sampler.create(rows, 8, history=histories, vocab_size=v)
  check(histories, lengths, sampler)
  new = rng.integers(0, v, 8)
  active = np.arange(8) != 2
  pushed = jax.jit(Sampler.push)(sampler, jnp.asarray(new, jnp.int32), jnp.asarray(hist_lens, jnp.int32),
                                 jnp.asarray(active))
  compiles = []

  def listen(event, secs, **kw):
    if "backend_compile" in event:
      compiles.append(event)
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    check([h + [int(t)] if a else h for h, t, a in zip(histories, new, active)], lengths, pushed)
    other = lengths[::-1]
    rows = [dataclasses.replace(row, repeat_last_n=n) for row, n in zip(rows, other)]
    check(histories, other, Sampler.create(rows, 8, history=histories, vocab_size=v))
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert not compiles


def test_penalty_window_lengths_do_not_recompile_the_engine(tiny_models):
  """Requests with other --repeat-last-n values run on the executables the first compiled, and each token is
  the greedy argmax of the model's logits (one scoring pass over the sequence) penalized by numpy over the
  request's own last N tokens."""
  import jaxllm
  from jaxllm.engine import Engine
  config, weights, tok = jaxllm.load(tiny_models["qwen2"], progress=False, dtype=jnp.float32)
  engine = Engine(config, weights, tok, max_context=96, kernels="xla", dtype=jnp.float32)
  prompt = [5, 6, 7, 5, 6, 9, 11, 5]
  pen = [SamplingParams(repeat_penalty=5.0, presence_penalty=1.0, repeat_last_n=n) for n in (3, 40)]
  engine.generate(prompt, 12, pen[0], ignore_eos=True)
  before = engine.executables()
  compiles = []

  def listen(event, secs, **kw):
    if "backend_compile" in event:
      compiles.append(event)
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    outs = [engine.generate(prompt, 12, p, ignore_eos=True) for p in pen]
    assert engine.executables() == before and not compiles
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  score = jax.jit(lambda w, c, t: jaxllm.sequence_logits(config, w, c, t, jnp.zeros((1,), jnp.int32)))
  for out, p in zip(outs, pen):
    seq = prompt + out.ids
    cache = jaxllm.create_cache(config, batch=1, max_len=96, dtype=jnp.float32)
    logits = np.asarray(score(weights, cache, jnp.asarray([seq]))[0][0])            # [T, V]
    for i, t in enumerate(out.ids[1:], start=len(prompt)):
      want = _numpy_penalties(logits[i], seq[:i + 1], 5.0, 0.0, 1.0, p.repeat_last_n).argmax()
      assert t == want, (p.repeat_last_n, i)
  assert outs[0].ids != outs[1].ids


def test_bias_table_takes_numbers_and_refuses_the_rest():
  """Biases are any real number in [-100, 100] (numpy's floats and ints too), never a bool or NaN; ids integers
  in [0, V). Each row's pairs come first, the unused ones after (id past any vocabulary, bias 0)."""
  ids, values = bias_table([{np.int64(3): np.float32(-2.5), 7: 100}, None, {0: np.float16(1)}], 3, 10)
  assert ids.shape == values.shape == (3, MAX_LOGIT_BIAS) and ids.dtype == np.int32 and values.dtype == np.float32
  assert ids[0, :2].tolist() == [3, 7] and values[0, :2].tolist() == [-2.5, 100.0] and values[2, 0] == 1.0
  assert (ids[1] >= 10).all() and not values[1].any() and (ids[0, 2:] >= 10).all()
  for row in [{1: True}, {1: np.bool_(True)}, {1: "5"}, {1: float("nan")}, {1: 100.5}, {1: np.float32(-101)},
              {-1: 1.0}, {10: 1.0}, {True: 1.0}, {1.0: 1.0}, {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}]:
    with pytest.raises(ValueError):
      bias_table([row], 1, 10 if len(row) == 1 else 0)
  with pytest.raises(ValueError):
    bias_table([None], 2, 10)


def test_a_grammar_mask_wins_over_a_plus_100_bias():
  """Fresh random logits and masks, +100 on a masked-out token of each row (and a small bias on allowed ones):
  greedy draws numpy's argmax of the biased logits over the allowed tokens, sampled ones stay allowed; without
  the mask the +100 token is drawn (the check has teeth)."""
  rng = np.random.default_rng(5)
  b, v = 8, 1000
  logits = rng.standard_normal((b, v)).astype(np.float32)
  bits = rng.random((b, mask_words(v) * 32)) < 0.3
  bits[:, v:] = True
  masks = np.packbits(bits, axis=1, bitorder="little").view("<u4").astype(np.uint32)
  allowed = bits[:, :v]
  biases, biased = [], logits.copy()
  for r in range(b):
    banned, ok = rng.choice(np.flatnonzero(~allowed[r])), rng.choice(np.flatnonzero(allowed[r]))
    biases.append({int(banned): 100.0, int(ok): np.float32(1.5)})
    biased[r, banned] += 100.0
    biased[r, ok] += np.float32(1.5)
  want = np.where(allowed, biased, -np.inf).argmax(-1)
  for params in (SamplingParams(), SamplingParams(temperature=1.0)):
    got, _ = jax.jit(sample)(jnp.asarray(logits), Sampler.create(params, b, seed=3, vocab_size=v, masks=masks,
                                                                 biases=biases))
    got = np.asarray(got)
    assert allowed[np.arange(b), got].all()
    if params.temperature == 0:
      np.testing.assert_array_equal(got, want)
  got, _ = sample(jnp.asarray(logits), Sampler.create(SamplingParams(), b, vocab_size=v, biases=biases))
  np.testing.assert_array_equal(np.asarray(got), [max(row, key=row.get) for row in biases])
