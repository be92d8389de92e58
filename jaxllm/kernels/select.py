"""Choosing the kernel path: "auto" resolves to "ffi" where the extension loads, else "xla"."""
from __future__ import annotations

import os
import warnings

KERNEL_CHOICES = ("auto", "ffi", "xla")
FFI_OPS = ("matmul", "attention")


def ffi_ops() -> tuple[str, ...]:
  """Which ops the "ffi" path runs through jaxllm's kernels: all, or those in JAXLLM_FFI_OPS
  (comma-separated; a diagnostic knob for timing one kernel's share of the step)."""
  value = os.environ.get("JAXLLM_FFI_OPS")
  if value is None:
    return FFI_OPS
  ops = tuple(v.strip() for v in value.split(",") if v.strip())
  bad = [o for o in ops if o not in FFI_OPS]
  if bad:
    raise ValueError(f"JAXLLM_FFI_OPS takes {FFI_OPS}, got {bad}")
  return ops


def resolve_kernels(kernels: str) -> str:
  """Returns the path that will actually run: "ffi" or "xla".

  "ffi" asked for but unavailable warns once (with the reason) and falls back to "xla".
  """
  if kernels not in KERNEL_CHOICES:
    raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
  if kernels == "xla":
    return "xla"
  from jaxllm.kernels import ffi
  reason = ffi.unavailable_reason()
  if reason is None:
    return "ffi"
  if kernels == "ffi":
    _warn_once(f"jaxllm: FFI kernels unavailable ({reason}); running the XLA path")
  return "xla"


_warned: set[str] = set()


def _warn_once(msg: str) -> None:
  if msg not in _warned:
    _warned.add(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
