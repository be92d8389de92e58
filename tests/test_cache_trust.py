"""The cache directory as a trust boundary (jaxllm.cachedir, executables, store): private directories,
refused shared ones, keys that name everything that changes compiled code, unwritable caches that only
warn, dead writers' temporaries removed, and a test session that keeps out of ~/.cache.

Running as root, chmod does not stop writes: an unwritable cache is a path under a regular file, or a
write that fails through a monkeypatch (a full disk, a read-only directory)."""
import errno
import hashlib
import os
import pickle
import stat
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxllm
from jaxllm import cachedir, executables, models, store
from jaxllm.progress import Stages
from tiny import write_tiny_model

_PLANTED = "JAXLLM_TEST_PLANTED_CODE_RAN"


@pytest.fixture
def cache(tmp_path, monkeypatch, own_compiles):
  """A fresh cache root for one test (not yet made), with the once-per-process warnings forgotten; JAX's
  persistent cache off (where it is on, the engine keeps no executables)."""
  root = tmp_path / "cache"
  monkeypatch.setenv("JAXLLM_CACHE", str(root))
  monkeypatch.setattr(cachedir, "_warned", set())
  return root


def _compiled():
  return jax.jit(lambda x: x * 2 + 1).lower(jnp.arange(4.0)).compile()


def _mode(path) -> int:
  return stat.S_IMODE(os.stat(path).st_mode)


class _Planted:
  """Unpickling it runs code: what a writer of someone else's cache could leave there."""

  def __reduce__(self):
    return exec, (f"import os; os.environ[{_PLANTED!r}] = '1'",)


def _give_away(path, monkeypatch) -> Path:
  """Makes path someone else's (chown, as root) or, not being root, the whole cache (this process pretends
  to be another user); returns the directory the refusal will name."""
  if os.geteuid() == 0:
    os.chown(path, 4242, -1)
    return path
  uid = os.geteuid() + 1
  monkeypatch.setattr(os, "geteuid", lambda: uid)
  return cachedir.cache_dir()


def test_cache_directories_are_made_private(cache, tmp_path):
  old = os.umask(0o022)
  try:
    path = write_tiny_model(tmp_path / "m.gguf", "llama")
    jaxllm.load(path, progress=False)
    executables.save_executable("k" * 32, _compiled())
  finally:
    os.umask(old)
  for d in (cache, cachedir.models_dir(), cachedir.executables_dir()):
    assert _mode(d) == 0o700, (d, oct(_mode(d)))
  assert executables.load_executable("k" * 32) is not None


@pytest.mark.parametrize("where", ["root", "executables", "owner"])
def test_an_executable_cache_others_could_write_is_not_loaded(cache, monkeypatch, where):
  executables.save_executable("good", _compiled())
  d = cachedir.executables_dir()
  (d / "planted.bin").write_bytes(pickle.dumps(_Planted()))
  monkeypatch.delenv(_PLANTED, raising=False)
  if where == "owner":
    named = _give_away(d, monkeypatch)
  else:
    named = cache if where == "root" else d
    os.chmod(named, 0o777 if where == "root" else 0o770)
  with pytest.warns(cachedir.CacheWarning) as record:
    assert executables.load_executable("planted") is None
    assert _PLANTED not in os.environ                                 # the pickle was never opened
    assert executables.load_executable("good") is None
    executables.save_executable("new", _compiled())
  assert len(record) == 1, [str(w.message) for w in record]            # once
  message = str(record[0].message)
  assert f"{named} is not private" in message and "run code as you" in message
  assert ("(chown)" if where == "owner" else f"chmod 700 {named}") in message and "JAXLLM_CACHE" in message
  assert not (d / "new.bin").exists()


def test_an_executable_file_others_could_write_is_not_loaded(cache, monkeypatch):
  executables.save_executable("good", _compiled())
  path = cachedir.executables_dir() / "good.bin"
  os.chmod(path, 0o666)
  with pytest.warns(cachedir.CacheWarning, match="writable by its group and others"):
    assert executables.load_executable("good") is None
  os.chmod(path, 0o600)
  assert executables.load_executable("good") is not None
  os.symlink(path, cachedir.executables_dir() / "link.bin")              # a link is not followed
  assert executables.load_executable("link") is None


def test_a_private_cache_loads_its_executables_and_drops_damaged_ones(cache):
  executables.save_executable("good", _compiled())
  assert executables.load_executable("good")(jnp.arange(4.0)).tolist() == [1.0, 3.0, 5.0, 7.0]
  (cachedir.executables_dir() / "bad.bin").write_bytes(b"not a pickle")
  assert executables.load_executable("bad") is None and not (cachedir.executables_dir() / "bad.bin").exists()


