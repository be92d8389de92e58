"""Benchmark: python -m jaxllm.bench MODEL [options]; one JSON line per run (schema in docs/benchmarks.md).

MODEL is a .gguf path, a demo-model name, or a synthetic preset (synthetic:qwen2.5-0.5b, ...) with the
real shapes and random weights. Compile and warm-up runs are excluded; TTFT and TPOT come from the same
request. Tokens after the first arrive a call of K decode steps at a time (--tokens-per-call): TPOT is
reported per token as the host receives them and per step as the device runs them, and rates and
bandwidths come from whole calls only, so a run needs at least MIN_CALLS whole calls after its first
token. `--ab graphs` runs paired processes (graphs on, off, on, off, ...) and reports per-pair ratios;
`--sweep` runs each XLA flag set in its own process. Both end with a markdown table and a PNG plot; both
refuse to compare CUDA graph settings on a backend without command buffers (XLA's are GPU-only).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

from jaxllm.bench_report import ab_table, graphs_word, plot, runs_table, state_seen
from jaxllm.device_memory import exit_on_out_of_memory

SCHEMA_VERSION = 2
MIN_CALLS = 2      # whole calls after the first token a timed request needs
GRAPH_FLAGS = re.compile(r"command_buffer|xla_gpu_graph_")   # XLA flags of CUDA graphs (command buffers)


def _percentile(xs, q):
  xs = sorted(xs)
  return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def _git_commit() -> str | None:
  """The checkout's commit, or JAXLLM_GIT_COMMIT where the tree has no .git (a copy on another machine)."""
  if os.environ.get("JAXLLM_GIT_COMMIT"):
    return os.environ["JAXLLM_GIT_COMMIT"]
  try:
    here = os.path.dirname(os.path.abspath(__file__))
    return subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          timeout=5).stdout.strip() or None
  except (OSError, subprocess.SubprocessError):
    return None


def environment() -> dict:
  import jax
  import jaxlib

  from jaxllm import lab
  dev = jax.devices()[0]
  env = {"device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform,
         "jax": jax.__version__, "jaxlib": jaxlib.__version__, "python": platform.python_version(),
         "host": platform.node(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
         "git_commit": _git_commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
         "lab_build": lab.lab_build()}
  if dev.platform == "gpu":
    try:
      out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=10).stdout.strip()
      env["driver"] = out.split(",")[0].strip() if out else None
    except (OSError, subprocess.SubprocessError):
      env["driver"] = None
  return env


def copy_bandwidth_gb_s() -> float:
  """Device copy bandwidth (bytes read + written per second), the ceiling for weight streaming.

  x + 1 over a donated 1 GiB (GPU) buffer, 10 executions queued back to back and waited for once, so
  dispatch and allocation stay out of the time; the median of 5 such rounds.
  """
  import jax
  import jax.numpy as jnp
  n = (1 << 28) if jax.default_backend() == "gpu" else (1 << 25)   # float32 elements
  f = jax.jit(lambda a: a + 1.0, donate_argnums=0)
  x = f(jnp.ones((n,), jnp.float32))
  x.block_until_ready()
  reps, times = 10, []
  for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(reps):
      x = f(x)
    x.block_until_ready()
    times.append((time.perf_counter() - t0) / reps)
  return 2 * 4 * n / statistics.median(times) / 1e9


def _peak_memory() -> int | None:
  import jax
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def _peak_rss() -> int:
  """This process's peak resident memory in bytes (Linux reports ru_maxrss in KiB)."""
  import resource
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _gb(n) -> str:
  return "n/a" if n is None else f"{n / 1e9:.2f}"


def best_seconds(fn, *args, calls: int = 1, batches: int = 5) -> float:
  """Seconds per call of fn(*args) (a jitted function): one warm-up call, then the best of `batches` batches of
  `calls` calls dispatched back to back and waited for once."""
  import jax
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(batches):
    t0 = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    best = min(best, (time.perf_counter() - t0) / calls)
  return best


def load_model(model: str, quant: str, seed: int):
  """(config, weights, tokenizer or None, synthetic?) for a path, demo name or synthetic preset."""
  from jaxllm.load import default_dtype, load
  if model.startswith("synthetic:"):
    from jaxllm.presets import preset
    from jaxllm.weights import random_weights
    config = preset(model)
    return config, random_weights(config, seed=seed, quant=quant, dtype=default_dtype()), None, True
  config, weights, tok = load(model, quant=quant, progress=False)
  return config, weights, tok, False


