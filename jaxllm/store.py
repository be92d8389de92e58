"""The jaxllm cache directory: converted models, compiled executables, JAX's compilation cache.

The engine's compiled steps are kept as whole serialized executables (`<cache>/executables`), which load
without tracing the model again. Their key hashes what they compute (the engine's description), the jax
and jaxlib versions, the device and its platform version (the host's CPU flags on the CPU), XLA_FLAGS, the
JAX settings that change compiled code (_JAX_SETTINGS), and the code that built them: jaxllm's Python
files and the extension module actually loaded (`jaxllm._ffi.__file__`, which an editable install keeps
under build/). `enable_compile_cache()` turns on JAX's own persistent cache (`<cache>/xla`) for other
programs.

A converted model is a directory `<cache>/models/<key>/`: one .npy file per weight array (mapped, not read,
on a later run), `config.json`, `tokenizer.json` and `manifest.json` (written last, listing every file
with its size). The key hashes the GGUF's size, modification time, first and last MiB, the quantization,
the activation dtype and FORMAT, so a changed file, setting or jaxllm format never meets an old entry.
Writers build the entry in a private temporary directory and rename it into place: a concurrent writer or
a crash leaves no half entry visible, and a reader that finds a file missing, truncated or of the wrong
shape discards the entry and converts again.

Trust. An executable is unpickled and its native code loaded, so whoever can write the cache can run code
as the user; a converted model is data (.npy read without pickles, JSON, a sandboxed chat template), but
whoever writes it chooses what the model says. So every cache directory is created 0700, and one that is
owned by someone else or writable by group or others, from the cache root down, is not used: a
CacheWarning names it and says what to do, and the run goes on without that cache (an executable file is
also checked, through its open descriptor, to be the user's and not writable by others). The check stops
at the root: the directories above it are the user's to keep.

Failures. A cache that cannot be written (a read-only directory, a full disk) is a CacheWarning, once per
directory and process, and the run goes on without it. Temporary entries of writers that died (killed
mid-conversion) are removed the next time the cache is used: a model's temporary directory holds a lock
file (flock) for as long as its writer lives, so it is removed as soon as the lock is free and a long
conversion is never touched (on a network file system whose locks stay on one host, a run elsewhere may
take a live entry for a dead one: its writer then warns and goes on uncached); temporaries with no lock
(an executable being written, which takes seconds; a file system without locks; entries of older jaxllm
versions) are removed once they are STALE_SECONDS old.

`JAXLLM_CACHE` moves the cache (default ~/.cache/jaxllm, where demo models are downloaded too);
`clear()` (CLI: --clear-cache) removes the converted models and compiled executables, not the downloads.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import json
import os
import platform
import re
import shutil
import stat
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from jaxllm import lab
from jaxllm.config import Config

try:
  import fcntl
except ImportError:  # Windows: temporaries are then removed by age alone
  fcntl = None

FORMAT = 4          # bump when what convert() writes changes (4: Q4_K as LowBit, Mixed stacks)
_EDGE = 1 << 20     # bytes hashed at each end of the GGUF
STALE_SECONDS = 3600  # a temporary entry with no live lock this old is a dead writer's
_LOCK = ".writer"   # the lock file inside a model's temporary directory
_TEMP = re.compile(r"\.[^.]+\.[^.]+")   # the names of temporaries: .<key>.<random>
# JAX settings that change the program traced or compiled (jax's own persistent cache keys on the program
# text, which reflects them; an executable cache keyed on a description must name them).
_JAX_SETTINGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_dtype_promotion",
                 "jax_explicit_x64_dtypes", "jax_default_prng_impl", "jax_enable_custom_prng",
                 "jax_threefry_partitionable", "jax_threefry_gpu_kernel_lowering", "jax_high_dynamic_range_gumbel",
                 "jax_use_shardy_partitioner", "jax_optimization_level", "jax_memory_fitting_level",
                 "jax_exec_time_optimization_effort", "jax_memory_fitting_effort",
                 "jax_compiler_enable_remat_pass", "jax_enable_pgle", "jax_pgle_profiling_runs")
_NOT_CODE = ("JAXLLM_CACHE", "JAXLLM_COMPILE_CACHE", "JAXLLM_GIT_COMMIT")   # JAXLLM_* that never change code
# What each cache risks when others can write it (for the warning that refuses it).
_RISK = {
    "compiled executables": "run code as you (the executables kept there are unpickled and loaded as native code)",
    "JAX compilation cache": "run code as you (the executables kept there are loaded as native code)",
    "converted models": "choose what the model outputs (the weights kept there are used as they are)",
}
_warned: set[tuple[str, str]] = set()
_writing: set[str] = set()  # this process's own temporaries (hold_lock): never taken for a dead writer's


class CacheWarning(RuntimeWarning):
  """A cache jaxllm does not use (not private to the user, or not writable); the run goes on without it."""


def warn_once(kind: str, directory: Path | str, message: str) -> None:
  """Warns (CacheWarning) once per kind of trouble and directory in this process."""
  if (kind, str(directory)) in _warned:
    return
  _warned.add((kind, str(directory)))
  warnings.warn(message, CacheWarning, stacklevel=3)


def cache_dir() -> Path:
  """The cache root: JAXLLM_CACHE, default ~/.cache/jaxllm."""
  return Path(os.environ.get("JAXLLM_CACHE") or Path.home() / ".cache" / "jaxllm").expanduser()


def models_dir() -> Path:
  return cache_dir() / "models"


def compile_dir() -> Path:
  return cache_dir() / "xla"


def executables_dir() -> Path:
  return cache_dir() / "executables"


def make_private_dir(path: Path) -> None:
  """Creates path and any missing directories above it, each 0700 (an existing one is left as it is);
  raises OSError when that is not possible."""
  missing = []
  p = Path(path)
  while not p.is_dir():
    missing.append(p)
    if p.parent == p:
      break
    p = p.parent
  for p in reversed(missing):
    try:
      p.mkdir(mode=0o700)
    except FileExistsError:
      if not p.is_dir():       # a file where a directory belongs
        raise
      # else: a concurrent run made it


def why_untrusted(st: os.stat_result) -> str | None:
  """Why a directory or file (its stat) is not the user's alone to write, or None when it is."""
  if not hasattr(os, "geteuid"):      # Windows: no owners and modes to check
    return None
  uid = os.geteuid()
  if st.st_uid != uid:
    return f"it is owned by uid {st.st_uid}, not by you (uid {uid})"
  if st.st_mode & 0o022:
    who = " and ".join(w for w, bit in (("its group", 0o020), ("others", 0o002)) if st.st_mode & bit)
    return f"it is writable by {who} (mode {stat.S_IMODE(st.st_mode):o})"
  return None


