"""Tensor parallel (jaxllm.parallel) on 1, 2 and 4 simulated CPU devices against one device: the forward's
hidden states, the cache it writes and the logits agree to f32 rounding, and the greedy tokens are the same,
for each family's features (QKV bias, q/k norms, llama3 RoPE factors and a tied head), on the XLA and FFI paths,
W8A16 and float, with KV heads both split (G >= N) and replicated (G < N). A model that does not split is a
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
  for r in cases:
    assert r["sharded"], r                                       # the weights and the cache are on n devices
    assert r["hidden"] < 2e-5 and r["k"] < 2e-5 and r["v"] < 2e-5, r   # f32 rounding (sums in another order)
    assert r["logits"] < 1e-5 * max(1.0, r["logits_scale"]), r
    assert r["argmax_same"], r
    if r["n"] == 1:
      assert r["hidden"] == r["logits"] == 0.0, r                 # one shard: the same program


def test_a_model_that_does_not_split_says_why(results):
  errors = next(r["errors"] for r in results if "errors" in r)
  assert errors[0] == ("tensor parallel over 4 devices needs each split evenly; 4 does not divide 6 query heads, "
                       "3 key/value heads (nor does 4 divide by them)")
  assert errors[1].endswith("4 does not divide the vocabulary of 510")
  assert errors[2] == "tensor parallel over 8 devices needs 1 to 4 (the devices present), got 8"