def timed_calls(tokens: int, tokens_per_call: int, pipelined: bool) -> int:
  """The calls of a request of `tokens` tokens whose time counts: the whole calls of tokens_per_call steps
  after its first token (the prefill's), less its last call when pipelined (no call was queued behind that
  one, so the host may find its tokens ready as soon as it has read the call before)."""
  whole, calls = (tokens - 1) // tokens_per_call, -(-(tokens - 1) // tokens_per_call)
  return min(whole, calls - 1) if pipelined else whole


def check_length(decode_len: int, tokens_per_call: int, pipelined: bool) -> None:
  """Refuses a request too short to time: fewer than MIN_CALLS timed calls (timed_calls)."""
  k = tokens_per_call
  calls = timed_calls(decode_len, k, pipelined)
  if calls < MIN_CALLS:
    enough = next(n for n in range(decode_len, decode_len + (MIN_CALLS + 2) * k)
                  if timed_calls(n, k, pipelined) >= MIN_CALLS)
    fewer = max([j for j in range(1, k) if timed_calls(decode_len, j, pipelined) >= MIN_CALLS], default=None)
    raise SystemExit(f"error: --decode-len {decode_len} is too short for {k} tokens per call: rates come from whole "
                     f"calls after the first token{' (less the last, pipelined)' if pipelined else ''}, and it gives "
                     f"{calls} of the {MIN_CALLS} needed; give --decode-len {enough} or more"
                     + (f", or --tokens-per-call {fewer} or fewer" if fewer else ""))


def timing_stats(requests: list[list[float]], tokens_per_call: int = 1, pipelined: bool = False) -> dict:
  """The schema's timing fields from each timed request's token arrival times (seconds since submission).

  The first token is the prefill's; the others arrive a call of tokens_per_call steps at a time (a last call
  may be cut short). TTFT: median. Per token as the host receives them: the gaps between consecutive tokens
  (tpot_token_ms_*: ~0 inside a call, a whole call's time between calls). Per step as the device runs them:
  each timed call's time (timed_calls) since the previous call's tokens arrived (the first call's: since the
  first token), over its steps (tpot_step_ms_*). From the timed calls only: tpot_ms_mean (their time over
  their steps, all requests) and decode_tok_s (each request's steps over their time; median).
  """
  k = tokens_per_call
  n_calls = [timed_calls(len(times), k, pipelined) for times in requests]
  if min(n_calls) < MIN_CALLS:
    raise ValueError(f"a timed request needs {MIN_CALLS} timed calls of {k} tokens after its first token, got "
                     f"{min(n_calls)} (tokens per request: {sorted({len(t) for t in requests})})")
  ttfts = [times[0] * 1e3 for times in requests]
  gaps = [(b - a) * 1e3 for times in requests for a, b in zip(times, times[1:])]
  arrivals = [[times[0]] + [times[1 + j * k] for j in range(n)] for times, n in zip(requests, n_calls)]
  steps = [(b - a) * 1e3 / k for arr in arrivals for a, b in zip(arr, arr[1:])]
  rates = [n * k / (arr[-1] - arr[0]) for arr, n in zip(arrivals, n_calls)]
  return {"ttft_ms": statistics.median(ttfts), "ttft_ms_all": ttfts, "tpot_ms_mean": statistics.mean(steps),
          "tpot_step_ms_p50": _percentile(steps, 50), "tpot_step_ms_p90": _percentile(steps, 90),
          "tpot_token_ms_p50": _percentile(gaps, 50), "tpot_token_ms_p90": _percentile(gaps, 90),
          "decode_tok_s": statistics.median(rates), "decode_tok_s_all": rates, "calls_timed": sum(n_calls)}


def write_records(records: list[dict], out: str | None) -> None:
  """Appends the records as JSON lines to `out`, or writes them to stdout."""
  lines = "".join(json.dumps(r) + "\n" for r in records)
  if out:
    with open(out, "a") as f:
      f.write(lines)
  else:
    sys.stdout.write(lines)


