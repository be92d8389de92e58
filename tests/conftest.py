import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from tiny import write_tiny_model  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen3")


def pytest_configure(config):
  config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
  config.addinivalue_line("markers", "hf: compares with HF transformers on a real model (needs torch)")
  config.addinivalue_line("markers", "qwen: needs the 0.5B Qwen demo model (set JAXLLM_TEST_QWEN=1)")


def pytest_collection_modifyitems(config, items):
  import jax
  has_gpu = any(d.platform == "gpu" for d in jax.devices()) if _jax_ok() else False
  for item in items:
    if "gpu" in item.keywords and not has_gpu:
      item.add_marker(pytest.mark.skip(reason="no CUDA GPU"))
    if "qwen" in item.keywords and os.environ.get("JAXLLM_TEST_QWEN") != "1":
      item.add_marker(pytest.mark.skip(reason="Qwen tests are opt-in: set JAXLLM_TEST_QWEN=1"))


def _jax_ok():
  try:
    import jax
    jax.devices()
    return True
  except Exception:
    return False


@pytest.fixture(scope="session", autouse=True)
def _private_model_cache(tmp_path_factory):
  """Converted models and compiled executables go to a temporary directory, not the user's cache (demo
  model downloads stay where they are)."""
  from jaxllm import store
  root = tmp_path_factory.mktemp("jaxllm-cache")
  saved = store.models_dir, store.compile_dir
  store.models_dir, store.compile_dir = (lambda: root / "models"), (lambda: root / "xla")
  yield root
  store.models_dir, store.compile_dir = saved


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
