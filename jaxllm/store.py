"""The on-disk cache of converted models, and the XLA compilation cache, under the jaxllm cache directory.

The engine's compiled steps are kept as whole serialized executables (`<cache>/executables`, keyed by
what they compute, the jax version, the device and the code that built them), which load without tracing
the model again; `enable_compile_cache()` turns on JAX's own persistent cache (`<cache>/xla`) for other
programs.

A converted model is a directory `<cache>/models/<key>/`: one .npy file per weight array (mapped, not read,
on a later run), `config.json`, `tokenizer.json` and `manifest.json` (written last, listing every file
with its size). The key hashes the GGUF's size, modification time, first and last MiB, the quantization,
the activation dtype and FORMAT, so a changed file, setting or jaxllm format never meets an old entry.
Writers build the entry in a private temporary directory and rename it into place: a concurrent writer or
a crash leaves no half entry visible, and a reader that finds a file missing, truncated or of the wrong
shape discards the entry and converts again.

`JAXLLM_CACHE` moves the cache (default ~/.cache/jaxllm, where demo models are downloaded too);
`clear()` (CLI: --clear-cache) removes the converted models and compiled executables, not the downloads.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from jaxllm.config import Config
from jaxllm.models import cache_dir

FORMAT = 4          # bump when what convert() writes changes (4: Q4_K as LowBit, Mixed stacks)
_EDGE = 1 << 20     # bytes hashed at each end of the GGUF


def models_dir() -> Path:
  return cache_dir() / "models"


def compile_dir() -> Path:
  return cache_dir() / "xla"


def executables_dir() -> Path:
  return cache_dir() / "executables"


@functools.lru_cache(maxsize=None)
def code_version() -> str:
  """A hash of jaxllm's own code (its Python files and the built extension): compiled steps made by other
  code are never reused."""
  root = Path(__file__).resolve().parent
  h = hashlib.sha256()
  for path in sorted(root.rglob("*.py")) + sorted(root.glob("_ffi*")):
    h.update(path.name.encode())
    h.update(path.read_bytes())
  return h.hexdigest()[:16]


def executable_key(*parts) -> str:
  """A key for a compiled executable: the given description, jax and jaxlib versions, the device kind and
  jaxllm's code version."""
  import jax
  import jaxlib
  dev = jax.devices()[0]
  text = repr((parts, jax.__version__, jaxlib.__version__, dev.platform, getattr(dev, "device_kind", ""),
               code_version()))
  return hashlib.sha256(text.encode()).hexdigest()[:32]


def load_executable(key: str):
  """A compiled executable saved under key, or None (missing, or not loadable here: then it is removed)."""
  path = executables_dir() / f"{key}.bin"
  if not path.is_file():
    return None
  try:
    import pickle
    from jax.experimental.serialize_executable import deserialize_and_load
    with open(path, "rb") as f:
      payload, in_tree, out_tree = pickle.load(f)
    return deserialize_and_load(payload, in_tree, out_tree)
  except Exception:  # a damaged or foreign file: compile again
    path.unlink(missing_ok=True)
    return None


def save_executable(key: str, compiled) -> None:
  """Saves a compiled executable (atomically: a private file renamed into place)."""
  import pickle
  from jax.experimental.serialize_executable import serialize
  try:
    blob = pickle.dumps(serialize(compiled))
  except Exception:  # an executable XLA cannot serialize: it is simply not cached
    return
  d = executables_dir()
  d.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=f".{key}.", dir=d)
  with os.fdopen(fd, "wb") as f:
    f.write(blob)
  os.replace(tmp, d / f"{key}.bin")


def model_key(path: str | os.PathLike, quant: str, dtype_name: str) -> str:
  """A key that changes whenever the file, the quantization, the dtype or jaxllm's format does."""
  st = os.stat(path)
  h = hashlib.sha256(f"jaxllm-model {FORMAT} {quant} {dtype_name} {st.st_size} {st.st_mtime_ns}".encode())
  with open(path, "rb") as f:
    h.update(f.read(_EDGE))
    if st.st_size > _EDGE:
      f.seek(max(_EDGE, st.st_size - _EDGE))
      h.update(f.read(_EDGE))
  return h.hexdigest()[:32]