def measure(engine, prompts, decode_len: int, repeat: int, warmup: int, pipelined: bool, params=None) -> dict:
  """TTFT and per-step times of `repeat` requests (each a batch of `prompts`) after `warmup` ones."""
  from jaxllm.sampling import SamplingParams
  params = params or SamplingParams()
  requests = [[t for _, t in engine.stream_tokens(prompts, decode_len, params, i, pipelined, ignore_eos=True)]
              for i in range(warmup + repeat)][warmup:]
  from jaxllm.timing import burst_step_ms
  burst = burst_step_ms(engine, prompts[0], min(decode_len, 64)) if len(prompts) == 1 and params.greedy else None
  return {"step_ms_burst": burst, **timing_stats(requests, engine.tokens_per_call_for(len(prompts)), pipelined)}


def run(args) -> list[dict]:
  import jax
  import numpy as np
  from jaxllm.cache import cache_bytes
  from jaxllm import graphs
  from jaxllm.engine import Engine, greedy_mode
  from jaxllm.presets import weight_bytes_per_token
  from jaxllm.timing import host_timings
  from jaxllm.parallel import make_mesh, plan
  from jaxllm.weights import resolve_quant
  t_load = time.perf_counter()
  quant = resolve_quant(args.quant, tensor_parallel=args.tp != 1)
  config, weights, tok, synthetic = load_model(args.model, quant, args.seed)
  jax.block_until_ready(weights)
  try:
    mesh = make_mesh(args.tp) if args.tp != 1 else None
    if mesh is not None:
      plan(config, mesh)                      # a model that does not split: one line, before anything runs
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  load_s = time.perf_counter() - t_load
  rng = np.random.default_rng(args.seed)
  prompts = [[int(t) for t in rng.integers(0, config.vocab_size, args.prompt_len)] for _ in range(args.batch)]
  max_context = args.max_context or args.prompt_len + args.decode_len + 8
  env = environment()
  wbytes = weight_bytes_per_token(weights)
  all_weight_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(weights))
  graphs_on = {"on": True, "off": False, "env": None}[args.graphs]
  from jaxllm.sampling import SamplingParams
  params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          repeat_penalty=args.repeat_penalty)
  records = []
  loops = ["pipelined", "streaming"] if args.loop == "both" else [args.loop]
  for kernels in kernel_list(args.kernels):
    engine = Engine(config, weights, tok, max_context=max_context, kernels=kernels, graphs_on=graphs_on,
                    prefill_chunk=args.prefill_chunk, tokens_per_call=args.tokens_per_call,
                    device_loop=None if args.device_loop == "auto" else args.device_loop, mesh=mesh)
    for loop in loops:
      check_length(args.decode_len, engine.tokens_per_call_for(args.batch), loop == "pipelined")
    t0 = time.perf_counter()
    engine.warmup(args.prompt_len, params, batch=args.batch)
    compile_s = time.perf_counter() - t0
    greedy = greedy_mode(params)
    state = graphs.graph_state(engine, greedy) if args.graph_state else {"state": "not inspected"}
    host = (host_timings(engine, prompts[0], args.decode_len)
            if args.host_timings and args.batch == 1 and greedy is True else None)
    if host:
      print(f"[bench] host, kernels={engine.kernels}: dispatch {host['serial_dispatch_ms']:.3f} ms with the device "
            f"idle, {host['busy_dispatch_ms']:.3f} busy; read {host['serial_read_ms']:.3f}; serial step "
            f"{host['serial_step_ms']:.3f}; snapshot {host['snapshot_ms']:.3f}; calls of {host['tokens_per_call']}: "
            f"dispatch {host['call_dispatch_ms']:.3f}, read {host['call_read_ms']:.3f}, back to back "
            f"{host['call_device_ms']:.3f}", file=sys.stderr)
    for loop in loops:
      m = measure(engine, prompts, args.decode_len, args.repeat, args.warmup, loop == "pipelined", params)
      m["decode_tok_s_total"] = m["decode_tok_s"] * args.batch
      peak = _peak_memory()                  # before the bandwidth probe below allocates its own buffer
      rec = {"schema_version": SCHEMA_VERSION, "label": args.label, "model": args.model, "synthetic": synthetic,
             "arch": config.arch, "quant": quant, "kernels": engine.kernels, "tp": args.tp,
             "autotune": engine.autotune, "mma_choices": len(engine.mma_table),
             "graphs_requested": engine.graphs_requested, "graph_state": state,
             "compiler_options": engine.compiler_options, "loop": loop, "batch": args.batch,
             "prompt_len": args.prompt_len, "decode_len": args.decode_len, "max_context": max_context,
             "sampling": {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p},
             "repeat": args.repeat, "load_s": load_s, "compile_s": compile_s, **m, "host_timings": host,
             "weight_bytes_per_token": wbytes,
             "weight_gb_s": wbytes * m["decode_tok_s"] / 1e9,   # a weight pass per step (whole calls), any batch
             "peak_memory_bytes": peak, "peak_rss_bytes": _peak_rss(), "weights_bytes": all_weight_bytes,
             "cache_bytes": cache_bytes(config, args.batch, max_context, engine.cache_dtype),
             "prefill_chunk": engine.prefill_chunk, "tokens_per_call": engine.tokens_per_call_for(args.batch),
             "device_loop": engine.loop_for(args.batch), "env": env}
      if rec["peak_memory_bytes"] is not None:
        rec["peak_beyond_weights_and_cache_bytes"] = rec["peak_memory_bytes"] - all_weight_bytes - rec["cache_bytes"]
      records.append(rec)
  bandwidth = copy_bandwidth_gb_s()
  for rec in records:
    rec["copy_gb_s"] = bandwidth
    rec["byte_floor_ms"] = wbytes / (bandwidth * 1e9) * 1e3 if bandwidth else None
    print(f"[bench] {args.model} kernels={rec['kernels']} K={rec['tokens_per_call']} "
          f"graphs={graphs_word(rec)}{state_seen(rec)} loop={rec['loop']}: TTFT {rec['ttft_ms']:.2f} ms, "
          f"TPOT {rec['tpot_ms_mean']:.3f} ms (per step p50 "
          f"{rec['tpot_step_ms_p50']:.3f}, p90 {rec['tpot_step_ms_p90']:.3f}; per token received p50 "
          f"{rec['tpot_token_ms_p50']:.3f}, p90 {rec['tpot_token_ms_p90']:.3f}; {rec['calls_timed']} whole calls), "
          f"burst step {rec['step_ms_burst'] or 0:.3f} ms, batch {args.batch}: {rec['decode_tok_s']:.1f} tok/s per "
          f"sequence, {rec['decode_tok_s_total']:.1f} total, weights {rec['weight_gb_s']:.0f} GB/s of "
          f"{bandwidth:.0f}, floor {rec['byte_floor_ms']:.3f} ms, peak device {_gb(rec['peak_memory_bytes'])} GB "
          f"(beyond weights and cache {_gb(rec.get('peak_beyond_weights_and_cache_bytes'))}), "
          f"peak RSS {_gb(rec['peak_rss_bytes'])} GB", file=sys.stderr)
  return records


