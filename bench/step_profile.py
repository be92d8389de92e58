"""The decode step's kernels as the GPU ran them: a device trace (CUPTI, through jax.profiler) of the
engine's decode calls back to back, summed per kernel name and per role in the fused step.

  python bench/step_profile.py [--model synthetic:qwen2.5-0.5b] [--batch 1,16] [--tokens 64] [--kernels ffi]
                               [--out p.json]

A greedy request of a `--prompt-len` prompt is prefilled (in `--batch` rows), then `--tokens` tokens are decoded (K tokens per
call, the calls dispatched back to back) under jax.profiler.trace, and the device's kernels are read back
from the trace (jax.profiler.ProfileData). Each kernel's **critical share** is its end time
less the latest end of the kernels before it: the time the chain waited on it. The shares add up to the
traced span, so they say where a token's time goes even where kernels overlap (programmatic dependent
launch starts a kernel early and it then waits; its duration counts that wait, its share does not).
Printed per kernel name: launches per token, critical share per token (us), idle before it (us), mean
duration (us); then per role (the fused step's QKV, attention, O, gate/up, down and head kernels).
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile


def short_name(name: str) -> str:
  """A kernel's name without template arguments and parameter lists (a demangled name's head)."""
  name = re.sub(r"\(.*$", "", name)
  depth, out = 0, []
  for ch in name:
    if ch == "<":
      depth += 1
    elif ch == ">":
      depth -= 1
    elif depth == 0:
      out.append(ch)
  name = "".join(out).strip()
  return name.split(" ")[-1][:80] or "?"


def device_events(trace_dir: str) -> list[tuple[int, int, str]]:
  """(start ns, end ns, name) of every event on the GPU planes' stream lines of the trace in trace_dir."""
  from jax.profiler import ProfileData
  files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  events = []
  for path in files:
    data = ProfileData.from_file(path)
    for plane in data.planes:
      if not plane.name.startswith("/device:GPU"):
        continue
      for line in plane.lines:
        if not line.name.lower().startswith("stream"):
          continue
        for ev in line.events:
          events.append((int(ev.start_ns), int(ev.end_ns), ev.name))
  return sorted(events)


def critical_shares(events: list[tuple[int, int, str]]) -> list[tuple[str, int, int, int]]:
  """(name, share ns, idle ns, duration ns) per event, in start order. share = end - the latest end of the
  events before it (0 when it ends before one of them): the shares add up to the span. idle = the part of
  the share before the event started (the device had nothing running: launch latency or the host)."""
  out, latest = [], events[0][0] if events else 0
  for start, end, name in events:
    out.append((name, max(0, end - latest), max(0, start - latest), end - start))
    latest = max(latest, end)
  return out


LAYER_ROLES = ("qkv", "o", "gate_up", "down")


def roles(events: list[tuple[int, int, str]]) -> list[str]:
  """Each event's role in the fused step's chain (w8a16 and attention kernels; others keep their short
  name): the matmul just before an attention kernel is the layer's QKV, the three after it O, gate/up and
  down, a fourth (or the head kernel, greedy or logits) the LM head."""
  names = [short_name(n) for _, _, n in events]
  out = list(names)
  since = None   # matmuls since the last attention kernel
  for i, n in enumerate(names):
    if n.endswith("attn1::Kernel"):
      out[i], since = "attention", 0
    elif n.endswith("w8a16::HeadKernel"):   # the LM head at batch 1 (greedy or logits)
      out[i], since = "head", None
    elif n.endswith("w8a16::Kernel"):
      nxt = next((m for m in names[i + 1:] if m.endswith("::Kernel")), "")
      if nxt.endswith("attn1::Kernel"):
        out[i] = "qkv"
      elif since is not None and since < 3:
        out[i] = LAYER_ROLES[since + 1]
        since += 1
      else:
        out[i], since = "head", None
  return out


def mma_roles(names: list[str], tokens: int) -> dict[int, str]:
  """The batched step's tensor-core matmuls by their place in a step (index -> role): each step launches them
  in the same order, every layer's q/k/v, O, gate/up and down, then the LM head, so the i-th of a step's n
  is layer i // 4's LAYER_ROLES[i % 4], the last the head. Empty unless they come a whole number of times a
  step, 4 a layer and one more."""
  where = [i for i, n in enumerate(names) if n.endswith("mma::Kernel")]
  per = len(where) // tokens if tokens else 0
  if not where or per * tokens != len(where) or per % 4 != 1:
    return {}
  return {i: "mma " + ("head" if j % per == per - 1 else LAYER_ROLES[j % per % 4]) for j, i in enumerate(where)}


