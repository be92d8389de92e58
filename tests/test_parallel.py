"""Tensor parallel (jaxllm.parallel) on 1, 2 and 4 simulated CPU devices against one device: the forward's
hidden states, the cache it writes and the logits agree to f32 rounding, and the greedy tokens are the same,
for each family's features (QKV bias, q/k norms, llama3 RoPE factors and a tied head), on the FFI path and (some)
the XLA path, W8A16 and float, with KV heads both split (G >= N) and replicated (G < N); and an Engine's tokens,
batched, over prefill chunks, greedy and penalized. A model that does not split is a
ValueError saying what does not divide.

The devices are XLA's host-platform count, which must be set before jax starts: tests/parallel_check.py runs in
a process of its own.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The module's tests share a costly module fixture: under xdist one worker runs them all, setting it up once
# (bench/gpu_check.sh runs --dist loadgroup).
pytestmark = pytest.mark.xdist_group("parallel")

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def results():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, str(HERE / "parallel_check.py")], capture_output=True, text=True, env=env,
                        cwd=HERE.parent, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_sharded_forward_equals_one_device(results):
  cases = [r for r in results if "family" in r]
  assert {(r["family"], r["n"]) for r in cases} == {(f, n) for f in ("qwen2", "qwen3", "llama") for n in (1, 2, 4)}
  assert {(r["kernels"], r["quant"]) for r in cases} == {("ffi", "w8a16"), ("xla", "w8a16"), ("xla", "none")}
  for r in cases:
    assert r["sharded"], r                                       # the weights and the cache are on n devices
    assert r["hidden"] < 2e-5 and r["k"] < 2e-5 and r["v"] < 2e-5, r   # f32 rounding (sums in another order)
    assert r["logits"] < 1e-5 * max(1.0, r["logits_scale"]), r
    assert r["argmax_same"], r
    if r["n"] == 1:
      assert r["hidden"] == r["logits"] == 0.0, r                 # one shard: the same program


def test_greedy_tokens_from_each_shards_argmax(results):
  """The vocabulary-parallel greedy head gives the argmax of the gathered logits (W8A16 and float, N = 2, 4): random
  rows whose tokens lie in later shards, a row of equal logits (id 0, the first maximum) and a NaN row (not
  finite); a head whose first or last shard alone gives non-finite logits makes every row not finite. The greedy decode
  step on 2 devices gathers [2, B] values, never the [B, V] logits that a sampled step gathers."""
  runs = [r["greedy"] for r in results if "greedy" in r]
  quants = ("none", "none-inf-first", "none-inf-last", "w8a16")
  assert sorted((r["quant"], r["n"]) for r in runs) == [(q, n) for q in quants for n in (2, 4)]
  for r in runs:
    if "-inf-" in r["quant"]:
      assert r["finite"] == r["want_finite"] == [False] * 5, r
      continue
    assert r["tokens"][:4] == r["want"][:4] and r["tokens"][2] == 0, r
    assert r["finite"] == r["want_finite"] == [True, True, True, True, False], r
    assert max(r["shards"]) > 0, r
  gathers = next(r["gathers"] for r in results if "gathers" in r)
  assert gathers["argmax"] == ["tensor<2x3xf32>", "tensor<2x3xi1>", "tensor<2x3xi32>"], gathers
  assert gathers["sampled"] == ["tensor<3x512xf32>"], gathers


def test_the_servers_grouped_admission_on_2_devices(results):
  """Two requests admitted in one call into rows of a cache split over 2 devices (rows 3 and 2) give the first
  tokens and the cache each gives admitted alone (every row of the state compared), and those of one device."""
  runs = {r["admit"]["n"]: r["admit"] for r in results if "admit" in r}
  assert sorted(runs) == [1, 2] and [runs[n]["on"] for n in (1, 2)] == [1, 2]
  for r in runs.values():
    assert r["together_calls"] == [2] and r["alone_calls"] == [1, 1] and r["together"] == r["alone"], r
    assert r["cache_diff"] < 1e-5 * r["cache_scale"] and r["cache_scale"] > 0, r
    assert r["pos"][0] == r["pos"][1] == [0, 0, 4, 10], r
  assert runs[2]["together"] == runs[1]["together"]


def test_engine_tokens_are_the_same_on_1_2_and_4_devices(results):
  """Greedy and penalized greedy, a batch of two (one prompt over two prefill chunks) and a prompt alone: the
  same tokens on N = 1, 2, 4, on the XLA and the FFI path (f32)."""
  runs = [r["engine"] for r in results if "engine" in r]
  for kernels, ns in (("ffi", [1, 2, 4]), ("xla", [1, 4])):
    mine = {r["n"]: r for r in runs if r["kernels"] == kernels}
    assert sorted(mine) == ns and [mine[n]["on"] for n in ns] == ns
    for what in ("batch", "alone", "penalized"):
      assert all(mine[n][what] == mine[1][what] for n in ns), (kernels, what)
    assert mine[1]["batch"][0] == mine[1]["alone"] and mine[1]["batch"] != mine[1]["penalized"]


def test_a_model_that_does_not_split_says_why(results):
  errors = next(r["errors"] for r in results if "errors" in r)
  assert errors[0] == ("tensor parallel over 4 devices needs each split evenly; 4 does not divide 6 query heads, "
                       "3 key/value heads (nor does 4 divide by them)")
  assert errors[1].endswith("4 does not divide the vocabulary of 510")
  assert errors[2] == ("tensor parallel over 8 devices needs 1 to 4 (the devices present), got 8 (on the CPU, "
                       "XLA_FLAGS=--xla_force_host_platform_device_count=8 makes 8)")