def kernel_list(value: str) -> list[str]:
  """--kernels: one path, "both" (ffi and xla) or a comma-separated list (e.g. ffi,ffi-unfused)."""
  from jaxllm.kernels import KERNEL_CHOICES
  paths = ["ffi", "xla"] if value == "both" else [v.strip() for v in value.split(",") if v.strip()]
  bad = [p for p in paths if p not in KERNEL_CHOICES]
  if bad or not paths:
    raise SystemExit(f"error: --kernels takes {', '.join(KERNEL_CHOICES)}, both, or a comma-separated list; "
                     f"got {value!r}")
  return paths


def _child(args, extra: list[str], env_extra: dict, out: str) -> list[dict]:
  cmd = [sys.executable, "-m", "jaxllm.bench", args.model, "--batch", str(args.batch), "--prompt-len", str(args.prompt_len),
         "--decode-len", str(args.decode_len), "--repeat", str(args.repeat), "--warmup", str(args.warmup),
         "--kernels", args.kernels, "--loop", args.loop, "--quant", args.quant, "--tp", str(args.tp), "--out", out, *extra]
  if args.max_context:
    cmd += ["--max-context", str(args.max_context)]
  if args.prefill_chunk:
    cmd += ["--prefill-chunk", str(args.prefill_chunk)]
  if args.tokens_per_call:
    cmd += ["--tokens-per-call", str(args.tokens_per_call)]
  cmd += ["--device-loop", args.device_loop]
  cmd += ["--temperature", str(args.temperature), "--top-k", str(args.top_k), "--top-p", str(args.top_p)]
  if args.graph_state:
    cmd.append("--graph-state")
  proc = subprocess.run(cmd, env={**os.environ, **env_extra})
  if proc.returncode:
    raise ChildFailed(proc.returncode)     # the child has said why on stderr
  with open(out) as f:
    return [json.loads(line) for line in f if line.strip()]


