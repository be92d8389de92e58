"""The cache of converted models (`<cache>/models`), and clearing the caches.

A converted model is a directory `<cache>/models/<key>/`: one .npy file per weight array (mapped, not read,
on a later run), `config.json`, `tokenizer.json` and `manifest.json` (written last, listing every file
with its size). The key hashes the GGUF's size, modification time, first and last MiB, the quantization,
the activation dtype and FORMAT, so a changed file, setting or jaxllm format never meets an old entry.
Writers build the entry in a private temporary directory and rename it into place: a concurrent writer or
a crash leaves no half entry visible, and a reader that finds a file missing, truncated or of the wrong
shape discards the entry and converts again.

Trust and failures are jaxllm.cachedir's: a models directory not private to the user is not used, and one
that cannot be written is a CacheWarning, the conversion going on uncached. `clear()` (CLI: --clear-cache)
removes the converted models and compiled executables, not the downloads.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from jaxllm.cachedir import _LOCK, compile_dir, executables_dir, hold_lock, models_dir, private_dir, release_lock, \
    remove_stale, tuning_dir, warn_once
from jaxllm.config import Config

FORMAT = 4          # bump when what convert() writes changes (4: Q4_K as LowBit, Mixed stacks)
_EDGE = 1 << 20     # bytes hashed at each end of the GGUF


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
  """One converted model being written: arrays go to a private directory as they are made.

  Where the cache is not private to the user, or cannot be written (a read-only directory, a full disk),
  the entry warns once, removes what it wrote, and takes no more: the conversion goes on uncached."""

  def __init__(self, key: str):
    self.key = key
    self.files: dict[str, dict] = {}
    self.tmp: Path | None = None
    self._held: tuple[Path, int | None] | None = None   # the temporary directory and its lock, until done
    self.dir = private_dir(models_dir(), "converted models")
    if self.dir is None:
      return
    remove_stale(self.dir)
    try:
      self.tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=self.dir))
      self._held = (self.tmp, hold_lock(self.tmp))
    except OSError as e:
      self._give_up(e)

  def add(self, name: str, array: np.ndarray) -> None:
    """Writes one array (bfloat16, which .npy cannot describe, as its 16-bit words)."""
    if self.tmp is None:
      return
    path = self.tmp / f"{name}.npy"
    stored = array.view(np.uint16) if array.dtype.name == "bfloat16" else array
    try:
      np.save(path, np.ascontiguousarray(stored))
      size = path.stat().st_size
    except OSError as e:
      self._give_up(e)
      return
    self.files[name] = {"file": path.name, "shape": list(array.shape), "dtype": array.dtype.name, "bytes": size}

  def commit(self, config: Config, tokenizer_state: dict) -> None:
    """Writes the config, tokenizer and manifest, then renames the entry into place (first writer wins)."""
    if self.tmp is None:
      return
    target = self.dir / self.key
    try:
      (self.tmp / "config.json").write_text(json.dumps(dataclasses.asdict(config)))
      (self.tmp / "tokenizer.json").write_text(json.dumps(tokenizer_state))
      manifest = {"format": FORMAT, "arrays": self.files,
                  "sizes": {n: (self.tmp / n).stat().st_size for n in ("config.json", "tokenizer.json")}}
      (self.tmp / "manifest.json").write_text(json.dumps(manifest))
      (self.tmp / _LOCK).unlink(missing_ok=True)
      os.rename(self.tmp, target)
    except OSError as e:
      if target.is_dir():            # another writer got there first: theirs is as good
        self.abort()
      else:
        self._give_up(e)
      return
    self.tmp = None
    self._release()

  def abort(self) -> None:
    """Removes what was written."""
    if self.tmp is not None:
      shutil.rmtree(self.tmp, ignore_errors=True)
      self.tmp = None
    self._release()

  def _give_up(self, error: OSError) -> None:
    self.abort()
    warn_once("unwritable", self.dir, f"jaxllm: cannot write converted models to {self.dir} ({error}); converting "
                                      "without caching (free space, set JAXLLM_CACHE to a writable directory, or "
                                      "pass cache=False / --no-cache)")

  def _release(self) -> None:
    if self._held is not None:
      release_lock(*self._held)
      self._held = None


def load(key: str) -> tuple[Config, dict, dict[str, np.ndarray]] | None:
  """(config, tokenizer state, arrays mapped from disk) of a complete entry, or None (missing, damaged or
  in a cache not private to the user: a damaged entry is removed). Removes dead writers' temporaries."""
  root = private_dir(models_dir(), "converted models")
  if root is None:
    return None
  remove_stale(root)
  d = root / key
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
      a = np.load(path, mmap_mode="r", allow_pickle=False)   # data only, whoever wrote it
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
  """Removes the converted models, the compiled executables and the kernel tuning; returns what was removed."""
  removed = []
  for d in (models_dir(), compile_dir(), executables_dir(), tuning_dir()):
    if d.exists():
      shutil.rmtree(d)
      removed.append(str(d))
  return removed
