"""The jaxllm cache directory and who may write it: where each cache lives, the trust check every cache
passes before it is used, and the locks and clean-up of writers' temporaries.

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

`JAXLLM_CACHE` moves the cache (default ~/.cache/jaxllm, where demo models are downloaded too).
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import tempfile
import time
import warnings
from pathlib import Path

try:
  import fcntl
except ImportError:  # Windows: temporaries are then removed by age alone
  fcntl = None

STALE_SECONDS = 3600  # a temporary entry with no live lock this old is a dead writer's
_LOCK = ".writer"   # the lock file inside a model's temporary directory
_TEMP = re.compile(r"\.[^.]+\.[^.]+")   # the names of temporaries: .<key>.<random>
# What each cache risks when others can write it (for the warning that refuses it).
_RISK = {
    "compiled executables": "run code as you (the executables kept there are unpickled and loaded as native code)",
    "JAX compilation cache": "run code as you (the executables kept there are loaded as native code)",
    "converted models": "choose what the model outputs (the weights kept there are used as they are)",
    "kernel tuning": "make the GPU's matmuls slower (the kernel configuration named there is run: each name is "
                     "checked to be one of the kernel's configurations, all correct up to f32 summation order)",
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


def tuning_dir() -> Path:
  return cache_dir() / "tuning"


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