class ChildFailed(Exception):
  """A measuring process ended with a non-zero status (it has said why on stderr)."""

  def __init__(self, status: int):
    super().__init__(f"status {status}")
    self.status = status


def _backend() -> str:
  """The default backend as a child process sees it (this process leaves the devices to its children)."""
  proc = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], capture_output=True,
                        text=True)
  return proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout.strip() else "unknown"


def check_graph_comparison(args) -> None:
  """Refuses to compare CUDA graph settings (--ab graphs, a --sweep of command-buffer flags) where the backend
  has none: every process would run the same program, and a ratio would measure only noise."""
  flags = [f for f in sweep_flag_sets(args.sweep or []) if GRAPH_FLAGS.search(f)]
  if not (args.ab or flags):
    return
  backend = _backend()
  if backend == "gpu":
    return
  what = "--ab graphs compares CUDA graphs on and off" if args.ab else \
      f"--sweep sets CUDA graph flags ({'; '.join(flags)})"
  raise SystemExit(f"error: {what}, but the {backend} backend has no command buffers (XLA's CUDA graphs are "
                   "GPU-only): every run would be the same program, so there is nothing to compare")


def ab_graphs(args) -> tuple[list[dict], list[str]]:
  """Paired processes: graphs on, off, on, off, ...; per-pair ratios of TPOT and TTFT. Returns the records and
  the runs that failed (a pair with a failed half is left out of the ratios; the other pairs go on)."""
  import tempfile
  records, failed = [], []
  with tempfile.TemporaryDirectory() as tmp:
    for pair in range(args.pairs):
      for mode in ("on", "off"):
        try:
          got = _child(args, ["--graphs", mode, "--label", f"pair{pair}"], {}, os.path.join(tmp, f"{pair}{mode}.jsonl"))
        except ChildFailed as e:
          failed.append(f"pair {pair} graphs {mode} ({e})")
          continue
        for r in got:
          r["pair"] = pair
          records.append(r)
  return records, failed


def sweep_flag_sets(items: list[str]) -> list[str]:
  """--sweep arguments -> XLA flag sets. An item is a file (one flag set per line, '#' comments, an empty
  line or "default" for XLA's defaults) or a flag set; flags may omit the leading "--" (argparse would
  take a lone "--flag" for an option of its own), and "default" or "" means no extra flags."""
  raw = []
  for item in items:
    if not os.path.isfile(item):
      raw.append(item)
      continue
    with open(item) as f:
      for line in f:
        flags = line.split("#", 1)[0].strip()
        if flags or not line.strip():      # comment-only lines are dropped, empty lines mean defaults
          raw.append(flags)
  sets = []
  for flags in raw:
    words = [] if flags.strip() in ("", "default") else flags.split()
    sets.append(" ".join(w if w.startswith("--") else "--" + w for w in words))
  return sets


