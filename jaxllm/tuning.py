"""Which tensor-core configuration the GPU's W8A16 matmul runs for each shape: measured on this GPU.

For 5-64 rows of bf16 x the matmul runs ffi/w8a16_mma.cuh, whose configurations (tiles of x and of w a warp,
warps splitting K, chunks in flight) are listed there as kCandidates, each for a row bucket (8, 16, 32 or 64
rows). Which one is fastest depends on the shape and on the card: on the H200 the best took 28% less time than
the built-in rule's on the 7B and 8B LM heads at 16 rows (since made the rule there) and 11-18% less on six other
shape-and-bucket cases (docs/results/2026-12-06-h100-autotune.md). Unless Engine(autotune=False) (or
JAXLLM_AUTOTUNE=0) turns it off, an engine's first program build times every configuration of the 8-, 16- and
32-row buckets (BUCKETS) on each of the model's W8A16 matmul shapes (N, K), on random weights spanning more than
the L2, in a child process (`ensure`; the tune handler, ffi/tune_cuda.cu), and keeps the fastest as the engine's
table; while the engine traces (`use`), linear() gives each matmul `choice(n, k, m)` (-1, the rule, for a shape
not timed, 33-64 rows, and outside an engine's tracing).

33-64 rows run the rule: there the tuner's timing disagreed with the sweep's (the 7B gate/up's Launch<8, 2, 8, 1>
108 us in the tuner, 119-120 in bench/gemv_sweep.cu, against 114 for the rule's in both), and on an H100 the 7B
step at batch 64 took 1.3% more time with its choices than with the rule
(docs/results/2026-12-06-h100-autotune-default.md).

Choices are kept in <cache>/tuning/ (jaxllm.cachedir), one JSON file a device kind, for the extension build
that timed them: a later run on the same card reads them instead of timing again. The file is checked like the
other caches (a regular file of the user's, in a private directory) and its content too (every choice one of
kCandidates, each right for any shape; a file that does not parse is timed again): whoever can write it could
make the matmuls slower, not wrong. The configurations sum K in different orders, so their outputs differ in the
last bits: which one a card's timing picked decides those bits.

On by default since the child process ran on the GPU: on an H100 at batch 16 the steps took 6.0% less time at
7B and 3.3% less at 0.5B than the rule's, the process whose child timed them included
(docs/results/2026-12-06-h100-autotune-default.md; timed inside the serving process, as first written, that
process ran 8% slower, cause not found). The first engine of a model on a card waits for the child (about 9 s at
7B on an H100); later runs read the file. This process keeps the choices known for one device kind: an engine on
another kind of card makes it read (or time) that kind's instead.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import os
import re
import stat
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Iterable

import numpy as np

from jaxllm import switches
from jaxllm.cachedir import private_dir, remove_stale, tuning_dir, warn_once, why_untrusted
from jaxllm.quant import GROUP   # the tensor-core kernel's scale group

FORMAT = 2                    # the file's layout, its buckets, and its indexes' meaning (w8a16_mma.cuh's kCandidates)
BUCKETS = (8, 16, 32)         # the row buckets timed and used (w8a16_mma.cuh's Bucket; its 64 runs the rule, below)
MIN_M = 5                     # rows of x from which the tensor-core kernel runs (kMinM)
SPAN_BYTES = 128 << 20        # weight copies timed in rotation: more than any GPU's L2 (50-60 MB on Hopper)
MAX_COPIES = 256              # (a 576 x 576 matmul: 85 MB)
MAX_FILE_BYTES = 8 << 20
CHILD_SECONDS = 240           # the timing process's limit (an 8B model's shapes took about 8 s in-process on an H200)

Table = dict[tuple[int, int, int], int]          # (N, K, bucket) -> index into kCandidates
_active: contextvars.ContextVar[Table | None] = contextvars.ContextVar("jaxllm_mma_table", default=None)
_kind: list[str] = [""]                          # the device kind the choices known here are for
_choices: Table = {}                             # every choice known in this process for that kind
_times: dict[str, list] = {}                     # "N,K,bucket" -> each configuration's us (None: not of it)
_loaded: set[str] = set()                        # the files read in this process
_failed: set[tuple[int, int]] = set()            # (N, K) whose timing failed in this process: the rule


def enabled() -> bool:
  """The default of Engine(autotune=None): on, unless JAXLLM_AUTOTUNE is 0, false or off."""
  return switches.on("JAXLLM_AUTOTUNE")


def bucket(m: int) -> int | None:
  """The row bucket of m rows of x (w8a16_mma.cuh's Bucket), None past the last one timed."""
  return next((b for b in BUCKETS if m <= b), None)


def choice(n: int, k: int, m: int) -> int:
  """The configuration for x [m, k] @ w [n, k].T in the table in use (`use`, around an engine's tracing): its
  index in kCandidates, or -1 (the kernel's rule) outside one, for a shape it lacks, or m outside 5-32 rows."""
  table = _active.get()
  if table is None or not MIN_M <= m <= BUCKETS[-1]:
    return -1
  return table.get((int(n), int(k), bucket(m)), -1)


@contextlib.contextmanager
def use(table: Table | None):
  """The choices linear() gives the matmuls it traces inside this block (None: the rule everywhere)."""
  token = _active.set(table)
  try:
    yield
  finally:
    _active.reset(token)


def _candidates() -> int:
  from jaxllm.kernels import ffi
  return ffi.tuning_count()


def _build_id() -> str:
  """The extension build the choices are kept for (the one that timed them)."""
  from jaxllm import executables
  return executables.extension_hash()


def _file(device_kind: str) -> Path:
  name = re.sub(r"[^A-Za-z0-9._-]+", "_", device_kind).strip("._") or "gpu"
  return tuning_dir() / f"{name}.json"


def _valid(choices, count: int) -> dict[tuple[int, int, int], int] | None:
  """The choices of a file's "choices" entry ({"N,K,bucket": index}), or None when any is malformed."""
  if not isinstance(choices, dict):
    return None
  out = {}
  for key, idx in choices.items():
    parts = key.split(",") if isinstance(key, str) else []
    if len(parts) != 3 or not all(re.fullmatch(r"[1-9][0-9]{0,8}", p) for p in parts):
      return None
    if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < count or int(parts[2]) not in BUCKETS:
      return None
    out[(int(parts[0]), int(parts[1]), int(parts[2]))] = idx
  return out


def _load(path: Path) -> dict | None:
  """The JSON object in path: None when missing; {} (warned once) when not the user's regular file in a private
  directory, too large, or not a JSON object."""
  if private_dir(path.parent, "kernel tuning") is None:
    return {}
  try:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
  except FileNotFoundError:
    return None
  except OSError as e:                                   # a link, or unreadable
    warn_once("unreadable tuning", path, f"jaxllm: ignoring the kernel tuning file {path} ({e}); timing again")
    return {}
  with os.fdopen(fd, "rb") as f:
    st = os.fstat(f.fileno())
    why = why_untrusted(st) if stat.S_ISREG(st.st_mode) else "it is not a regular file"
    if why is None and st.st_size > MAX_FILE_BYTES:
      why = f"{st.st_size} bytes, more than {MAX_FILE_BYTES}"
    try:
      data = None if why else json.loads(f.read(MAX_FILE_BYTES))
    except Exception as e:  # a damaged file: ValueError, RecursionError, UnicodeDecodeError
      why = f"{type(e).__name__}: {str(e)[:100]}"
  if why is None and not isinstance(data, dict):
    why = "not a JSON object"
  if why is not None:
    warn_once("unreadable tuning", path, f"jaxllm: ignoring the kernel tuning file {path} ({why}); timing again")
    return {}
  return data


def _read(path: Path, count: int) -> dict[tuple[int, int, int], int]:
  """The choices kept in path for this build, or {} (missing, another build, or malformed: warned once); their
  times go to _times."""
  data = _load(path) or {}
  if data.get("format") != FORMAT or data.get("candidates") != count or data.get("build") != _build_id():
    return {}
  choices = _valid(data.get("choices"), count)
  if choices is None:
    warn_once("unreadable tuning", path, f"jaxllm: ignoring the kernel tuning file {path} (a choice that is "
                                         f"not one of the {count} configurations); timing again")
    return {}
  times = data.get("times_us")
  if isinstance(times, dict):
    _times.update((key, v) for key, v in times.items() if isinstance(v, list) and len(v) == count)
  return choices


def _write(path: Path) -> None:
  """Saves this build's choices for the device, merged over what the file holds now (another process may have
  timed other shapes meanwhile), atomically; a cache that cannot be written is warned of once."""
  d = private_dir(path.parent, "kernel tuning")
  if d is None:
    return
  remove_stale(d)
  count = _candidates()
  choices = {**_read(path, count), **_choices}
  data = {"format": FORMAT, "build": _build_id(), "candidates": count,
          "choices": {f"{n},{k},{b}": i for (n, k, b), i in sorted(choices.items())},
          "times_us": dict(sorted(_times.items()))}
  try:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=d)
    with os.fdopen(fd, "w") as f:
      json.dump(data, f, indent=1)
    os.replace(tmp, path)
  except OSError as e:
    warn_once("unwritable", d, f"jaxllm: cannot save the kernel tuning in {d} ({e}); it is timed again next run")


