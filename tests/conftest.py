import contextlib
import fcntl
import json
import os
import shutil
import sys
import tempfile
import warnings

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from tiny import write_tiny_model  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen3")
_CACHE_ROOT = pytest.StashKey[str]()   # the session cache root to remove at the end ("": kept)
_SHARED = pytest.StashKey[str]()       # the directory the test processes share, made by this process
_SHARED_VAR = "JAXLLM_TEST_SHARED"     # its path (xdist's workers inherit it): XLA's compiles, `alone` tests' locks


def pytest_configure(config):
  config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
  config.addinivalue_line("markers", "hf: compares with HF transformers on a real model (needs torch)")
  config.addinivalue_line("markers", "qwen: needs the 0.5B Qwen demo model (set JAXLLM_TEST_QWEN=1)")
  config.addinivalue_line("markers", "network: downloads a demo model (skipped with JAXLLM_TEST_OFFLINE=1)")
  config.addinivalue_line("markers", "xdist_group(name): under pytest-xdist's --dist loadgroup, one worker runs "
                          "the group (registered here too for runs without xdist)")
  config.addinivalue_line("markers", "alone: holds wall-clock limits: under xdist no other test runs meanwhile")


def pytest_collection_modifyitems(config, items):
  import jax
  has_gpu = any(d.platform == "gpu" for d in jax.devices()) if _jax_ok() else False
  for item in items:
    if "gpu" in item.keywords and not has_gpu:
      item.add_marker(pytest.mark.skip(reason="no CUDA GPU"))
    if "network" in item.keywords and os.environ.get("JAXLLM_TEST_OFFLINE") == "1":
      item.add_marker(pytest.mark.skip(reason="needs the network to download a demo model (JAXLLM_TEST_OFFLINE=1)"))
    if "qwen" in item.keywords and os.environ.get("JAXLLM_TEST_QWEN") != "1":
      item.add_marker(pytest.mark.skip(reason="Qwen tests are opt-in: set JAXLLM_TEST_QWEN=1"))
  if os.environ.get("JAXLLM_TEST_ORDER"):
    _longest_first(items, os.environ["JAXLLM_TEST_ORDER"])


def _longest_first(items, times_file: str):
  """The test files in order of the seconds a recorded run spent in each (the longest first; a file not in the
  record before them all: a new file, whose time is unknown, should not be what a run cut short at its limit
  skips; the record also lacks files whose every phase took under a second, which then start early at no cost),
  each file's tests in pytest's order (which keeps the tests of a module-scoped fixture's
  parameter together): bench/gpu_check.sh points JAXLLM_TEST_ORDER at tests/gpu_test_times.jsonl, the
  JAXLLM_TEST_TIMES record of a whole GPU run. Under xdist the longest files then start first and the run does
  not wait at its end on work that started last. The order is the same in every worker (xdist requires it);
  groups (an xdist_group's tests) still start before the rest, since --dist loadgroup orders its units by size."""
  try:
    with open(times_file) as f:
      records = [json.loads(line) for line in f]
  except (OSError, ValueError) as e:
    warnings.warn(f"JAXLLM_TEST_ORDER: cannot read {times_file} ({e}); the tests run in file order")
    return
  def file_of(test_id: str) -> str:
    return test_id.split("::")[0]
  seconds: dict[str, float] = {}
  for rec in records:
    seconds[file_of(rec["test"])] = seconds.get(file_of(rec["test"]), 0.0) + rec["s"]
  first: dict[str, int] = {}
  for i, item in enumerate(items):
    first.setdefault(file_of(item.nodeid), i)
  items.sort(key=lambda item: (-seconds.get(file_of(item.nodeid), float("inf")), first[file_of(item.nodeid)]))


def _jax_ok():
  try:
    import jax
    jax.devices()
    return True
  except Exception:
    return False


def pytest_sessionstart(session):
  """The session's own cache root: JAXLLM_CACHE (converted models, compiled executables, demo-model
  downloads) and XDG_CACHE_HOME (pip's download cache, Hugging Face's) point into a temporary directory,
  removed at the end; subprocesses the tests start inherit both. The suite never reads or writes ~/.cache,
  so demo models are downloaded once per session. JAXLLM_TEST_CACHE names a directory to use instead (kept,
  to reuse the downloads across sessions; the tests clear the converted models and executables in it).
  A second temporary directory is shared by the test processes (xdist's workers inherit its variable), removed
  at the end: JAX's compilation cache and the locks of `alone` tests. The engines' autotune is off unless
  JAXLLM_AUTOTUNE says otherwise."""
  kept = os.environ.get("JAXLLM_TEST_CACHE")
  root = os.path.abspath(kept) if kept else tempfile.mkdtemp(prefix="jaxllm-test-cache-")
  session.config.stash[_CACHE_ROOT] = "" if kept else root
  os.environ["JAXLLM_CACHE"] = root
  os.environ["XDG_CACHE_HOME"] = os.path.join(root, "xdg")
  # The engines' autotune (on by default) off, unless a test turns it on (tests/test_tuning.py) or the run asks
  # for it: on the GPU each test process would time the configurations in a child while other workers share the
  # card, which adds time and picks on noise (a table picks among configurations that are all right).
  os.environ.setdefault("JAXLLM_AUTOTUNE", "0")
  shared = os.environ.get(_SHARED_VAR)
  if not shared:
    shared = tempfile.mkdtemp(prefix="jaxllm-test-shared-")
    os.environ[_SHARED_VAR] = shared
    session.config.stash[_SHARED] = shared
  _share_xla_compiles(os.path.join(shared, "xla"))