def test_nothing_is_kept_while_jaxs_own_cache_is_on(cache, tmp_path):
  """An executable JAX's persistent cache returned serializes without its functions on the CPU: kept, it loaded
  and then failed when called ("Function broadcast_add_fusion not found"). While that cache is on (here as a
  user's JAX_COMPILATION_CACHE_DIR sets it), nothing is kept, and the program runs from JAX's cache."""
  code = ("import jax, jax.numpy as jnp; from jaxllm import executables; "
          "f = lambda: jax.jit(lambda x: x * 2 + 1).lower(jax.ShapeDtypeStruct((4,), jnp.float32)).compile(); "
          "f(); print(executables.save_executable('k', f()), f()(jnp.arange(4.0)).tolist())")
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0", JAX_PLATFORMS="cpu")
  run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
  assert run.returncode == 0 and run.stdout.split() == ["False", "[1.0,", "3.0,", "5.0,", "7.0]"], run.stderr[-2000:]
  assert list((tmp_path / "xla").iterdir()) and not list(cachedir.executables_dir().glob("*.bin"))
  gguf = write_tiny_model(tmp_path / "m.gguf", "qwen2")
  cli = subprocess.run([sys.executable, "-m", "jaxllm.generate", gguf, "-p", "the", "-n", "2"], capture_output=True,
                       text=True, env=env, timeout=300)
  assert cli.returncode == 0 and "kept by JAX's own compilation cache (JAX_COMPILATION_CACHE_DIR)" in cli.stderr, \
      cli.stderr[-2000:]
  assert executables.save_executable("k", _compiled())                # JAX's cache off again: kept


def test_a_compile_under_jax_cache_off_compiles(tmp_path):
  """graphs.graph_state reads the dump XLA writes while it compiles; JAX's cache key leaves the dump options out,
  so with a user's JAX_COMPILATION_CACHE_DIR a cached program came back with no dump ("state": "unknown" on the
  GPU). Under executables.jax_cache_off a compile compiles and dumps; the cache is on again after it. (An
  executable from the cache writes only its final HLO; the HLO before XLA's passes is dumped only by a compile.)"""
  code = ("import glob, sys, jax, jax.numpy as jnp; from jaxllm.executables import jax_cache_off, jax_cache_active\n"
          "def c(d): jax.jit(lambda x: x * 5 - 2, compiler_options={'xla_dump_to': d})"
          ".lower(jax.ShapeDtypeStruct((4,), jnp.float32)).compile()\n"
          "c(sys.argv[1] + '/a'); c(sys.argv[1] + '/b')\n"
          "with jax_cache_off(): c(sys.argv[1] + '/c')\n"
          "c(sys.argv[1] + '/d')\n"
          "print(jax_cache_active(), *(bool(glob.glob(sys.argv[1] + f'/{k}/*before_optimizations*')) for k in 'abcd'))")
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0", JAX_PLATFORMS="cpu")
  run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "dumps")], capture_output=True, text=True, env=env,
                       timeout=120)
  # a: compiled (and cached); b: the cache's, no dump; c: compiled under jax_cache_off; d: the cache's again
  assert run.returncode == 0 and run.stdout.split() == ["True", "True", "False", "True", "False"], run.stderr[-2000:]


def test_a_kept_executable_runs_on_its_device_of_several(cache):
  """On a host of several devices (two simulated CPUs: the flag needs a process of its own), an executable kept
  in one run loads and runs in the next (it was loaded onto every device and failed: "Expected args to
  execute_sharded_on_local_devices to have 2 shards"); a program over both devices is not kept."""
  code = ("import sys, jax, jax.numpy as jnp, numpy as np; from jaxllm import executables; "
          "from jax.sharding import Mesh, NamedSharding, PartitionSpec as P; "
          "f = jax.jit(lambda x: x * 2 + 1).lower(jax.ShapeDtypeStruct((4,), jnp.float32)).compile(); "
          "two = NamedSharding(Mesh(np.array(jax.devices()), ('x',)), P('x')); "
          "g = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((4,), jnp.float32, sharding=two)).compile(); "
          "print(executables.save_executable('one', f), executables.save_executable('two', g)) "
          "if sys.argv[1] == 'save' else print(executables.load_executable('one')(jnp.arange(4.0)).tolist(), "
          "executables.load_executable('two'))")
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
  runs = [subprocess.run([sys.executable, "-c", code, step], capture_output=True, text=True, env=env, timeout=120)
          for step in ("save", "load")]
  assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr[-2000:]
  assert runs[0].stdout.split() == ["True", "False"] and runs[1].stdout.strip() == "[1.0, 3.0, 5.0, 7.0] None"


