"""Lab switches: the knobs of past experiments, read from the environment only in a lab build.

A lab build is the extension built with `pip install -e . -Ccmake.define.JAXLLM_LAB=ON` (for bench/; the
switches are listed in docs/benchmarks.md). In a release build every switch is its default whatever the
environment says, so nothing a switch changes reaches a release; the C++ and CUDA switches are gated the
same way at compile time (ffi/common.h, LabEnv). The user-facing variables (docs/usage.md) are read
where they act, in every build.
"""
from __future__ import annotations

import functools
import os


@functools.cache
def lab_build() -> bool:
  """Whether the loaded extension (jaxllm._ffi) is a lab build; False where it is not built."""
  try:
    from jaxllm import _ffi
  except ImportError:
    return False
  return bool(getattr(_ffi, "lab_build", False))


def switch(name: str, default: str | None = None) -> str | None:
  """The lab switch `name` (a JAXLLM_* variable) as a string: the environment's value in a lab build (default
  where it is unset), default in a release build."""
  if not lab_build():
    return default
  return os.environ.get(name, default)
