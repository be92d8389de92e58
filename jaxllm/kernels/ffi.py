"""jaxllm's own kernels through the XLA FFI (filled in by the kernel work; unavailable until built)."""
from __future__ import annotations


def unavailable_reason() -> str | None:
  """None when the FFI extension is built and registered, else why not."""
  return "the jaxllm FFI extension is not built in this version"
