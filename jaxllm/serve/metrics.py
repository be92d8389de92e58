"""The server's metrics: counters, gauges and histograms, rendered as Prometheus text for GET /metrics.

Written by the scheduler's thread, read by the HTTP thread (plain Python numbers: a reader sees each value
as it was at some moment). Also the process's XLA compile counter (CompileCounter), which shows that
serving compiles nothing once the server is ready.
"""
from __future__ import annotations

import bisect
import threading

import jax

# Bucket bounds in seconds (Prometheus histograms' `le`).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"   # jax._src.dispatch.BACKEND_COMPILE_EVENT


class Histogram:
  """Cumulative-bucket histogram (Prometheus' shape): counts per upper bound, sum and count."""

  def __init__(self, bounds):
    self.bounds = tuple(bounds)
    self.counts = [0] * (len(self.bounds) + 1)     # the last: above every bound (+Inf)
    self.sum = 0.0
    self.count = 0

  def observe(self, value: float) -> None:
    self.counts[bisect.bisect_left(self.bounds, value)] += 1
    self.sum += value
    self.count += 1

  def lines(self, name: str) -> list[str]:
    out, total = [], 0
    for bound, n in zip(self.bounds + (float("inf"),), self.counts):
      total += n
      le = "+Inf" if bound == float("inf") else repr(bound)
      out.append(f'{name}_bucket{{le="{le}"}} {total}')
    return out + [f"{name}_sum {self.sum}", f"{name}_count {self.count}"]


class CompileCounter:
  """Counts XLA backend compiles in this process (every jit, the engine's own programs included), from JAX's
  monitoring events. One listener for the process, installed on first use."""

  _lock = threading.Lock()
  _count = 0
  _installed = False

  @classmethod
  def _listener(cls, event: str, duration: float, **kwargs) -> None:
    if event == _BACKEND_COMPILE:
      with cls._lock:
        cls._count += 1

  @classmethod
  def count(cls) -> int:
    with cls._lock:
      if not cls._installed:
        jax.monitoring.register_event_duration_secs_listener(cls._listener)
        cls._installed = True
      return cls._count


class Metrics:
  """What GET /metrics reports (each line documented in docs/server.md)."""

  def __init__(self):
    self.running = 0                 # requests in a slot (prefilling or decoding)
    self.waiting = 0                 # requests queued for a slot
    self.slots_used = 0
    self.slots_total = 0
    self.prompt_tokens = 0           # prompt tokens of the requests admitted
    self.reused_tokens = 0           # of those, already in a slot's cache (prefix reuse)
    self.generation_tokens = 0       # tokens sampled
    self.decode_calls: dict[int, int] = {}   # decode executable calls (tokens_per_call steps each) by rows run
    self.admit_calls: dict[int, int] = {}    # admission calls (last prefill chunks, first tokens) by requests
    self.requests: dict[str, int] = {}   # finished requests by finish reason
    self.rejected = 0                # refused: the queue was full
    self.ttft = Histogram(TTFT_BUCKETS)
    self.tpot = Histogram(TPOT_BUCKETS)
    self.e2e = Histogram(E2E_BUCKETS)
    self.compiles_at_ready: int | None = None

  def finished(self, reason: str, seconds: float) -> None:
    self.requests[reason] = self.requests.get(reason, 0) + 1
    self.e2e.observe(seconds)

  def ready(self) -> None:
    """Marks the end of start-up: compiles after this are counted as compiles while serving."""
    self.compiles_at_ready = CompileCounter.count()

  def render(self) -> str:
    """Prometheus text exposition format (version 0.0.4)."""
    lines: list[str] = []

    def metric(name, kind, help_, values):
      lines.append(f"# HELP {name} {help_}")
      lines.append(f"# TYPE {name} {kind}")
      lines.extend(values)
    metric("jaxllm_requests_running", "gauge", "Requests in a slot (prefilling or decoding).",
           [f"jaxllm_requests_running {self.running}"])
    metric("jaxllm_requests_waiting", "gauge", "Requests queued for a free slot.",
           [f"jaxllm_requests_waiting {self.waiting}"])
    metric("jaxllm_kv_slots_used", "gauge", "KV cache slots holding a request.",
           [f"jaxllm_kv_slots_used {self.slots_used}"])
    metric("jaxllm_kv_slots_total", "gauge", "KV cache slots (requests decoded at once).",
           [f"jaxllm_kv_slots_total {self.slots_total}"])
    metric("jaxllm_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.",
           [f"jaxllm_prompt_tokens_total {self.prompt_tokens}"])
    metric("jaxllm_prompt_tokens_reused_total", "counter", "Prompt tokens found in a slot's cache (not prefilled).",
           [f"jaxllm_prompt_tokens_reused_total {self.reused_tokens}"])
    metric("jaxllm_generation_tokens_total", "counter", "Tokens generated.",
           [f"jaxllm_generation_tokens_total {self.generation_tokens}"])
    metric("jaxllm_decode_calls_total", "counter", "Batched decode calls, by the rows they ran.",
           [f'jaxllm_decode_calls_total{{rows="{k}"}} {v}' for k, v in sorted(self.decode_calls.items())])
    metric("jaxllm_admit_calls_total", "counter",
           "Admission calls (prompts' last prefill chunks and first tokens), by the requests each ran.",
           [f'jaxllm_admit_calls_total{{requests="{k}"}} {v}' for k, v in sorted(self.admit_calls.items())])
    metric("jaxllm_requests_total", "counter", "Finished requests by finish reason.",
           [f'jaxllm_requests_total{{finish_reason="{k}"}} {v}' for k, v in sorted(self.requests.items())])
    metric("jaxllm_requests_rejected_total", "counter", "Requests refused with 503 (queue full).",
           [f"jaxllm_requests_rejected_total {self.rejected}"])
    metric("jaxllm_time_to_first_token_seconds", "histogram", "From a request's submission to its first token.",
           self.ttft.lines("jaxllm_time_to_first_token_seconds"))
    metric("jaxllm_time_per_output_token_seconds", "histogram", "A request's mean time per token after its first.",
           self.tpot.lines("jaxllm_time_per_output_token_seconds"))
    metric("jaxllm_e2e_request_latency_seconds", "histogram", "From a request's submission to its end.",
           self.e2e.lines("jaxllm_e2e_request_latency_seconds"))
    compiles = CompileCounter.count()
    serving = 0 if self.compiles_at_ready is None else compiles - self.compiles_at_ready
    metric("jaxllm_xla_compiles_total", "counter", "XLA compiles in this process.",
           [f"jaxllm_xla_compiles_total {compiles}"])
    metric("jaxllm_xla_compiles_while_serving_total", "counter", "XLA compiles since the server became ready.",
           [f"jaxllm_xla_compiles_while_serving_total {serving}"])
    return "\n".join(lines) + "\n"
