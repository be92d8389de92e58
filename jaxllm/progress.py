"""Progress a person can follow: one line per start-up stage with its time, a bar only on a terminal.

  [jaxllm] download: 12.1 s
  [jaxllm] read model: 0.52 s (cached conversion)
  [jaxllm] convert w8a16: 9.8 s
  [jaxllm] compile: 1.3 s

Lines go to stderr. quiet=True prints nothing; on a stream that is not a terminal (a log file, a pipe)
bars are left out and only the stage lines are written.
"""
from __future__ import annotations

import contextlib
import sys
import time


class Stages:
  """Times named stages and reports each as one line; `times` keeps the seconds of each."""

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
    """Times the block; prints `name: seconds (note)` when it ends. `note` may be changed via the yielded dict."""
    info = {"note": note}
    t0 = time.perf_counter()
    yield info
    dt = time.perf_counter() - t0
    self.times[name] = self.times.get(name, 0.0) + dt
    self.line(f"{name}: {dt:.2f} s" + (f" ({info['note']})" if info["note"] else ""))

  def bar(self, total: int, desc: str):
    """A tqdm bar on a terminal, else one that draws nothing."""
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=f"[jaxllm] {desc}", unit="row", disable=not self.bars, leave=False,
                file=self.stream)
