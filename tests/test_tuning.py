"""jaxllm.tuning: the tensor-core matmul's configuration measured per shape, kept per card, given to the kernel.

The CPU tests check the kept file (what is read back, what is refused), the lookup and that the choice reaches
the kernel's call; the GPU tests time real configurations and check that every configuration a choice can name
is right (against the float64 reference, poisoned outputs)."""
import contextlib
import io
import json
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import tuning
from jaxllm.kernels import ffi, linear
from jaxllm.quant import Linear, quantize_int8

pytestmark = pytest.mark.skipif(ffi.unavailable_reason() is not None,
                                reason=f"FFI kernels unavailable: {ffi.unavailable_reason()}")
ON_GPU = jax.default_backend() == "gpu"


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
  """A cache of its own and no choices in memory."""
  monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path))
  monkeypatch.setenv("JAXLLM_AUTOTUNE", "1")
  monkeypatch.setattr(tuning, "_choices", {})
  monkeypatch.setattr(tuning, "_times", {})
  monkeypatch.setattr(tuning, "_loaded", set())
  monkeypatch.setattr(tuning, "_failed", set())
  monkeypatch.setattr(tuning, "_kind", [""])
  return tmp_path


@pytest.fixture
def fresh(fresh_cache, monkeypatch):
  """fresh_cache, with 8 configurations (the kernel's own count on the GPU is larger)."""
  monkeypatch.setattr(ffi, "tuning_count", lambda: 8)
  return fresh_cache


def _fake_child(calls, fail=None):
  """A subprocess.run for ensure's child: `python -m jaxllm.tuning ...` run here, with measure() faked and this
  process's choices hidden from it (a child has its own), or failing as `fail` says."""
  def run(cmd, env, capture_output, text, timeout):
    assert cmd[1:3] == ["-m", "jaxllm.tuning"] and env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    if fail == "timeout":
      raise subprocess.TimeoutExpired(cmd, timeout)
    if fail == "exit":
      return subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\nRuntimeError: no GPU")
    saved = dict(tuning._choices), dict(tuning._times), list(tuning._kind), set(tuning._loaded)
    tuning._choices.clear()
    tuning._times.clear()
    tuning._kind[0] = ""
    real = tuning.measure
    tuning.measure = _fake_measure(calls)
    out = io.StringIO()
    try:
      with contextlib.redirect_stdout(out):
        code = tuning._main(cmd[3:])
    finally:
      tuning.measure = real
      tuning._choices.clear()
      tuning._choices.update(saved[0])
      tuning._times.clear()
      tuning._times.update(saved[1])
      tuning._kind[:] = saved[2]
      tuning._loaded.clear()
      tuning._loaded.update(saved[3])
    return subprocess.CompletedProcess(cmd, code, out.getvalue(), "")
  return run


def _fake_measure(calls):
  """A measure() whose fastest configuration is (n + k + bucket) mod 8, +inf for half of each bucket's."""
  def measure(n, k):
    calls.append((n, k))
    t = np.full((len(tuning.BUCKETS), 8), np.inf)
    for i, b in enumerate(tuning.BUCKETS):
      t[i, :4] = 10.0
      t[i, (n + k + b) % 4] = 5.0
    return t
  return measure


def test_bucket_and_choice_bounds(fresh, monkeypatch):
  assert [tuning.bucket(m) for m in (5, 8, 9, 16, 17, 32, 33, 64)] == [8, 8, 16, 16, 32, 32, None, None]
  assert tuning.choice(100, 128, 13) == -1                                        # no table in use: the rule
  with tuning.use({(100, 128, 16): 3, (100, 128, 32): 5, (100, 128, 64): 2}):
    assert tuning.choice(100, 128, 13) == 3 and tuning.choice(100, 128, 32) == 5
    assert tuning.choice(100, 128, 4) == -1 and tuning.choice(100, 128, 65) == -1  # the GEMV kernels, XLA's dot
    assert tuning.choice(100, 128, 8) == -1                                       # another bucket: the rule
    assert tuning.choice(100, 128, 33) == -1 and tuning.choice(100, 128, 64) == -1  # 33-64 rows: the rule
    with tuning.use(None):
      assert tuning.choice(100, 128, 13) == -1
    assert tuning.choice(100, 128, 13) == 3
  assert tuning.choice(100, 128, 13) == -1
  assert tuning.enabled()
  monkeypatch.delenv("JAXLLM_AUTOTUNE")                                           # on by default
  assert tuning.enabled()
  for off in ("0", "false", "OFF"):
    monkeypatch.setenv("JAXLLM_AUTOTUNE", off)
    assert not tuning.enabled()
  for on in ("1", "true", " on", ""):
    monkeypatch.setenv("JAXLLM_AUTOTUNE", on)
    assert tuning.enabled()
  monkeypatch.setenv("JAXLLM_AUTOTUNE", "no")
  with pytest.raises(ValueError, match="JAXLLM_AUTOTUNE must be 0 or 1, got 'no'"):
    tuning.enabled()