@functools.lru_cache(maxsize=None)
def _timer(n: int, k: int, copies: int):
  """A program timing every configuration of every bucket on w [copies, n, k]: -> [len(BUCKETS), count] us."""
  import jax
  import jax.numpy as jnp
  from jaxllm.kernels import ffi

  def run(key):
    kx, kw, ks = jax.random.split(key, 3)
    x = jax.random.uniform(kx, (BUCKETS[-1], k), jnp.float32, -1.0, 1.0).astype(jnp.bfloat16)
    w = jax.lax.bitcast_convert_type(jax.random.bits(kw, (copies, n, k), jnp.uint8), jnp.int8)
    s = jax.random.uniform(ks, (copies, n, k // GROUP), jnp.float32, 1e-3, 1e-2)
    return jnp.stack([ffi.w8a16_tune(x[:b], w, s) for b in BUCKETS])

  return jax.jit(run)


def measure(n: int, k: int) -> np.ndarray:
  """Microseconds a call of each configuration (columns: kCandidates) at each bucket's rows (rows: BUCKETS) on
  x [bucket, k] @ w [n, k].T, on the first GPU of this process; +inf where a configuration is not of that
  bucket. The engine runs it in a child process (ensure)."""
  import jax
  copies = int(min(MAX_COPIES, max(2, -(-SPAN_BYTES // (n * k)))))
  return np.asarray(jax.device_get(_timer(n, k, copies)(jax.random.key(0))))


def _record(n: int, k: int, t: np.ndarray) -> None:
  for i, b in enumerate(BUCKETS):
    if np.isfinite(t[i]).any():
      _choices[(n, k, b)] = int(np.argmin(np.where(np.isfinite(t[i]), t[i], np.inf)))
      _times[f"{n},{k},{b}"] = [round(float(v), 3) if np.isfinite(v) else None for v in t[i]]


def _use_kind(device_kind: str) -> None:
  """The table for device_kind: another kind's choices (an engine on another card in this process) are dropped."""
  if _kind[0] != device_kind:
    _kind[0] = device_kind
    _choices.clear()
    _times.clear()
    _loaded.clear()
    _failed.clear()


def ensure(shapes: Iterable[tuple[int, int]], device_kind: str) -> Table:
  """Choices for every (N, K) in shapes at every bucket: read from this device's file, the rest timed in a child
  process (`python -m jaxllm.tuning`, on the same first GPU, memory taken as needed: timing in the serving
  process made its own steps slower afterwards, docs/results/2026-12-06-h100-autotune.md) that updates the file.
  Shapes the kernel does not take (K not a multiple of 64) are skipped; a child that fails or takes more than
  CHILD_SECONDS is warned of, and its shapes run the rule. -> the choices for those shapes (a table for `use`)."""
  count = _candidates()
  if count == 0:
    return {}
  _use_kind(device_kind)
  path = _file(device_kind)
  if str(path) not in _loaded:
    _loaded.add(str(path))
    _choices.update(_read(path, count))
  want = {(int(n), int(k)) for n, k in shapes if k % GROUP == 0 and k > 0 and n > 0}
  todo = sorted(want - _failed - {(n, k) for n, k, _ in _choices})
  if todo:
    _time_in_child(todo, device_kind, count)
  return {key: idx for key, idx in _choices.items() if key[:2] in want}


def _time_in_child(todo: list[tuple[int, int]], device_kind: str, count: int) -> None:
  """Runs `python -m jaxllm.tuning` for the shapes todo and takes the choices it prints."""
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
  cmd = [sys.executable, "-m", "jaxllm.tuning", device_kind, *(f"{n},{k}" for n, k in todo)]
  got = None
  try:
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=CHILD_SECONDS)
    why = f"exit {done.returncode}: {done.stderr.strip()[-500:]}" if done.returncode else None
    lines = done.stdout.strip().splitlines()       # its choices, also those timed before a shape failed
    got = _valid(json.loads(lines[-1]), count) if lines else None
  except (OSError, ValueError, subprocess.TimeoutExpired) as e:
    why = str(e)
  for key, idx in (got or {}).items():            # the child's own choices (the file may hold another's by now)
    if key[:2] in todo:
      _choices.setdefault(key, idx)
  missing = [(n, k) for n, k in todo if any((n, k, b) not in _choices for b in BUCKETS)]
  if missing:
    _failed.update(missing)
    warnings.warn(f"jaxllm: timing the tensor-core matmul's configurations failed ({why or 'no choices given'}); "
                  f"{len(missing)} shape(s) run its built-in rule (Engine(autotune=False) skips the timing)",
                  RuntimeWarning, stacklevel=4)


def _main(argv: list[str] | None = None) -> int:
  """python -m jaxllm.tuning DEVICE_KIND N,K [N,K ...]: times each weight shape on this process's first GPU, saves
  the choices to DEVICE_KIND's file after each shape, and prints them as one JSON line (the child process of
  ensure). A shape whose timing fails is reported on stderr and left out (exit 1 when any failed)."""
  import argparse
  p = argparse.ArgumentParser(prog="python -m jaxllm.tuning", description=_main.__doc__)
  p.add_argument("device_kind")
  p.add_argument("shapes", nargs="+", metavar="N,K")
  args = p.parse_args(argv)
  shapes = []
  for text in args.shapes:
    parts = text.split(",")
    if (len(parts) != 2 or not all(re.fullmatch(r"[0-9]{1,9}", v) for v in parts) or int(parts[0]) < 1
        or int(parts[1]) < GROUP or int(parts[1]) % GROUP):
      p.error(f"expected N,K with N >= 1 and K a positive multiple of {GROUP}, got {text!r}")
    shapes.append((int(parts[0]), int(parts[1])))
  _use_kind(args.device_kind)
  path = _file(args.device_kind)
  failed = 0
  for n, k in shapes:
    try:
      _record(n, k, measure(n, k))
    except Exception as e:  # one shape's failure (out of memory, a launch error) leaves the others timed
      print(f"jaxllm.tuning: {n},{k}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
      failed += 1
      continue
    _write(path)
  print(json.dumps({f"{n},{k},{b}": i for (n, k, b), i in sorted(_choices.items())}))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(_main())
