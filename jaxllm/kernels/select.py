"""Choosing the kernel path: "auto" resolves to "ffi" where the extension loads, else "xla"."""
from __future__ import annotations

import warnings

KERNEL_CHOICES = ("auto", "ffi", "xla")


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