def summarize(events, tokens: int) -> dict:
  shares = critical_shares(events)
  span = events[-1][1] - events[0][0] if events else 0
  per = collections.defaultdict(lambda: [0, 0, 0, 0])
  for name, share, idle, dur in shares:
    row = per[short_name(name)]
    for j, v in enumerate((1, share, idle, dur)):
      row[j] += v
  rows = sorted(per.items(), key=lambda kv: -kv[1][1])
  by_role = collections.defaultdict(lambda: [0, 0, 0, 0])
  role_of = roles(events)
  for i, role in mma_roles([short_name(n) for _, _, n in events], tokens).items():
    role_of[i] = role
  for role, (_, share, idle, dur) in zip(role_of, shares):
    for j, v in enumerate((1, share, idle, dur)):
      by_role[role][j] += v
  return {"tokens": tokens, "events": len(events), "span_us_per_token": span / tokens / 1e3,
          "idle_us_per_token": sum(i for _, _, i, _ in shares) / tokens / 1e3,
          "rows": [{"kernel": n, "per_token": c / tokens, "share_us_per_token": s / tokens / 1e3,
                    "idle_us_per_token": i / tokens / 1e3, "mean_duration_us": d / c / 1e3}
                   for n, (c, s, i, d) in rows],
          "roles": [{"role": r, "per_token": c / tokens, "share_us_per_token": s / tokens / 1e3,
                     "idle_us_per_token": i / tokens / 1e3, "mean_duration_us": d / c / 1e3}
                    for r, (c, s, i, d) in sorted(by_role.items(), key=lambda kv: -kv[1][1])]}


def profile(engine, batch: int, prompt: list[int], tokens: int, trace_dir: str) -> dict | None:
  """The summary of `tokens` traced steps of `batch` rows (None where the trace holds no device kernels)."""
  import jax
  k = engine.tokens_per_call_for(batch)
  calls = max(1, tokens // k)
  # a greedy request prefilled, then only its calls traced
  with engine.timing_run(prompt, (calls + 1) * k + 1, batch) as run:
    state = run.state
    advance = engine.advance_fn(batch, True)
    state, block, _ = advance(state, None)
    jax.block_until_ready(block)
    with jax.profiler.trace(trace_dir):
      for _ in range(calls):
        state, block, _ = advance(state, block)
      jax.block_until_ready(block)
    run.state = state
  events = device_events(trace_dir)
  print(f"[step_profile] batch {batch}: {len(events)} device events, kernels={engine.kernels}, K={k}, {calls} calls",
        file=sys.stderr)
  if not events:
    return None
  summary = summarize(events, calls * k)
  summary.update(batch=batch, tokens_per_call=k)
  return summary


def show(summary: dict) -> None:
  print(f"\n{'kernel':60s} {'/step':>7s} {'share us/step':>14s} {'idle us/step':>13s} {'mean dur us':>12s}")
  for r in summary["rows"]:
    print(f"{r['kernel']:60s} {r['per_token']:7.2f} {r['share_us_per_token']:14.2f} {r['idle_us_per_token']:13.2f} "
          f"{r['mean_duration_us']:12.2f}")
  print(f"\n{'role':40s} {'/step':>7s} {'share us/step':>14s} {'idle us/step':>13s} {'mean dur us':>12s}")
  for r in summary["roles"]:
    print(f"{r['role']:40s} {r['per_token']:7.2f} {r['share_us_per_token']:14.2f} {r['idle_us_per_token']:13.2f} "
          f"{r['mean_duration_us']:12.2f}")
  print(f"span {summary['span_us_per_token']:.2f} us a step over {summary['tokens']} steps of {summary['batch']} "
        f"rows, of which idle {summary['idle_us_per_token']:.2f}")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="synthetic:qwen2.5-0.5b")
  p.add_argument("--prompt-len", type=int, default=128)
  p.add_argument("--batch", default="1", help="rows decoded together (each the same prompt); several, "
                                              "comma-separated, are traced one after another on one engine")
  p.add_argument("--tokens", type=int, default=64, help="steps traced (per batch size)")
  p.add_argument("--kernels", default="ffi")
  p.add_argument("--tokens-per-call", type=int, default=None)
  p.add_argument("--trace-dir", help="keep the traces under here (default: a temporary directory)")
  p.add_argument("--out", help="write the summaries as JSON here (a list, one per batch size)")
  args = p.parse_args(argv)
  try:
    batches = [int(b) for b in args.batch.split(",")]
    assert batches and all(b >= 1 for b in batches)
  except (ValueError, AssertionError):
    p.error(f"--batch takes positive integers separated by commas, got {args.batch!r}")

  import jax
  import numpy as np
  from jaxllm.bench import load_model
  from jaxllm.engine import Engine
  config, weights, _, _ = load_model(args.model, "w8a16", 0)
  engine = Engine(config, weights, None, max_context=args.prompt_len + args.tokens + 64,
                  kernels=args.kernels, tokens_per_call=args.tokens_per_call)
  engine.warmup(args.prompt_len)
  prompt = [int(t) for t in np.random.default_rng(0).integers(0, config.vocab_size, args.prompt_len)]
  root = args.trace_dir or tempfile.mkdtemp(prefix="step_profile_")
  summaries = []
  for batch in batches:
    summary = profile(engine, batch, prompt, args.tokens, os.path.join(root, f"batch{batch}"))
    if summary is None:
      print(f"step_profile: no device kernels in the trace ({jax.default_backend()} backend)")
      return 0
    summary.update(model=args.model, kernels_path=engine.kernels, device=str(jax.devices()[0]),
                   xla_flags=os.environ.get("XLA_FLAGS", ""))
    show(summary)
    summaries.append(summary)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(summaries, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