def test_ensure_times_once_and_keeps_choices_per_card(fresh, monkeypatch):
  calls = []
  monkeypatch.setattr(tuning.subprocess, "run", _fake_child(calls))
  table = tuning.ensure([(100, 128), (100, 128), (64, 192), (10, 100)], "NVIDIA H100 80GB HBM3")
  assert sorted(calls) == [(64, 192), (100, 128)]                 # K 100: not the kernel's (a multiple of 64)
  expect = {(n, k, b): (n + k + b) % 4 for n, k in calls for b in tuning.BUCKETS}
  assert table == expect
  path = fresh / "tuning" / "NVIDIA_H100_80GB_HBM3.json"
  assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
  data = json.loads(path.read_text())
  assert data["choices"]["100,128,16"] == (100 + 128 + 16) % 4 and len(data["times_us"]["100,128,16"]) == 8
  # A new process on the same card reads them back instead of timing.
  monkeypatch.setattr(tuning, "_choices", {})
  monkeypatch.setattr(tuning, "_loaded", set())
  assert tuning.ensure([(100, 128), (64, 192)], "NVIDIA H100 80GB HBM3") == expect and len(calls) == 2
  assert tuning.ensure([(64, 192)], "NVIDIA H100 80GB HBM3") == {key: v for key, v in expect.items() if key[0] == 64}
  # Another card times its own, and the first card's choices are not used for it.
  assert {key[:2] for key in tuning.ensure([(100, 128)], "NVIDIA H200")} == {(100, 128)} and len(calls) == 3
  assert {key[:2] for key in tuning._choices} == {(100, 128)}


@pytest.mark.parametrize("mutate, warns", [
    (lambda d: d.update(build="0" * 16), False),                     # another extension build: timed again
    (lambda d: d.update(candidates=9), False),                       # another kernel list
    (lambda d: d.update(format=0), False),
    (lambda d: d["choices"].update({"100,128,16": 8}), True),        # not one of the 8 configurations
    (lambda d: d["choices"].update({"100,128,16": True}), True),
    (lambda d: d["choices"].update({"100,128,12": 1}), True),        # not a bucket
    (lambda d: d["choices"].update({"100,128,64": 1}), True),        # not a bucket timed
    (lambda d: d["choices"].update({"100,-128,16": 1}), True),
    (lambda d: d.update(choices=[1, 2]), True),
    (lambda d: d["choices"].update({"1\u00b2,128,16": 1}), True),   # a digit int() does not take
    (lambda d: d["choices"].update({"0,128,16": 1}), True),
])
def test_kept_file_is_checked(fresh, monkeypatch, mutate, warns):
  calls = []
  monkeypatch.setattr(tuning.subprocess, "run", _fake_child(calls))
  tuning.ensure([(100, 128)], "gpu")
  path = fresh / "tuning" / "gpu.json"
  data = json.loads(path.read_text())
  mutate(data)
  path.write_text(json.dumps(data))
  monkeypatch.setattr(tuning, "_choices", {})
  monkeypatch.setattr(tuning, "_loaded", set())
  from jaxllm import cachedir
  monkeypatch.setattr(cachedir, "_warned", set())
  if warns:
    with pytest.warns(cachedir.CacheWarning, match="ignoring the kernel tuning file"):
      tuning.ensure([(100, 128)], "gpu")
  else:
    tuning.ensure([(100, 128)], "gpu")
  assert len(calls) == 2                                          # timed again, and the file written anew
  assert json.loads(path.read_text())["choices"]["100,128,16"] == (100 + 128 + 16) % 4


@pytest.mark.parametrize("make", ["{not json", "[" * 100000, "[1, 2]", "fifo", "link", "group-writable"])
def test_unusable_file_is_timed_again(fresh, monkeypatch, make):
  """A file that does not parse, is too deep, is not an object, is not a regular file of the user's: warned of,
  timed again, never an exception or a hang."""
  calls = []
  monkeypatch.setattr(tuning.subprocess, "run", _fake_child(calls))
  (fresh / "tuning").mkdir(mode=0o700)
  path = fresh / "tuning" / "gpu.json"
  if make == "fifo":
    os.mkfifo(path)
  elif make == "link":
    (fresh / "elsewhere.json").write_text("{}")
    path.symlink_to(fresh / "elsewhere.json")
  elif make == "group-writable":
    path.write_text("{}")
    path.chmod(0o664)
  else:
    path.write_text(make)
  with pytest.warns(RuntimeWarning, match="ignoring the kernel tuning file"):
    table = tuning.ensure([(100, 128)], "gpu")
  assert table[(100, 128, 16)] == (100 + 128 + 16) % 4 and len(calls) == 1


