"""The benchmarks' timing loops over an Engine's decode step (jaxllm.bench, bench/*.py).

burst_step_ms: the device-bound step time (steps dispatched back to back, read once). host_timings: where
the host's time of a step goes (dispatch, read, the pipelined loop's snapshot, calls of K steps). Each runs
a greedy batch-1 request prefilled by Engine.timing_run, outside the generate loop; XLA-dump inspection of
the step is jaxllm.graphs.graph_state.
"""
from __future__ import annotations

import statistics
import time
from typing import Sequence

import numpy as np

from jaxllm.engine import Engine, snapshot


def burst_step_ms(engine: Engine, prompt_ids: Sequence[int], steps: int) -> float:
  """Mean ms per greedy decode step when `steps` steps are dispatched back to back and read once at the
  end: the device-bound step time when host dispatch keeps ahead of the device."""
  steps = min(steps, engine.max_context - len(prompt_ids))
  with engine.timing_run(prompt_ids, steps + 1) as run:
    state, step = run.state, run.step
    state = step(engine.weights, state)
    state.tokens.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(steps - 1):
      state = step(engine.weights, state)
    state.tokens.block_until_ready()
    elapsed = time.perf_counter() - t0
    run.state = state
  return elapsed / max(1, steps - 1) * 1e3


def _median_ms(xs: list[float]) -> float:
  return statistics.median(xs) * 1e3


def host_timings(engine: Engine, prompt_ids: Sequence[int], steps: int) -> dict:
  """Where the host's time of a greedy decode step goes: medians in ms over `steps` steps of each loop.

  serial_*: the host reads each token before dispatching the next step (the streaming loop): dispatch
  (the step call returning, the device idle), read (np.asarray of its token: the device step and the copy
  back), step (the two). snapshot_ms: the pipelined loop's copy of a token before the next step donates
  it (a dispatch and its read). busy_dispatch_ms: the step call returning while earlier steps still run
  (the pipelined and burst loops). call_*: the same for the engine's calls of tokens_per_call steps (the
  streaming loop's calls): call_dispatch_ms, call_read_ms (the device's K steps and the copy back), and
  call_device_ms, a call's time when calls are dispatched back to back.
  """
  steps = max(2, min(steps, (engine.max_context - len(prompt_ids)) // 3))
  med = _median_ms
  with engine.timing_run(prompt_ids, 3 * steps + 1) as run:
    state, step = run.state, run.step
    state = step(engine.weights, state)
    np.asarray(snapshot(state.tokens))
    dispatch, read, snap, busy = [], [], [], []
    for _ in range(steps):
      t0 = time.perf_counter()
      state = step(engine.weights, state)
      t1 = time.perf_counter()
      np.asarray(state.tokens)
      t2 = time.perf_counter()
      dispatch.append(t1 - t0)
      read.append(t2 - t1)
    for _ in range(steps):
      t0 = time.perf_counter()
      np.asarray(snapshot(state.tokens))
      snap.append(time.perf_counter() - t0)
    for _ in range(steps):
      t0 = time.perf_counter()
      state = step(engine.weights, state)
      busy.append(time.perf_counter() - t0)
    # The calls of K steps (past the request's limit the rows are done: the same kernels run); greedy, as
    # the request timing_run prefilled.
    advance = engine.advance_fn(1, True)
    block = None
    state, block, out = advance(state, block)
    np.asarray(out)
    cdispatch, cread = [], []
    for _ in range(8):
      t0 = time.perf_counter()
      state, block, out = advance(state, block)
      t1 = time.perf_counter()
      np.asarray(out)
      cdispatch.append(t1 - t0)
      cread.append(time.perf_counter() - t1)
    t0 = time.perf_counter()
    for _ in range(8):
      state, block, out = advance(state, block)
    np.asarray(out)
    cdevice = (time.perf_counter() - t0) / 8
    state.tokens.block_until_ready()
    run.state = state
  return {"serial_dispatch_ms": med(dispatch), "serial_read_ms": med(read),
          "serial_step_ms": med([a + b for a, b in zip(dispatch, read)]), "snapshot_ms": med(snap),
          "busy_dispatch_ms": med(busy), "steps": steps, "tokens_per_call": engine.tokens_per_call_for(1),
          "call_dispatch_ms": med(cdispatch), "call_read_ms": med(cread), "call_device_ms": cdevice * 1e3}