def private_dir(d: Path, what: str) -> Path | None:
  """d, made if needed (0700), when it and every directory from the cache root down to it are the user's
  alone to write; else None, after a CacheWarning (once) that says which directory and what to do. `what`
  names the cache (a key of _RISK)."""
  d, root = Path(d), cache_dir()
  rel = d.relative_to(root).parts if d.is_relative_to(root) else None
  chain = [root.joinpath(*rel[:i]) for i in range(len(rel) + 1)] if rel is not None else [d]
  try:
    make_private_dir(d)
    stats = [(p, os.stat(p)) for p in chain]
  except OSError as e:
    warn_once("unwritable", d, f"jaxllm: cannot create the {what} cache {d} ({e}); running without it (set "
                               "JAXLLM_CACHE to a directory you can write)")
    return None
  for p, st in stats:
    why = why_untrusted(st)
    if why is not None:
      fix = f"chmod 700 {p}" if st.st_uid == os.geteuid() else "have it given to you (chown)"
      warn_once("untrusted", d, f"jaxllm: not using the {what} cache in {d}: {p} is not private to you, {why}; "
                                f"whoever can write it could {_RISK[what]}. Make it private ({fix}) or set "
                                "JAXLLM_CACHE to a directory of your own; running without this cache meanwhile")
      return None
  return d


