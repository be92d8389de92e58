"""The host cores this process may run on, and the thread pools sized from them."""
from __future__ import annotations

import os

MAX_THREADS = 8   # a pool's cap: each of its threads holds a working set of its own (a block's floats, a compile)


def usable_cores() -> int:
  """Cores this process may run on (its affinity mask where the OS has one, else the machine's count)."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pool_threads() -> int:
  """Threads for a pool of host work that releases the GIL (numpy's conversions, XLA's compiles): one a core,
  at most MAX_THREADS."""
  return max(1, min(MAX_THREADS, usable_cores()))
