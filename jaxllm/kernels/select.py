"""Choosing the kernel path: "auto" resolves to "ffi" where the extension loads, else "xla".

"ffi" runs the decode step through the fused kernels (jaxllm/kernels/fused.py) where they take the model and
batch, and the other ops through jaxllm's single-op kernels; "ffi-unfused" runs only the single-op kernels
(the path before the fusions, kept for comparison); "xla" runs the pure-jnp references.
"""
from __future__ import annotations

import warnings

from jaxllm import lab
from jaxllm.kernels import ffi

KERNEL_CHOICES = ("auto", "ffi", "ffi-unfused", "xla")
FFI_PATHS = ("ffi", "ffi-unfused")
FFI_OPS = ("matmul", "attention", "fused")


def ffi_ops() -> tuple[str, ...]:
  """Which ops the "ffi" path runs through jaxllm's kernels: all, or in a lab build (jaxllm/lab.py) those in
  JAXLLM_FFI_OPS (comma-separated; for timing one kernel's share of the step)."""
  value = lab.switch("JAXLLM_FFI_OPS")
  if value is None:
    return FFI_OPS
  ops = tuple(v.strip() for v in value.split(",") if v.strip())
  bad = [o for o in ops if o not in FFI_OPS]
  if bad:
    raise ValueError(f"JAXLLM_FFI_OPS takes {FFI_OPS}, got {bad}")
  return ops


def uses_ffi(kernels: str) -> bool:
  """Whether the path runs jaxllm's FFI kernels (fused or not)."""
  return kernels in FFI_PATHS


def resolve_kernels(kernels: str) -> str:
  """Returns the path that will actually run: "ffi", "ffi-unfused" or "xla".

  An FFI path asked for but unavailable warns once (with the reason) and falls back to "xla".
  """
  if kernels not in KERNEL_CHOICES:
    raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
  if kernels == "xla":
    return "xla"
  reason = ffi.unavailable_reason()
  if reason is None:
    return "ffi" if kernels == "auto" else kernels
  if kernels in FFI_PATHS:
    _warn_once(f"jaxllm: FFI kernels unavailable ({reason}); running the XLA path")
  return "xla"


_warned: set[str] = set()


def _warn_once(msg: str) -> None:
  if msg not in _warned:
    _warned.add(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