@contextlib.contextmanager
def _turn(alone: bool):
  """Under xdist, the locks that let a test marked `alone` (it holds wall-clock limits) run while no other
  worker runs a test: it takes the run lock of the shared directory exclusively, every other test shares it. The
  gate lets a waiting `alone` test in first: the others pass it before sharing the run lock."""
  shared = os.environ.get(_SHARED_VAR)
  if not os.environ.get("PYTEST_XDIST_WORKER") or not shared:
    yield
    return
  with open(os.path.join(shared, "gate.lock"), "a") as gate, open(os.path.join(shared, "run.lock"), "a") as run:
    fcntl.flock(gate, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
    fcntl.flock(run, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
    if not alone:
      fcntl.flock(gate, fcntl.LOCK_UN)
    try:
      yield
    finally:
      fcntl.flock(run, fcntl.LOCK_UN)
      if alone:
        fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """Every test but an `alone` one shares the run lock while it runs, its fixtures' setup included."""
  with _turn(alone=False) if item.get_closest_marker("alone") is None else contextlib.nullcontext():
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
  """An `alone` test holds the run lock alone while its body runs (a skipped one never waits for it)."""
  with _turn(alone=True) if item.get_closest_marker("alone") is not None else contextlib.nullcontext():
    return (yield)


def _share_xla_compiles(d: str):
  """JAX's persistent compilation cache in the session's shared directory, for the test processes only (set in
  jax.config: the CLIs and scripts the tests start compile as a user's run does). The tests build engines of
  the same tiny models again and again, and compiling their programs anew is most of the suite's time."""
  import jax
  jax.config.update("jax_compilation_cache_dir", d)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_sessionfinish(session):
  for root in (session.config.stash.get(_CACHE_ROOT, ""), session.config.stash.get(_SHARED, "")):
    if root:
      shutil.rmtree(root, ignore_errors=True)


def pytest_runtest_logreport(report):
  """With JAXLLM_TEST_TIMES=FILE, each test phase over a second, and every failure with its report, is appended
  to FILE as a JSON line as it ends: a run cut off at its time limit (bench/gpu_check.sh) still says where its
  time went and why a test failed (pytest prints both only at the end)."""
  path = os.environ.get("JAXLLM_TEST_TIMES")
  if os.environ.get("PYTEST_XDIST_WORKER"):   # under xdist the controller hears every worker's reports: it writes
    return
  if not path or (report.duration < 1.0 and not report.failed):
    return
  line = {"test": report.nodeid, "phase": report.when, "s": round(report.duration, 2), "outcome": report.outcome}
  if report.failed:
    line["report"] = str(report.longrepr)[-4000:]
  with open(path, "a") as f:
    f.write(json.dumps(line) + "\n")


@pytest.fixture
def own_compiles():
  """JAX's persistent cache off for this test (the suite turns it on: _share_xla_compiles): the engine keeps
  executables of its own only where that cache is off (jaxllm.executables.jax_cache_active)."""
  from jaxllm.executables import jax_cache_off
  with jax_cache_off():
    yield


@pytest.fixture
def lab_switches(monkeypatch):
  """The Python lab switches (jaxllm/lab.py) read the environment, as in a lab build, for this test: set them
  with the monkeypatch returned. The C++ and CUDA switches stay as the extension was built."""
  from jaxllm import lab
  monkeypatch.setattr(lab, "lab_build", lambda: True)
  return monkeypatch


@pytest.fixture(scope="session", params=ARCHS)
def tiny_path(request, tmp_path_factory):
  """A tiny random model file of each architecture."""
  return write_tiny_model(tmp_path_factory.mktemp("tiny") / f"{request.param}.gguf", request.param)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
  d = tmp_path_factory.mktemp("tiny_all")
  return {a: write_tiny_model(d / f"{a}.gguf", a) for a in ARCHS}