def sweep(args) -> tuple[list[dict], list[str]]:
  """One process a flag set. Returns the records and the flag sets whose process failed (the others go on)."""
  import tempfile
  records, failed = [], []
  with tempfile.TemporaryDirectory() as tmp:
    for i, flags in enumerate(sweep_flag_sets(args.sweep)):
      env = {"XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()}
      try:
        records += _child(args, ["--graphs", "env", f"--label={flags or '(default)'}"], env,
                          os.path.join(tmp, f"{i}.jsonl"))
      except ChildFailed as e:
        failed.append(f"{flags or '(default)'} ({e})")
  return records, failed


def build_parser():
  p = argparse.ArgumentParser(prog="python -m jaxllm.bench", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("model", help="a .gguf path, a demo name, or synthetic:<preset>")
  p.add_argument("--prompt-len", type=int, default=128)
  p.add_argument("--decode-len", type=int, default=128)
  p.add_argument("--max-context", type=int, default=None)
  p.add_argument("--batch", type=int, default=1, help="sequences decoded together")
  p.add_argument("--repeat", type=int, default=3, help="timed requests per configuration")
  p.add_argument("--warmup", type=int, default=1, help="untimed requests first")
  p.add_argument("--kernels", default="auto",
                 help="auto, ffi (fused decode step), ffi-unfused, xla, both (ffi and xla), or a comma list")
  p.add_argument("--loop", choices=("pipelined", "streaming", "both"), default="both")
  p.add_argument("--quant", choices=("auto", "w8a16", "gguf", "none"), default="auto",
                 help="auto: gguf on the CPU (the file's 4/5/6-bit blocks), w8a16 on the GPU and with --tp")
  p.add_argument("--tp", type=int, default=1, metavar="N", help="tensor parallel over the first N devices")
  p.add_argument("--graphs", choices=("on", "off", "env"), default="env",
                 help="env = JAXLLM_CUDA_GRAPHS / XLA_FLAGS decide")
  p.add_argument("--no-graphs", dest="graphs", action="store_const", const="off")
  p.add_argument("--graph-state", action="store_true", help="verify the graph state from XLA's dump")
  p.add_argument("--host-timings", action="store_true",
                 help="also time the host's part of a step (dispatch, read, snapshot; batch 1, greedy)")
  p.add_argument("--ab", choices=("graphs",), help="paired-process A/B")
  p.add_argument("--pairs", type=int, default=3)
  p.add_argument("--sweep", nargs="+", metavar="FILE|FLAGS",
                 help="XLA flag sets, each run in its own process: files with one set per line, or sets such as "
                      "default 'xla_gpu_enable_command_buffer=FUSION' (leading -- optional)")
  p.add_argument("--prefill-chunk", type=int, default=None, help="prompt tokens per prefill chunk")
  p.add_argument("--tokens-per-call", type=int, default=None, metavar="K",
                 help="decode steps per executable call (Engine(tokens_per_call=K); default: the engine's)")
  p.add_argument("--device-loop", choices=("auto", "unrolled", "while"), default="auto",
                 help="how a call of K steps runs them: K unrolled copies, or a while loop (Engine(device_loop=); "
                      "auto: unrolled where the GPU runs the fused step, while elsewhere: Engine.loop_for)")
  p.add_argument("--temperature", type=float, default=0.0, help="sampling (default greedy)")
  p.add_argument("--top-k", type=int, default=0)
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--repeat-penalty", type=float, default=1.0, help="1 = off (a penalized step otherwise)")
  p.add_argument("--label", default="")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", help="append JSON lines here (default: stdout)")
  p.add_argument("--report", help="write a markdown table here and a PNG beside it")
  return p


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  if args.prompt_len < 1 or args.decode_len < 3 or args.repeat < 1 or args.batch < 1:
    raise SystemExit(f"error: need --prompt-len >= 1, --decode-len >= 3, --repeat >= 1, --batch >= 1; got "
                     f"{args.prompt_len}, {args.decode_len}, {args.repeat}, {args.batch}")
  if args.tokens_per_call:
    for loop in ("pipelined", "streaming") if args.loop == "both" else (args.loop,):
      check_length(args.decode_len, args.tokens_per_call, loop == "pipelined")
  check_graph_comparison(args)
  failed = []                         # --ab and --sweep: the runs whose process failed; the rest are kept
  with exit_on_out_of_memory():       # the device out of memory: one line, status 1
    if args.ab:
      records, failed = ab_graphs(args)
      table = ab_table(records)
    elif args.sweep:
      records, failed = sweep(args)
      table = runs_table(records)
    else:
      records = run(args)
      table = runs_table(records)
  if not records:
    raise SystemExit(f"error: every run failed: {'; '.join(failed)}")
  write_records(records, args.out)
  print(table, file=sys.stderr)
  if args.report:
    with open(args.report, "w") as f:
      f.write(table + "\n")
    plot(records, os.path.splitext(args.report)[0] + ".png", f"{args.model}: {records[0]['env']['device']}")
  if failed:
    print(f"[bench] {len(failed)} run(s) failed, the others' records are kept: {'; '.join(failed)}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
