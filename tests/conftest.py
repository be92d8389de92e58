import json
import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from tiny import write_tiny_model  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen3")
_CACHE_ROOT = pytest.StashKey[str]()   # the session cache root to remove at the end ("": kept)


def pytest_configure(config):
  config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
  config.addinivalue_line("markers", "hf: compares with HF transformers on a real model (needs torch)")
  config.addinivalue_line("markers", "qwen: needs the 0.5B Qwen demo model (set JAXLLM_TEST_QWEN=1)")
  config.addinivalue_line("markers", "network: downloads a demo model (skipped with JAXLLM_TEST_OFFLINE=1)")


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
  to reuse the downloads across sessions; the tests clear the converted models and executables in it)."""
  kept = os.environ.get("JAXLLM_TEST_CACHE")
  root = os.path.abspath(kept) if kept else tempfile.mkdtemp(prefix="jaxllm-test-cache-")
  session.config.stash[_CACHE_ROOT] = "" if kept else root
  os.environ["JAXLLM_CACHE"] = root
  os.environ["XDG_CACHE_HOME"] = os.path.join(root, "xdg")


def pytest_sessionfinish(session):
  root = session.config.stash.get(_CACHE_ROOT, "")
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
