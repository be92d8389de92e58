"""The cache of compiled executables (`<cache>/executables`), and JAX's own persistent cache for other
programs.

The engine's compiled steps are kept as whole serialized executables (`<cache>/executables`), which load
without tracing the model again. Their key hashes what they compute (the engine's description), the jax
and jaxlib versions, the device and its platform version (the host's CPU flags on the CPU), XLA_FLAGS, the
JAX settings that change compiled code (_JAX_SETTINGS), and the code that built them: jaxllm's Python
files and the extension module actually loaded (`jaxllm._ffi.__file__`, which an editable install keeps
under build/). `enable_compile_cache()` turns on JAX's own persistent cache (`<cache>/xla`) for other
programs.

Executables are unpickled and their native code loaded: the directory is used only when it is the user's
alone, and each file is checked, through its open descriptor, to be the user's and not writable by others
(jaxllm.cachedir says why and how). `JAXLLM_COMPILE_CACHE=0` keeps nothing, and so does a process where JAX's
own persistent cache is on (JAX_COMPILATION_CACHE_DIR): an executable that cache returns does not serialize whole.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import os
import platform
import stat
import tempfile
from pathlib import Path

from jaxllm import lab
from jaxllm.cachedir import compile_dir, executables_dir, private_dir, remove_stale, warn_once, why_untrusted

# JAX settings that change the program traced or compiled (jax's own persistent cache keys on the program
# text, which reflects them; an executable cache keyed on a description must name them).
_JAX_SETTINGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_dtype_promotion",
                 "jax_explicit_x64_dtypes", "jax_default_prng_impl", "jax_enable_custom_prng",
                 "jax_threefry_partitionable", "jax_threefry_gpu_kernel_lowering", "jax_high_dynamic_range_gumbel",
                 "jax_use_shardy_partitioner", "jax_optimization_level", "jax_memory_fitting_level",
                 "jax_exec_time_optimization_effort", "jax_memory_fitting_effort",
                 "jax_compiler_enable_remat_pass", "jax_enable_pgle", "jax_pgle_profiling_runs",
                 "jax_xla_profile_version")
_NOT_CODE = ("JAXLLM_CACHE", "JAXLLM_COMPILE_CACHE", "JAXLLM_GIT_COMMIT", "JAXLLM_API_KEY")   # JAXLLM_* that never change code

def _extension_file() -> str | None:
  """The file of the extension module actually loaded (an editable install finds it under build/ through
  its redirect, not in jaxllm/), or None when it is not built."""
  try:
    return importlib.import_module("jaxllm._ffi").__file__
  except ImportError:
    return None


def extension_hash() -> str:
  """A hash of the extension module loaded ("" when it is not built); read anew each call (code_version keeps
  its own)."""
  ext = _extension_file()
  if ext is None:
    return ""
  h = hashlib.sha256()
  with open(ext, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 22), b""):
      h.update(chunk)
  return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def code_version() -> str:
  """A hash of jaxllm's own code (its Python files and the extension module loaded): compiled steps made
  by other code are never reused."""
  root = Path(__file__).resolve().parent
  h = hashlib.sha256()
  for path in sorted(root.rglob("*.py")):
    h.update(path.relative_to(root).as_posix().encode())
    h.update(path.read_bytes())
  h.update(b"extension:" + extension_hash().encode())
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
    import jax
    payload, in_tree, out_tree, device_id = pickle.loads(blob)
    # The device it was compiled for: left to itself, deserialize_and_load would run it on every device of a
    # host with several (a 2-GPU machine: "Expected args ... to have 2 shards").
    device = next(d for d in jax.devices() if d.id == device_id)
    return deserialize_and_load(payload, in_tree, out_tree, execution_devices=[device])
  except Exception:  # a damaged or foreign file: compile again
    with contextlib.suppress(OSError):
      path.unlink(missing_ok=True)
    return None


def save_executable(key: str, compiled) -> bool:
  """Saves a compiled executable (atomically: a private file renamed into place); True if it did. Where the
  cache cannot be written, warns once and keeps nothing; while JAX's own persistent cache is on
  (jax_cache_active), keeps nothing."""
  import pickle
  import jax
  from jax.experimental.serialize_executable import serialize
  if jax_cache_active():             # the executable may be one JAX's cache returned: it may not serialize whole
    return False
  shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
  devices = {d for s in shardings for d in s.device_set}
  if len(devices) != 1:              # one device's programs only (a mesh's would need its devices in the key)
    return False
  try:
    blob = pickle.dumps((*serialize(compiled), devices.pop().id))
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


def jax_cache_active() -> bool:
  """Whether JAX's own persistent compilation cache is on (JAX_COMPILATION_CACHE_DIR, jax.config, or
  enable_compile_cache()). An executable it returned serializes without its compiled functions on the CPU: kept
  and loaded in a later run, it fails when called ("Function broadcast_add_fusion not found"). While it is on,
  save_executable keeps nothing and JAX's cache serves instead."""
  import jax
  return bool(jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir)


@contextlib.contextmanager
def jax_cache_off():
  """JAX's persistent compilation cache off while the block runs, then as it was: a compile inside compiles.
  graphs.graph_state needs that: it reads the dump XLA writes while compiling, and the cache's key leaves the
  dump options out, so an executable the cache holds would be returned with no dump written."""
  import jax
  from jax.experimental.compilation_cache import compilation_cache
  if not jax_cache_active():
    yield
    return
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()        # JAX decides once whether its cache is used: decide again
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()


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
