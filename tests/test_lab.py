"""Lab switches (jaxllm/lab.py, ffi/common.h): a release build reads none of them, whatever the environment
says; a lab build (-Ccmake.define.JAXLLM_LAB=ON) reads them with the same parsing as before the gate."""
import json
import os
import subprocess
import sys

import pytest

from jaxllm import lab

# Each Python switch set to a value other than its default.
PY_SWITCHES = {"JAXLLM_LAYERS_CALL": "0", "JAXLLM_PDL": "0", "JAXLLM_LAYERS_HEAD": "0", "JAXLLM_FUSED_CPU": "1",
               "JAXLLM_FFI_OPS": "matmul", "JAXLLM_CANDIDATES_KERNEL": "0", "JAXLLM_READ_AHEAD": "0",
               "JAXLLM_ATTN_MAX_SPLITS": "2"}
# The C++/CUDA switches likewise (LAYERS_SKIP and ATTN_STOP make the step's results wrong in a lab build).
CPP_SWITCHES = {"JAXLLM_LAYERS_SKIP": "qkv,attention,o,gate_up,down", "JAXLLM_ATTN_STOP": "wait",
                "JAXLLM_PDL_EARLY": "0", "JAXLLM_PREFETCH": "0", "JAXLLM_ATTN_CLUSTER": "0",
                "JAXLLM_ATTN_PRELOAD": "0", "JAXLLM_ATTN_SWIZZLE": "0", "JAXLLM_ATTN_MBAR": "0",
                "JAXLLM_HEAD_GRID": "1", "JAXLLM_MMA_HEAD": "0",
                "JAXLLM_LOWBIT_PREFETCH": "0", "JAXLLM_ALIAS_COPY": "0"}

release_only = pytest.mark.skipif(lab.lab_build(), reason="a lab build (JAXLLM_LAB=ON) reads the lab switches")


def _ffi():
  return pytest.importorskip("jaxllm._ffi", reason="the extension is not built")


def _knobs():
  """What each Python switch decides."""
  from jaxllm.kernels import fused, select
  from jaxllm.sampling import candidates_kernel
  return fused.layers_call(), fused.cpu_fused(), select.ffi_ops(), candidates_kernel()


@release_only
def test_the_extension_says_it_is_a_release_build():
  assert _ffi().lab_build is False and lab.lab_build() is False


@release_only
def test_a_release_build_ignores_the_python_switches(monkeypatch):
  for name in PY_SWITCHES:
    monkeypatch.delenv(name, raising=False)
  want = _knobs()
  assert want[1:] == (False, ("matmul", "attention", "fused"), True) and want[0].pdl and want[0].head
  for name, value in PY_SWITCHES.items():
    monkeypatch.setenv(name, value)
    assert lab.switch(name, "1") == "1" and lab.switch(name) is None
  assert _knobs() == want
  monkeypatch.setenv("JAXLLM_CANDIDATES_KERNEL", "yes")   # a lab build rejects it; a release never looks
  assert _knobs() == want


@release_only
def test_the_release_extension_holds_no_lab_switch_name():
  """No code of the release extension can read a C++ lab switch: their names are not in the library (the
  user-facing thread controls are)."""
  with open(_ffi().__file__, "rb") as f:
    lib = f.read()
  assert b"JAXLLM_CPU_THREADS" in lib and b"JAXLLM_CPU_WORKERS" in lib
  assert [name for name in CPP_SWITCHES if name.encode() in lib] == []


def test_lab_switches_read_the_environment_in_a_lab_build(lab_switches):
  """The Python switches as a lab build reads them (the C++ ones need the lab extension: bench/)."""
  for name, value in PY_SWITCHES.items():
    lab_switches.setenv(name, value)
  layers, cpu_fused, ops, kernel = _knobs()
  assert (layers.one, layers.pdl, layers.head, layers.max_splits) == (False, False, False, 2)
  import jax.numpy as jnp
  from jaxllm.kernels import fused
  cache = jnp.zeros((1, 1, 2, 256, 64), jnp.bfloat16)   # [L, B, G, S, Dh]: 8 tiles of 32 positions
  assert fused.merged_splits(1, cache) == 2             # the attention's splits, capped
  assert (cpu_fused, ops, kernel) == (True, ("matmul",), False)
  assert lab.switch("JAXLLM_READ_AHEAD", "1") == "0"
  lab_switches.delenv("JAXLLM_READ_AHEAD")
  assert lab.switch("JAXLLM_READ_AHEAD", "1") == "1"
  lab_switches.setenv("JAXLLM_CANDIDATES_KERNEL", "yes")
  with pytest.raises(ValueError, match="JAXLLM_CANDIDATES_KERNEL must be 0 or 1, got 'yes'"):
    _knobs()
  for bad in ("0", "257", "\u00b2"):
    lab_switches.setenv("JAXLLM_ATTN_MAX_SPLITS", bad)
    with pytest.raises(ValueError, match=f"JAXLLM_ATTN_MAX_SPLITS must be an integer in 1..256, got '{bad}'"):
      _knobs()
  lab_switches.setenv("JAXLLM_ATTN_MAX_SPLITS", "2")
  lab_switches.setenv("JAXLLM_FFI_OPS", "matmul,gemv")
  with pytest.raises(ValueError, match="JAXLLM_FFI_OPS takes"):
    _knobs()


_GENERATE = """
import json
from jaxllm.engine import Engine
from jaxllm.presets import preset
from jaxllm.weights import random_weights
config = preset("qwen2.5-0.5b").replace(n_layers=2, vocab_size=4096)
engine = Engine(config, random_weights(config, seed=1, quant="w8a16"), None, max_context=320, kernels="ffi")
print(json.dumps(engine.generate(list(range(1, 260)), 16, ignore_eos=True).ids))
"""


@pytest.mark.gpu
@release_only
def test_a_release_build_computes_the_same_with_every_switch_set(tmp_path):
  """The fused GPU step (every layer in one call, where the C++ switches act) gives the same tokens with every
  lab switch set, LAYERS_SKIP and ATTN_STOP included, as without: in fresh processes, since the CUDA code
  reads its switches once."""
  def run(extra):
    env = {k: v for k, v in os.environ.items() if k not in PY_SWITCHES and k not in CPP_SWITCHES}
    env["JAXLLM_COMPILE_CACHE"] = "0"
    proc = subprocess.run([sys.executable, "-c", _GENERATE], env={**env, **extra}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the results are wrong" not in proc.stderr, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
  plain = run({})
  assert len(plain) == 16
  assert run({**PY_SWITCHES, **CPP_SWITCHES}) == plain
