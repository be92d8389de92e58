"""Out of device memory: telling XLA's error apart from the rest, and saying it in one line.

XLA reports a device allocation that failed as a JaxRuntimeError (a RuntimeError) whose text names the status
(`RESOURCE_EXHAUSTED`) or the driver's code (`CUDA_ERROR_OUT_OF_MEMORY`, when even loading a program's kernels
found no memory), followed by lines of source locations. The engine raises such an error as a DeviceMemoryError
instead of turning command buffers off (jaxllm.programs): the program needs memory, not another build. The CLIs
print it as one line. Its usual cause beyond a model too large for the card is another process on the same GPU:
a JAX process reserves most of the card's memory when it starts.
"""
from __future__ import annotations

import jax

_MARKS = ("RESOURCE_EXHAUSTED", "CUDA_ERROR_OUT_OF_MEMORY", "Out of memory", "out of memory")
GB = 1e9


class DeviceMemoryError(RuntimeError):
  """A device allocation failed (a program's buffers, or its kernels' code): the message says how much of the
  device this process holds and what else takes from it."""


def out_of_memory(error: BaseException) -> bool:
  """True for a runtime error from XLA or the driver that says the device's memory ran out."""
  return isinstance(error, RuntimeError) and any(m in str(error) for m in _MARKS)


def explain(error: BaseException, device=None) -> DeviceMemoryError:
  """`error` (out_of_memory) as a DeviceMemoryError of one line: XLA's first line, this process's share of the
  device (where the backend reports it) and what to change. A DeviceMemoryError is returned as it is."""
  if isinstance(error, DeviceMemoryError):
    return error
  device = device or jax.devices()[0]
  lines = str(error).strip().splitlines()
  first = (lines[0] if lines else type(error).__name__)[:240].rstrip(".")
  stats = device.memory_stats() or {}
  held = ""
  if stats.get("bytes_limit"):
    held = (f"; this process holds {stats.get('bytes_in_use', 0) / GB:.2f} GB of the "
            f"{stats['bytes_limit'] / GB:.2f} GB it may use")
  return DeviceMemoryError(
      f"the {device.device_kind} ran out of memory ({first}){held}. Another process on the "
      "same device takes from it too (a JAX process reserves 75% of a GPU's memory when it starts, unless "
      "XLA_PYTHON_CLIENT_PREALLOCATE=false); a shorter max context or fewer sequences at once need less")