class Entry:
  """One converted model being written: arrays go to a private directory as they are made."""

  def __init__(self, key: str):
    self.key = key
    models_dir().mkdir(parents=True, exist_ok=True)
    self.tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=models_dir()))
    self.files: dict[str, dict] = {}

  def add(self, name: str, array: np.ndarray) -> None:
    """Writes one array (bfloat16, which .npy cannot describe, as its 16-bit words)."""
    path = self.tmp / f"{name}.npy"
    stored = array.view(np.uint16) if array.dtype.name == "bfloat16" else array
    np.save(path, np.ascontiguousarray(stored))
    self.files[name] = {"file": path.name, "shape": list(array.shape), "dtype": array.dtype.name,
                        "bytes": path.stat().st_size}

  def commit(self, config: Config, tokenizer_state: dict) -> None:
    """Writes the config, tokenizer and manifest, then renames the entry into place (first writer wins)."""
    (self.tmp / "config.json").write_text(json.dumps(dataclasses.asdict(config)))
    (self.tmp / "tokenizer.json").write_text(json.dumps(tokenizer_state))
    manifest = {"format": FORMAT, "arrays": self.files,
                "sizes": {n: (self.tmp / n).stat().st_size for n in ("config.json", "tokenizer.json")}}
    (self.tmp / "manifest.json").write_text(json.dumps(manifest))
    try:
      os.rename(self.tmp, models_dir() / self.key)
    except OSError:                  # another writer got there first: theirs is as good
      self.abort()

  def abort(self) -> None:
    shutil.rmtree(self.tmp, ignore_errors=True)


def load(key: str) -> tuple[Config, dict, dict[str, np.ndarray]] | None:
  """(config, tokenizer state, arrays mapped from disk) of a complete entry, or None (missing or damaged:
  a damaged entry is removed)."""
  d = models_dir() / key
  try:
    manifest = json.loads((d / "manifest.json").read_text())
    if manifest.get("format") != FORMAT:
      raise ValueError("format")
    for name, size in manifest["sizes"].items():
      if (d / name).stat().st_size != size:
        raise ValueError(name)
    arrays = {}
    for name, info in manifest["arrays"].items():
      path = d / info["file"]
      if path.stat().st_size != info["bytes"]:
        raise ValueError(name)
      a = np.load(path, mmap_mode="r")
      if info["dtype"] == "bfloat16" and a.dtype == np.uint16:
        import ml_dtypes
        a = a.view(ml_dtypes.bfloat16)
      if list(a.shape) != info["shape"] or a.dtype.name != info["dtype"]:
        raise ValueError(name)
      arrays[name] = a
    config = Config(**json.loads((d / "config.json").read_text()))
    tokenizer_state = json.loads((d / "tokenizer.json").read_text())
  except FileNotFoundError:
    if d.exists():
      shutil.rmtree(d, ignore_errors=True)
    return None
  except (OSError, ValueError, TypeError, KeyError):
    shutil.rmtree(d, ignore_errors=True)
    return None
  return config, tokenizer_state, arrays


def clear() -> list[str]:
  """Removes the converted models and the compiled executables; returns what was removed."""
  removed = []
  for d in (models_dir(), compile_dir(), executables_dir()):
    if d.exists():
      shutil.rmtree(d)
      removed.append(str(d))
  return removed


def compile_cache_enabled() -> bool:
  """Whether compiled steps are kept on disk: yes unless JAXLLM_COMPILE_CACHE=0 (the CLI's default)."""
  return os.environ.get("JAXLLM_COMPILE_CACHE", "1").strip().lower() not in ("0", "false", "off")


def enable_compile_cache() -> str | None:
  """Turns on JAX's persistent compilation cache under the jaxllm cache directory (for programs of your
  own; the engine keeps whole executables instead, see Engine(cache_executables=True), and the two are
  not to be mixed: an executable JAX's cache returned does not always serialize whole). Returns the
  directory, or None when JAXLLM_COMPILE_CACHE=0."""
  if not compile_cache_enabled():
    return None
  import jax
  d = compile_dir()
  d.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(d))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return str(d)