def test_autotune_follows_the_argument_then_the_environment(fresh, monkeypatch):
  from jaxllm.bench import load_model
  from jaxllm.engine import Engine
  config, weights, _, _ = load_model("synthetic:tiny", "w8a16", 0)
  assert Engine(config, weights, None, max_context=16).autotune                   # fresh: JAXLLM_AUTOTUNE=1
  assert not Engine(config, weights, None, max_context=16, autotune=False).autotune
  monkeypatch.setenv("JAXLLM_AUTOTUNE", "0")
  assert not Engine(config, weights, None, max_context=16).autotune
  assert Engine(config, weights, None, max_context=16, autotune=True).autotune
  monkeypatch.delenv("JAXLLM_AUTOTUNE")
  assert Engine(config, weights, None, max_context=16).autotune                   # the default


@pytest.mark.parametrize("fail", ["exit", "timeout"])
def test_a_failed_child_warns_and_leaves_the_rule(fresh, monkeypatch, fail):
  calls = []
  monkeypatch.setattr(tuning.subprocess, "run", _fake_child(calls, fail))
  with pytest.warns(RuntimeWarning, match="run its built-in rule"):
    assert tuning.ensure([(100, 128)], "gpu") == {}
  monkeypatch.setattr(tuning.subprocess, "run", lambda *a, **k: pytest.fail("tried again in the same process"))
  assert tuning.ensure([(100, 128)], "gpu") == {}


def test_child_refuses_bad_shapes(fresh, capsys):
  for bad in ("10,100", "5", "a,64", "0,64"):
    with pytest.raises(SystemExit) as e:
      tuning._main(["gpu", bad])
    assert e.value.code == 2 and "expected N,K" in capsys.readouterr().err


def test_choice_reaches_the_kernel_call(fresh):
  """linear() gives the matmul the choice of the table in use as its `mma` attribute (bf16, 5-64 rows), -1 elsewhere
  and outside a table."""
  rng = np.random.default_rng(0)
  q, s = quantize_int8(rng.standard_normal((1, 96, 128)).astype(np.float32))
  lin = Linear(w=jnp.asarray(q), scale=jnp.asarray(s))
  assert attr_of(lin, 12) == -1
  with tuning.use({(96, 128, 16): 2}):
    _attrs_under_a_table(lin)


def attr_of(lin, m, dtype=jnp.bfloat16, call=None):
  """The `mma` attribute of the one matmul call traced for x [m, 128]."""
  call = call or (lambda x: linear(x, lin, 0, kernels="ffi"))
  text = jax.jit(call).lower(jnp.zeros((m, 128), dtype)).as_text()
  return int(text.split("mma = ")[1].split(" ")[0])


def _attrs_under_a_table(lin):

  def attr(m, dtype=jnp.bfloat16, call=None):
    return attr_of(lin, m, dtype, call)

  assert attr(12) == 2 and attr(8) == -1 and attr(4) == -1 and attr(12, jnp.float32) == -1
  assert attr(12, call=lambda x: ffi.w8a16_matmul(x, lin, 0)) == -1            # called directly: the rule
  assert attr(12, call=lambda x: ffi.w8a16_matmul(x, lin, 0, mma=5)) == 5
  # Under vmap the rows fold into M (3 x 12 = 36 here): the choice made for 12 rows gives way to the rule.
  xs = jnp.zeros((3, 12, 128), jnp.bfloat16)
  text = jax.jit(jax.vmap(lambda x: linear(x, lin, 0, kernels="ffi"))).lower(xs).as_text()
  assert text.count("jaxllm_w8a16") == 1 and int(text.split("mma = ")[1].split(" ")[0]) == -1
  with pytest.raises(ValueError, match="mma must be -1"):
    ffi.w8a16_matmul(jnp.zeros((12, 128), jnp.bfloat16), lin, 0, mma=10 ** 6)