def test_a_models_cache_others_could_write_is_not_used(cache, tmp_path):
  path = write_tiny_model(tmp_path / "m.gguf", "qwen2")
  _, w1, _ = jaxllm.load(path, progress=False)
  os.chmod(cachedir.models_dir(), 0o777)
  stages = Stages(quiet=True)
  with pytest.warns(cachedir.CacheWarning, match=r"converted models cache .* is not private .*choose what the model"):
    _, w2, _ = jaxllm.load(path, progress=stages)
  assert "read model" in stages.times                                 # converted again, not read from there
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(w1), jax.tree.leaves(w2)))


def test_executable_keys_name_xla_flags_jax_settings_and_the_extension(cache, tmp_path, monkeypatch):
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  base = executables.executable_key("step")
  assert executables.executable_key("step") == base
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
  assert executables.executable_key("step") != base
  monkeypatch.delenv("XLA_FLAGS")
  with jax.default_matmul_precision("highest"):
    assert executables.executable_key("step") != base
  with jax.enable_x64(True):
    assert executables.executable_key("step") != base
  from jax._src import config as jax_config
  with jax_config.jax_xla_profile_version(7):                         # read by XLA's compile options (AutoFDO)
    assert executables.executable_key("step") != base
  assert executables.executable_key("step") == base
  ext = tmp_path / "_ffi.cpython-test.so"                             # as found through an editable install's redirect
  ext.write_bytes(b"\x7fELF one build")
  monkeypatch.setitem(sys.modules, "jaxllm._ffi", types.SimpleNamespace(__file__=str(ext)))
  executables.code_version.cache_clear()
  try:
    first = executables.executable_key("step")
    ext.write_bytes(b"\x7fELF a rebuild")
    executables.code_version.cache_clear()
    assert executables.executable_key("step") != first
  finally:
    executables.code_version.cache_clear()


def test_an_unwritable_cache_warns_once_and_the_run_goes_on(tmp_path, monkeypatch, own_compiles):
  (tmp_path / "file").write_text("a regular file")
  monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path / "file" / "cache"))   # cannot be made, even by root
  monkeypatch.setattr(cachedir, "_warned", set())
  path = write_tiny_model(tmp_path / "m.gguf", "llama")
  with pytest.warns(cachedir.CacheWarning) as record:
    config, weights, tok = jaxllm.load(path, progress=False)
    jaxllm.load(path, progress=False)
    executables.save_executable("k", _compiled())
    executables.save_executable("k", _compiled())
    assert executables.load_executable("k") is None
  messages = [str(w.message) for w in record]
  assert len(messages) == 2, messages                                 # once per cache
  assert all("cannot create" in m and "running without it" in m and "JAXLLM_CACHE" in m for m in messages)
  engine = jaxllm.Engine(config, weights, tok, max_context=32, cache_executables=True)
  assert len(engine.generate(tok.encode("the cat"), 3, ignore_eos=True).ids) == 3


def test_a_full_disk_mid_conversion_warns_once_and_leaves_nothing(cache, tmp_path, monkeypatch):
  path = write_tiny_model(tmp_path / "m.gguf", "qwen2")
  real_save, calls = np.save, []

  def save(file, array):
    calls.append(file)
    if len(calls) > 2:
      raise OSError(errno.ENOSPC, "No space left on device")
    real_save(file, array)
  monkeypatch.setattr(np, "save", save)
  with pytest.warns(cachedir.CacheWarning) as record:
    _, w1, _ = jaxllm.load(path, progress=False)
  assert len(record) == 1 and "No space left" in str(record[0].message), [str(w.message) for w in record]
  assert len(calls) == 3                                              # no more writes once it failed
  assert not list(cachedir.models_dir().iterdir())                       # the partial entry is gone
  monkeypatch.setattr(np, "save", real_save)
  _, w2, _ = jaxllm.load(path, progress=False)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(w1), jax.tree.leaves(w2)))


def test_a_read_only_executable_cache_warns_once(cache, monkeypatch):
  cachedir.executables_dir().mkdir(parents=True)
  compiled = _compiled()

  def read_only(*args, **kwargs):
    raise PermissionError(errno.EROFS, "Read-only file system")
  monkeypatch.setattr(executables.tempfile, "mkstemp", read_only)
  with pytest.warns(cachedir.CacheWarning) as record:
    executables.save_executable("a", compiled)
    executables.save_executable("b", compiled)
  assert len(record) == 1 and "Read-only file system" in str(record[0].message)
  assert not list(cachedir.executables_dir().iterdir())


def _age(path, seconds):
  t = time.time() - seconds
  os.utime(path, (t, t))