def _writer_gone(tmp: Path) -> bool | None:
  """Whether the writer of a temporary entry has died (True: its lock is free), lives (False), or cannot be
  told (None: no lock file, one that is not a regular file (a FIFO would block the open), or no locks)."""
  if fcntl is None:
    return None
  try:
    fd = os.open(tmp / _LOCK, os.O_WRONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
  except OSError:
    return None
  try:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
      return None
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return True
  except BlockingIOError:
    return False
  except OSError:
    return None
  finally:
    os.close(fd)


def hold_lock(tmp: Path) -> int | None:
  """Marks the temporary directory tmp as this live process's: locks a new file and names it tmp/.writer
  (the name appears only once it is locked). Returns the lock's descriptor, or None where locks do not work;
  release_lock() ends it."""
  _writing.add(str(tmp))
  try:
    return _lock_file(tmp)
  except OSError:
    _writing.discard(str(tmp))
    raise


def _lock_file(tmp: Path) -> int | None:
  if fcntl is None:
    return None
  fd, path = tempfile.mkstemp(prefix=".lock.", dir=tmp)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:                    # a file system without locks: the age rule alone applies
    os.close(fd)
    os.unlink(path)
    return None
  try:
    os.rename(path, tmp / _LOCK)
  except OSError:
    os.close(fd)
    raise
  return fd


def release_lock(tmp: Path, fd: int | None) -> None:
  """Ends hold_lock(tmp) (tmp itself may be gone: renamed into place or removed)."""
  _writing.discard(str(tmp))
  if fd is not None:
    os.close(fd)


def remove_stale(d: Path, prefix: str | None = None) -> list[str]:
  """Removes the temporaries in d whose writers died: a directory whose lock is free, or with no lock and
  untouched for STALE_SECONDS; a file untouched for STALE_SECONDS. Temporaries are the names
  `.<key>.<random>` (in jaxllm's own subdirectories), or `<prefix><random>` when prefix is given (in the
  cache root, which may hold the user's own files). Returns the names removed."""
  try:
    names = os.listdir(d)
  except OSError:
    return []
  pattern = _TEMP if prefix is None else re.compile(re.escape(prefix) + r"[^.]+")
  removed, now = [], time.time()
  for name in names:
    p = d / name
    if not pattern.fullmatch(name) or str(p) in _writing:   # (a POSIX lock never conflicts within a process)
      continue
    try:
      st = os.lstat(p)
    except OSError:
      continue
    old = now - st.st_mtime > STALE_SECONDS
    if stat.S_ISDIR(st.st_mode):
      gone = _writer_gone(p)
      if gone or (gone is None and old):
        shutil.rmtree(p, ignore_errors=True)
        removed.append(name)
    elif old:
      with contextlib.suppress(OSError):
        p.unlink()
        removed.append(name)
  return removed


def _extension_file() -> str | None:
  """The file of the extension module actually loaded (an editable install finds it under build/ through
  its redirect, not in jaxllm/), or None when it is not built."""
  try:
    return importlib.import_module("jaxllm._ffi").__file__
  except ImportError:
    return None


@functools.lru_cache(maxsize=None)
def code_version() -> str:
  """A hash of jaxllm's own code (its Python files and the extension module loaded): compiled steps made
  by other code are never reused."""
  root = Path(__file__).resolve().parent
  h = hashlib.sha256()
  for path in sorted(root.rglob("*.py")):
    h.update(path.relative_to(root).as_posix().encode())
    h.update(path.read_bytes())
  ext = _extension_file()
  h.update(b"extension:")
  if ext is not None:
    with open(ext, "rb") as f:
      for chunk in iter(lambda: f.read(1 << 22), b""):
        h.update(chunk)
  return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def _host_cpu() -> str:
  """The host's CPU model and features (XLA compiles CPU code for the host it runs on)."""
  flags = ""
  try:
    with open("/proc/cpuinfo") as f:
      flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
  except OSError:
    pass
  return f"{platform.machine()} {flags.strip()}"


def compile_settings() -> dict:
  """What, besides the program, decides the code XLA builds: XLA_FLAGS, the JAX settings in _JAX_SETTINGS,
  and, in a lab build (jaxllm.lab), the JAXLLM_* switches."""
  import jax
  settings = {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
  for name in _JAX_SETTINGS:
    settings[name] = str(getattr(jax.config, name, None))
  if lab.lab_build():
    settings.update((k, v) for k, v in os.environ.items() if k.startswith("JAXLLM_") and k not in _NOT_CODE)
  return settings


def executable_key(*parts) -> str:
  """A key for a compiled executable: the given description, the jax and jaxlib versions, the device (kind,
  platform version; the host CPU on the CPU), compile_settings() and jaxllm's code version."""
  import jax
  import jaxlib
  dev = jax.devices()[0]
  client = getattr(dev, "client", None)
  text = repr((parts, jax.__version__, jaxlib.__version__, dev.platform, getattr(dev, "device_kind", ""),
               getattr(client, "platform_version", ""), _host_cpu() if dev.platform == "cpu" else "",
               sorted(compile_settings().items()), code_version()))
  return hashlib.sha256(text.encode()).hexdigest()[:32]


def load_executable(key: str):
  """A compiled executable saved under key, or None: missing, in a cache not private to the user (see the
  module docstring), or not loadable here (then it is removed)."""
  d = private_dir(executables_dir(), "compiled executables")
  if d is None:
    return None
  remove_stale(d)
  path = d / f"{key}.bin"
  try:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
  except FileNotFoundError:
    return None
  except OSError:                    # a link, or unreadable: not ours to load
    return None
  with os.fdopen(fd, "rb") as f:
    st = os.fstat(f.fileno())
    why = why_untrusted(st) if stat.S_ISREG(st.st_mode) else "it is not a regular file"
    if why is not None:
      warn_once("untrusted file", path, f"jaxllm: not loading the compiled executable {path}: {why}. Remove it, "
                                        f"or clear the cache (--clear-cache)")
      return None
    blob = f.read()
  try:
    import pickle
    from jax.experimental.serialize_executable import deserialize_and_load
    payload, in_tree, out_tree = pickle.loads(blob)
    return deserialize_and_load(payload, in_tree, out_tree)
  except Exception:  # a damaged or foreign file: compile again
    with contextlib.suppress(OSError):
      path.unlink(missing_ok=True)
    return None


def save_executable(key: str, compiled) -> bool:
  """Saves a compiled executable (atomically: a private file renamed into place); True if it did. Where the
  cache cannot be written, warns once and keeps nothing."""
  import pickle
  from jax.experimental.serialize_executable import serialize
  try:
    blob = pickle.dumps(serialize(compiled))
  except Exception:  # an executable XLA cannot serialize: it is simply not cached
    return False
  d = private_dir(executables_dir(), "compiled executables")
  if d is None:
    return False
  remove_stale(d)
  tmp = None
  try:
    fd, tmp = tempfile.mkstemp(prefix=f".{key}.", dir=d)
    with os.fdopen(fd, "wb") as f:
      f.write(blob)
    os.replace(tmp, d / f"{key}.bin")
    return True
  except OSError as e:
    if tmp is not None:
      Path(tmp).unlink(missing_ok=True)
    warn_once("unwritable", d, f"jaxllm: cannot write compiled executables to {d} ({e}); running without keeping "
                               "them (free space, set JAXLLM_CACHE to a writable directory, or JAXLLM_COMPILE_CACHE=0)")
    return False


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
  directory, or None when JAXLLM_COMPILE_CACHE=0 or the directory is not private to the user (warned)."""
  if not compile_cache_enabled():
    return None
  import jax
  d = private_dir(compile_dir(), "JAX compilation cache")
  if d is None:
    return None
  jax.config.update("jax_compilation_cache_dir", str(d))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return str(d)
