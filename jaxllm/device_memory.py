"""Out of device memory: telling XLA's error apart from the rest, and saying it in one line.

XLA reports a device allocation that failed as a JaxRuntimeError (a RuntimeError): `RESOURCE_EXHAUSTED` with
"Out of memory while trying to allocate" where its own pool is full, the driver's `CUDA_ERROR_OUT_OF_MEMORY`
where memory outside the pool ran out (loading a program's kernels, instantiating a CUDA graph), cuBLAS's
`CUBLAS_STATUS_ALLOC_FAILED`; then lines of source locations. The CLIs (generate, serve, bench) print it as one
line through `explain`, which tells the two cases apart: a full pool wants a smaller cache or batch; room in the
pool with the driver out of memory wants a smaller pool (XLA_PYTHON_CLIENT_MEM_FRACTION) or the device to
itself. The engine's command-buffer trial (jaxllm.programs) falls back to running without them on such an error,
as on any other: the trial holds a second copy of its state, which a run without command buffers does not.
"""
from __future__ import annotations

import contextlib

import jax

GB = 1e9
_ALWAYS = ("CUDA_ERROR_OUT_OF_MEMORY", "CUBLAS_STATUS_ALLOC_FAILED")
_POOL = ("out of memory", "trying to allocate", "failed to allocate")    # beside RESOURCE_EXHAUSTED, lower case
_NOT = ("shared memory",)          # RESOURCE_EXHAUSTED for a kernel's shared memory is a compile error, not this


class DeviceMemoryError(RuntimeError):
  """A device allocation failed (a program's buffers, or its kernels' code): the message says how much of the
  device this process holds and what to change."""


def out_of_memory(error: BaseException) -> bool:
  """True for a runtime error from XLA, the driver or cuBLAS that says the device's memory ran out."""
  if isinstance(error, DeviceMemoryError):
    return True
  if not isinstance(error, RuntimeError):
    return False
  text = str(error)
  if any(m in text for m in _ALWAYS):
    return True
  low = text.lower()
  return "RESOURCE_EXHAUSTED" in text and any(m in low for m in _POOL) and not any(m in low for m in _NOT)


def _device_figures():
  """(device kind, bytes in use, the pool's limit); (None, 0, 0) where the backend does not say."""
  try:
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    return device.device_kind, int(stats.get("bytes_in_use", 0)), int(stats.get("bytes_limit", 0))
  except Exception:  # the backend itself failed to start (the device full from the outset): no figures
    return None, 0, 0


def explain(error: BaseException) -> DeviceMemoryError:
  """`error` (out_of_memory) as a DeviceMemoryError of one line: XLA's first line, this process's share of the
  device where the backend reports it, and what to change. A DeviceMemoryError is returned as it is."""
  if isinstance(error, DeviceMemoryError):
    return error
  lines = str(error).strip().splitlines()
  first = (lines[0] if lines else type(error).__name__)[:240].rstrip(".")
  kind, used, limit = _device_figures()
  what = f"the {kind}" if kind else "the device"
  if not limit:                   # the CPU (host memory), or no figures
    return DeviceMemoryError(f"{what} ran out of memory ({first}); a shorter max context, fewer sequences at once "
                             "or a smaller model need less")
  held = f"this process holds {used / GB:.2f} GB of the {limit / GB:.2f} GB pool it may use"
  if used < 0.9 * limit:          # room in the pool: what ran out is the memory outside it
    advice = ("the memory outside that pool ran out (kernels' code, CUDA graphs, library workspaces): another "
              "process on the same GPU may hold it (a JAX process reserves 75% of a GPU when it starts unless "
              "XLA_PYTHON_CLIENT_PREALLOCATE=false), or a smaller XLA_PYTHON_CLIENT_MEM_FRACTION leaves more")
  else:
    advice = "a shorter max context, fewer sequences at once or a smaller model need less"
  return DeviceMemoryError(f"{what} ran out of memory ({first}); {held}; {advice}")


@contextlib.contextmanager
def exit_on_out_of_memory():
  """A CLI's body: the device out of memory inside ends it with `error: <explain's line>` (SystemExit, status 1);
  any other error passes as it is."""
  try:
    yield
  except RuntimeError as e:
    if not out_of_memory(e):
      raise
    raise SystemExit(f"error: {explain(e)}") from None