def test_a_killed_conversion_leaves_nothing_behind_for_long(cache, tmp_path):
  """A conversion in another process: its temporary directory stays while it lives, however old, and goes
  at the next use of the cache once it is killed (its lock died with it). This process's own entry stays;
  lock-less temporaries go once they are STALE_SECONDS old."""
  code = ("import sys, numpy as np; from jaxllm import store; e = store.Entry('other'); "
          "e.add('x', np.zeros(1000)); print('ready', flush=True); sys.stdin.read()")
  proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  d = cachedir.models_dir()
  try:
    assert proc.stdout.readline() == "ready\n"
    (other,) = [p for p in d.iterdir() if p.name.startswith(".other.")]
    _age(other, 2 * cachedir.STALE_SECONDS)                              # a long conversion, still going
    assert store.load("some-key") is None and other.exists()
  finally:
    proc.kill()
    proc.wait()
  assert other.exists()                                               # what a killed run leaves
  live = store.Entry("live")
  live.add("x", np.zeros(10))
  fresh, old = d / ".fresh.abc", d / ".old.abc"
  fresh.mkdir()
  old.mkdir()
  (old / "x.npy").write_bytes(b"0" * 100)
  _age(old, 2 * cachedir.STALE_SECONDS)
  assert store.load("some-key") is None                               # any use of the cache cleans
  left = sorted(p.name.split(".")[1] for p in d.iterdir())
  assert left == ["fresh", "live"], left
  path = write_tiny_model(tmp_path / "m.gguf", "llama")
  config, _, tok = jaxllm.load(path, progress=False, cache=False)
  live.commit(config, tok.to_state())                                 # the live writer was not disturbed
  assert store.load("live")[2]["x"].shape == (10,)


def test_a_fifo_as_a_lock_file_does_not_block_the_cleaning(cache):
  """A FIFO planted where a temporary's lock file goes: opening it for writing would block forever; it is
  treated as no lock (an old temporary goes, a fresh one stays), at once."""
  d = cachedir.models_dir()
  d.mkdir(parents=True, exist_ok=True)
  for name in (".planted.abc", ".fresh.abc"):
    (d / name).mkdir()
    os.mkfifo(d / name / cachedir._LOCK)
  _age(d / ".planted.abc", 2 * cachedir.STALE_SECONDS)
  t0 = time.perf_counter()
  assert store.load("some-key") is None
  assert time.perf_counter() - t0 < 1.0
  assert sorted(p.name for p in d.iterdir() if p.name.startswith(".")) == [".fresh.abc"]


def test_stale_executable_temporaries_are_removed(cache):
  executables.save_executable("first", _compiled())
  d = cachedir.executables_dir()
  (d / ".old.x1").write_bytes(b"half an executable")
  (d / ".new.x2").write_bytes(b"being written")
  _age(d / ".old.x1", 2 * cachedir.STALE_SECONDS)
  assert executables.load_executable("first") is not None
  assert sorted(p.name for p in d.iterdir()) == [".new.x2", "first.bin"]


def test_the_test_session_keeps_out_of_the_users_cache():
  home_cache = Path.home() / ".cache"
  code = "from jaxllm import cachedir; print(cachedir.cache_dir(), cachedir.executables_dir(), cachedir.models_dir())"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
  here = [cachedir.cache_dir(), cachedir.models_dir(), cachedir.compile_dir(), cachedir.executables_dir()]
  for p in here + [Path(p) for p in out] + [Path(os.environ.get("XDG_CACHE_HOME", home_cache))]:
    assert not p.resolve().is_relative_to(home_cache.resolve()), p
  assert models.cache_dir() == cachedir.cache_dir()                       # demo-model downloads go there too


def test_every_demo_model_is_pinned():
  for spec in models.DEMO_MODELS.values():
    assert spec.size and spec.sha256 and len(spec.sha256) == 64, spec


def test_a_demo_model_in_a_shared_directory_is_checked_before_use(cache, monkeypatch):
  good = b"the real model"
  spec = models.DemoModel(name="tiny", filename="tiny.gguf", parts=(), size=len(good),
                          sha256=hashlib.sha256(good).hexdigest())
  monkeypatch.setitem(models.DEMO_MODELS, "tiny", spec)
  downloads = []

  def download(spec, target, stages):
    downloads.append(target)
    target.write_bytes(good)
    return target
  monkeypatch.setattr(models, "_download", download)
  cache.mkdir(mode=0o700)
  fake = b"x" * len(good)                                             # the same size, other bytes
  (cache / "tiny.gguf").write_bytes(fake)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert models.fetch_demo_model("tiny").read_bytes() == fake       # private: the user's own file
  os.chmod(cache, 0o777)
  with pytest.warns(cachedir.CacheWarning, match="checked against its sha256"):
    assert models.fetch_demo_model("tiny").read_bytes() == good
  assert len(downloads) == 1
