"""Command to first token: the CLI run as a new process each time, timed from outside.

  python bench/startup.py smollm2-135m qwen2.5-coder-0.5b --runs 3 --json startup.json

For each model: one first run with an empty cache (a fresh JAXLLM_CACHE that holds only the downloaded
GGUF: conversion and compilation included, download not), then --runs more with the cache it filled.
Each run is `python -m jaxllm.generate MODEL --prompt ... --max-tokens 16` in a new process; the time to
first token is from starting the process to the first byte of generated text on its stdout (unbuffered),
and the child's peak RSS comes from the kernel's accounting of the finished process (wait4). Then one
process runs two requests back to back after the CLI's warm-up and reports both TTFTs (the first request
against a later one). The GGUF is linked, not copied, into the fresh cache directory. The JSON records when
and where it ran (date, host, CPUs, commit); the figures in README.md and docs/benchmarks.md come from it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

PROMPT = "Write a short poem about the sea."


def run_cli(model: str, cache: str, extra: list[str]) -> dict:
  env = {**os.environ, "JAXLLM_CACHE": cache, "PYTHONUNBUFFERED": "1"}
  cmd = [sys.executable, "-m", "jaxllm.generate", model, "--prompt", PROMPT, "--max-tokens", "16", "--ignore-eos",
         "-q", *extra]
  t0 = time.perf_counter()
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
  first = proc.stdout.read(1)
  t_first = time.perf_counter() - t0
  rest = proc.stdout.read()
  err = proc.stderr.read()
  _, status, usage = os.wait4(proc.pid, 0)
  proc.returncode = os.waitstatus_to_exitcode(status)
  if proc.returncode or not first:
    raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {err.decode()[-2000:]}")
  return {"first_token_s": t_first, "total_s": time.perf_counter() - t0, "peak_rss_bytes": usage.ru_maxrss * 1024,
          "text": (first + rest).decode("utf-8", "replace")}


def two_requests(model: str, cache: str) -> dict:
  """TTFT of the first and second request in one process, after the CLI's warm-up (with its trial run)."""
  code = f"""
import json, jaxllm
from jaxllm import executables
config, weights, tok = jaxllm.load({model!r}, progress=False)
engine = jaxllm.Engine(config, weights, tok, max_context=512, cache_executables=executables.compile_cache_enabled())
ids = tok.encode({PROMPT!r})
engine.warmup(len(ids), trial=True)
a = engine.generate(ids, 16, ignore_eos=True)
b = engine.generate(ids, 16, ignore_eos=True)
print(json.dumps({{"first_ttft_ms": a.ttft_ms, "second_ttft_ms": b.ttft_ms}}))
"""
  out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "JAXLLM_CACHE": cache}, check=True,
                       capture_output=True, text=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def where() -> dict:
  """When and on what the figures were measured (without starting a device in this process)."""
  from jaxllm.bench import _git_commit
  cpu = ""
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
  except OSError:
    pass
  return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "host": platform.node(), "cpu": cpu or platform.machine(), "cpus": len(os.sched_getaffinity(0)),
          "load_avg_1m": os.getloadavg()[0], "git_commit": _git_commit()}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("models", nargs="+", help="demo-model names or .gguf paths")
  p.add_argument("--runs", type=int, default=3, help="runs after the first (at least 1)")
  p.add_argument("--json", help="write the results here")
  args = p.parse_args(argv)
  if args.runs < 1:
    raise SystemExit(f"error: --runs must be >= 1 (the runs after the first), got {args.runs}")
  from jaxllm.models import resolve_model
  ggufs = {}
  for model in args.models:
    try:
      ggufs[model] = resolve_model(model)          # downloaded into the user's cache if needed (a stage line)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
      raise SystemExit(f"error: {e}") from None
  env = where()
  results = []
  for model in args.models:
    gguf = ggufs[model]
    with tempfile.TemporaryDirectory(prefix="jaxllm-startup-") as cache:
      os.symlink(gguf, os.path.join(cache, os.path.basename(gguf)))
      first = run_cli(model, cache, [])
      later = [run_cli(model, cache, []) for _ in range(args.runs)]
      requests = two_requests(model, cache)
    rec = {"model": model, "env": env, "first_run": first, "later_runs": later,
           "later_first_token_s_median": statistics.median(r["first_token_s"] for r in later),
           "later_peak_rss_bytes_max": max(r["peak_rss_bytes"] for r in later), **requests,
           "first_over_second_ttft": requests["first_ttft_ms"] / requests["second_ttft_ms"]}
    results.append(rec)
    times = ", ".join(f"{r['first_token_s']:.2f}" for r in later)
    print(f"[startup] {model}: first run {first['first_token_s']:.2f} s to first token "
          f"({first['peak_rss_bytes'] / 1e9:.2f} GB peak RSS); later runs {times} s (median "
          f"{rec['later_first_token_s_median']:.2f} s, peak RSS <= {rec['later_peak_rss_bytes_max'] / 1e9:.2f} GB); "
          f"in one process: first request TTFT {requests['first_ttft_ms']:.0f} ms, second "
          f"{requests['second_ttft_ms']:.0f} ms ({rec['first_over_second_ttft']:.2f}x)", file=sys.stderr)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