def test_engine_times_only_on_the_gpu(fresh, monkeypatch):
  """An engine's first program asks for its W8A16 shapes once (the GPU) or never (the CPU)."""
  from jaxllm.bench import load_model
  from jaxllm.engine import Engine
  asked = []
  monkeypatch.setattr(tuning, "ensure", lambda shapes, kind: asked.append(sorted(shapes)) or {})
  config, weights, _, _ = load_model("synthetic:tiny", "w8a16", 0)
  eng = Engine(config, weights, None, max_context=64)
  eng.generate([1, 2, 3], 3)
  eng.generate_batch([[1, 2, 3]] * 6, 3)
  if ON_GPU:
    assert len(asked) == 1 and (config.d_model, config.q_dim) in {tuple(s) for s in asked[0]}
  else:
    assert asked == []


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the tensor-core kernel")
def test_measure_times_each_configuration_in_its_bucket(fresh_cache):
  t = tuning.measure(1152, 896)
  finite = np.isfinite(t)
  assert t.shape == (len(tuning.BUCKETS), ffi.tuning_count())
  assert (finite.sum(axis=0) <= 1).all(), "each configuration is timed at one bucket (+inf: noise, or not launchable)"
  assert (finite.sum(axis=1) >= 2).all() and (t[finite] > 0).all() and (t[finite] < 1e4).all(), t
  table = tuning.ensure([(1152, 896)], "test-card")   # in a child process, as an engine does
  for i, b in enumerate(tuning.BUCKETS):
    assert finite[i, table[(1152, 896, b)]]


# (K, N): Qwen2.5-0.5B's q/k/v and down, N not a multiple of 16 (edge tiles), and a 7B-like O.
_SHAPES = [(896, 1152), (4864, 896), (192, 1000), (128, 33), (3584, 3584)]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the tensor-core kernel's configurations")
@pytest.mark.parametrize("k, n", _SHAPES)
def test_every_configuration_matches_reference(k, n):
  """Every configuration a choice can name, at rows that fill and part-fill its tiles of x (and 70: a second
  column of blocks), against the float64 reference, each output poisoned first; two stacked layers, the
  kernel reading layer 1."""
  from test_kernels import _float64_reference, _poison, _rel, TOL
  rng = np.random.default_rng(k * 31 + n)
  q, s = quantize_int8(rng.standard_normal((2, n, k)).astype(np.float32))
  lin = Linear(w=jax.device_put(q), scale=jax.device_put(s))
  ms = (5, 8, 13, 16, 27, 32, 50, 64, 70)
  xs = jax.device_put(rng.standard_normal((max(ms), k)).astype(jnp.bfloat16))
  ref = _float64_reference(xs, lin, 1)
  count = ffi.tuning_count()
  cases = [(i, m) for i in range(count) for m in ms]
  call = jax.jit(lambda xs, lin, poisons: [ffi.w8a16_matmul(xs[:m], lin, 1, poison=p, mma=i)
                                           for (i, m), p in zip(cases, poisons)])
  outs = call(xs, lin, [_poison((m, n), jnp.bfloat16) for _, m in cases])
  for (i, m), got in zip(cases, outs):
    got = np.asarray(got, np.float32)
    assert not np.isnan(got).any(), f"configuration {i}: unwritten outputs at M={m}"
    assert _rel(got, ref[:m]) < TOL[jnp.bfloat16], (i, m, _rel(got, ref[:m]))


def test_the_kept_programs_key_names_the_engines_choices(fresh, monkeypatch):
  """A compiled program kept on disk is keyed on the choices its engine traced with: another table, another key."""
  from jaxllm import executables
  from jaxllm.bench import load_model
  from jaxllm.engine import Engine
  config, weights, _, _ = load_model("synthetic:tiny", "w8a16", 0)
  parts = []
  real = executables.executable_key
  monkeypatch.setattr(executables, "executable_key", lambda *p: parts.append(p) or real(*p))
  keys = []
  for table in ({}, {(config.d_model, config.q_dim, 16): 2}):
    engine = Engine(config, weights, None, max_context=16, cache_executables=True, autotune=False)
    engine.mma_table = table
    engine.generate([1, 2, 3], 2)
    assert sorted(table.items()) in parts[-1]
    keys.append(real(*parts[-1]))
  assert keys[0] != keys[1]


def test_tune_binding_refuses_bad_input():
  """The timing binding says what it expected: on the CPU it needs the GPU; on the GPU, shapes that agree."""
  x = jnp.zeros((16, 128), jnp.bfloat16)
  w = jnp.zeros((2, 32, 128), jnp.int8)
  s = jnp.zeros((2, 32, 2), jnp.float32)
  if not ON_GPU:
    with pytest.raises(ValueError, match="needs the GPU"):
      ffi.w8a16_tune(x, w, s)
    return
  for bad in ((x[:4], w, s), (x, w[:, :, :64], s), (x, w, s[:, :, :1]), (x.astype(jnp.float32), w, s)):
    with pytest.raises(ValueError, match="expected x"):
      ffi.w8a16_tune(*bad)
