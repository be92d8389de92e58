"""Kernel microbenchmarks: jaxllm's FFI kernels vs XLA on the same shapes, timed as the decode step uses
them, with the byte floor beside each.

Method (what makes the number a kernel time, not overhead):
- One compiled program holds n calls back to back (one CUDA graph with command buffers on), each call on
  its own weight (or cache-layer) copy, so together they span well past the 50 MB L2. No two calls are
  identical: XLA would merge them (common-subexpression elimination) and time one.
- Every output is written into a donated input (kept with keep_unused), so buffer addresses never change
  and XLA replays the recorded graph without updating it.
- Executions are enqueued back to back and synchronized once per batch: the device never waits for the
  host. Time per execution is the median over batches.
- Two program lengths, n and 2n: per-call time = (T(2n) - T(n)) / n, which cancels the fixed cost of an
  execution (graph launch, argument handling) and leaves what each extra call adds.

  python bench/kernels.py --out kernels.jsonl --report kernels.md
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.bench import copy_bandwidth_gb_s, environment, write_records
from jaxllm.kernels import decode_attention_reference, ffi
from jaxllm.quant import GROUP, Linear

# (name, K, N): Qwen2.5-0.5B per-layer shapes and its LM head.
MATMUL_SHAPES = [("qkv", 896, 1152), ("o", 896, 896), ("gate_up", 896, 9728), ("down", 4864, 896),
                 ("lm_head", 896, 151936)]
ROTATE_BYTES = 256 << 20   # bytes the copies of the short program span: 5x the H200's 50 MB L2
MIN_CALLS = 16             # calls in the short program (the long one has twice as many)


def _calls(bytes_per_copy: int) -> int:
  """Calls in the short program: at least MIN_CALLS, and enough to span ROTATE_BYTES."""
  return int(max(MIN_CALLS, math.ceil(ROTATE_BYTES / bytes_per_copy)))


def _median_exec_seconds(fn, args, outs, batches: int = 7, per_batch: int = 10) -> float:
  """Median seconds of one execution of fn(*args, outs), its outputs donated back as the next outs:
  two untimed runs (warm-up, graph record), then batches of back-to-back executions, one sync each."""
  outs = fn(*args, outs)
  outs = fn(*args, outs)
  jax.block_until_ready(outs)
  times = []
  for _ in range(batches):
    t0 = time.perf_counter()
    for _ in range(per_batch):
      outs = fn(*args, outs)
    jax.block_until_ready(outs)
    times.append((time.perf_counter() - t0) / per_batch)
  return statistics.median(times)


def _exec_seconds(build, n: int, args, outs, graphs: bool, batches: int, per_batch: int) -> float:
  """Median seconds of one execution of a program of n calls (outputs donated back every time)."""
  options = None if graphs else {"xla_gpu_enable_command_buffer": ""}
  fn = jax.jit(build(n), donate_argnums=(len(args),), keep_unused=True, compiler_options=options)
  return _median_exec_seconds(fn, args, outs, batches, per_batch)


def per_call_us(build, n: int, args, make_outs, graphs: bool = True, batches: int = 7,
                per_batch: int = 10) -> dict:
  """Per-call microseconds by the two-length difference, plus the plain per-call average of the long
  program (which still carries its share of the fixed per-execution cost)."""
  t1 = _exec_seconds(build, n, args, make_outs(n), graphs, batches, per_batch)
  t2 = _exec_seconds(build, 2 * n, args, make_outs(2 * n), graphs, batches, per_batch)
  return {"us": (t2 - t1) / n * 1e6, "avg_us": t2 / (2 * n) * 1e6, "fixed_us": (2 * t1 - t2) * 1e6}


def bench_matmul(name: str, k: int, n: int, m: int, bandwidth: float, naive: bool) -> dict:
  key = jax.random.PRNGKey(n + k)
  c8, cbf = _calls(n * k), _calls(2 * n * k)          # int8 and bf16 programs: n calls, and 2n
  w8 = jax.random.randint(key, (2 * c8, n, k), -127, 128, jnp.int8)
  scale = jax.random.uniform(jax.random.fold_in(key, 1), (2 * c8, n, k // GROUP), jnp.float32, 0.005, 0.02)
  wbf = [jax.random.normal(jax.random.fold_in(key, 2 + i), (n, k), jnp.bfloat16) for i in range(2 * cbf)]
  x = jax.random.normal(jax.random.fold_in(key, 999), (m, k), jnp.bfloat16)

  def outs(count):
    return [jnp.zeros((m, n), jnp.bfloat16) for _ in range(count)]

  def ours(count):
    return lambda x, w8, scale, _: [ffi.w8a16_matmul(x, Linear(w8, scale), i) for i in range(count)]

  def bf16_dot(count):
    return lambda x, ws, _: [x @ ws[i].T for i in range(count)]

  def naive_w8a16(count):   # XLA on int8 weights: dequantize inside the dot's fusion
    return lambda x, w8, scale, _: [x @ Linear(w8[i], scale[i]).dequantize(jnp.bfloat16).T
                                    for i in range(count)]

  rec = {"bench": "w8a16_matmul", "shape": name, "m": m, "k": k, "n": n, "calls_int8": c8, "calls_bf16": cbf}
  ours_t = per_call_us(ours, c8, (x, w8, scale), outs)
  bf16_t = per_call_us(bf16_dot, cbf, (x, wbf), outs)
  rec.update(ours_us=ours_t["us"], ours_avg_us=ours_t["avg_us"], ours_fixed_us=ours_t["fixed_us"],
             xla_bf16_dot_us=bf16_t["us"], xla_bf16_dot_avg_us=bf16_t["avg_us"])
  if naive:
    rec["xla_w8a16_us"] = per_call_us(naive_w8a16, c8, (x, w8, scale), outs)["us"]
  weight_bytes = n * k + n * (k // GROUP) * 4
  rec.update(ratio_vs_bf16=rec["ours_us"] / rec["xla_bf16_dot_us"], weight_bytes=weight_bytes,
             floor_us=weight_bytes / (bandwidth * 1e9) * 1e6, ours_gb_s=weight_bytes / (rec["ours_us"] * 1e3),
             bf16_floor_us=2 * n * k / (bandwidth * 1e9) * 1e6)
  return rec


def bench_attention(s_max: int, lengths: list[int], bandwidth: float) -> list[dict]:
  """Both implementations at every visible length; one compile per program length serves all lengths
  (the length is a device value)."""
  b, h, g, d = 1, 14, 2, 64   # Qwen2.5-0.5B
  layer_bytes = 2 * b * g * s_max * d * 2
  calls = _calls(layer_bytes)
  layers = 2 * calls
  key = jax.random.PRNGKey(s_max)
  kc = jax.random.normal(key, (layers, b, g, s_max, d), jnp.bfloat16)
  vc = jax.random.normal(jax.random.fold_in(key, 1), (layers, b, g, s_max, d), jnp.bfloat16)
  q = jax.random.normal(jax.random.fold_in(key, 2), (b, h, d), jnp.bfloat16)

  def outs(count):
    return [jnp.zeros((b, h, d), jnp.bfloat16) for _ in range(count)]

  def ours(count):
    return lambda q, kc, vc, n, _: [ffi.decode_attention(q, kc, vc, i, n) for i in range(count)]

  def xla(count):
    return lambda q, kc, vc, n, _: [decode_attention_reference(q, kc, vc, i, n) for i in range(count)]

  times = {}
  for impl, build in (("ours", ours), ("xla", xla)):
    fns = {count: jax.jit(build(count), donate_argnums=(4,), keep_unused=True) for count in (calls, 2 * calls)}
    for length in lengths:
      n = jnp.full((b,), length, jnp.int32)
      t = {count: _median_exec_seconds(fn, (q, kc, vc, n), outs(count)) for count, fn in fns.items()}
      times[impl, length] = (t[2 * calls] - t[calls]) / calls * 1e6
  records = []
  for length in lengths:
    kv_bytes = 2 * b * g * length * d * 2
    records.append({"bench": "decode_attention", "s_max": s_max, "length": length, "b": b, "h": h, "g": g,
                    "d": d, "cache_layers": layers, "calls": calls, "ours_us": times["ours", length],
                    "xla_masked_us": times["xla", length],
                    "ratio_vs_xla": times["ours", length] / times["xla", length], "kv_bytes": kv_bytes,
                    "floor_us": kv_bytes / (bandwidth * 1e9) * 1e6})
  return records


def _linear_fit(xs, ys) -> tuple[float, float, float]:
  """Least-squares y = a + b x; returns (a, b, r^2)."""
  xs, ys = np.asarray(xs, float), np.asarray(ys, float)
  b, a = np.polyfit(xs, ys, 1)
  resid = ys - (a + b * xs)
  r2 = 1 - (resid ** 2).sum() / max(((ys - ys.mean()) ** 2).sum(), 1e-30)
  return a, b, r2


def report(records: list[dict], env: dict, bw: float) -> str:
  lines = [f"Device {env['device']}, copy bandwidth {bw:.0f} GB/s (read + write), jax {env['jax']}, "
           f"commit {env['git_commit']}. Per-call times by the two-length difference (see bench/kernels.py).", "",
           "| shape | M | K -> N | ours (us) | XLA bf16 dot (us) | ours / bf16 | naive XLA W8A16 (us) | "
           "int8 byte floor (us) | ours GB/s | fixed cost per execution (us) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in records:
    if r["bench"] == "w8a16_matmul":
      naive = f"{r['xla_w8a16_us']:.2f}" if "xla_w8a16_us" in r else "-"
      lines.append(f"| {r['shape']} | {r['m']} | {r['k']} -> {r['n']} | {r['ours_us']:.2f} | "
                   f"{r['xla_bf16_dot_us']:.2f} | {r['ratio_vs_bf16']:.2f} | {naive} | {r['floor_us']:.2f} | "
                   f"{r['ours_gb_s']:.0f} | {r['ours_fixed_us']:.1f} |")
  lines += ["", "| S_max | visible length | ours (us) | XLA masked (us) | ours / XLA | KV byte floor (us) |",
            "|---|---|---|---|---|---|"]
  attn = [r for r in records if r["bench"] == "decode_attention"]
  for r in attn:
    lines.append(f"| {r['s_max']} | {r['length']} | {r['ours_us']:.2f} | {r['xla_masked_us']:.2f} | "
                 f"{r['ratio_vs_xla']:.2f} | {r['floor_us']:.3f} |")
  for s_max in sorted({r["s_max"] for r in attn}):
    rows = [r for r in attn if r["s_max"] == s_max]
    a, b, r2 = _linear_fit([r["length"] for r in rows], [r["ours_us"] for r in rows])
    lines.append(f"\nS_max {s_max}: ours ~ {a:.2f} us + {b * 1e3:.3f} us per 1000 positions (r^2 {r2:.4f}).")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", help="JSON lines file (appended)")
  p.add_argument("--report", help="markdown table file")
  p.add_argument("--m", type=int, nargs="+", default=[1, 16])
  p.add_argument("--shapes", nargs="+", default=[s[0] for s in MATMUL_SHAPES])
  p.add_argument("--s-max", type=int, nargs="+", default=[4096, 32768])
  p.add_argument("--naive", action="store_true", help="also time XLA's W8A16 dot at M=1")
  args = p.parse_args(argv)
  if ffi.unavailable_reason():
    raise SystemExit(f"FFI kernels unavailable: {ffi.unavailable_reason()}")
  env, bw = environment(), copy_bandwidth_gb_s()
  records = []
  for m in args.m:
    for name, k, n in MATMUL_SHAPES:
      if name not in args.shapes:
        continue
      r = bench_matmul(name, k, n, m, bw, naive=args.naive and m == 1)
      records.append(r)
      print(f"matmul {name:8s} M={m:2d} K={k} N={n}: ours {r['ours_us']:.2f} us ({r['ours_gb_s']:.0f} GB/s, "
            f"avg {r['ours_avg_us']:.2f}), bf16 dot {r['xla_bf16_dot_us']:.2f} us, ratio {r['ratio_vs_bf16']:.2f}, "
            f"floor {r['floor_us']:.2f} us", file=sys.stderr, flush=True)
  for s_max in args.s_max:
    lengths = sorted({1, 64, 256, 1024, 4096, s_max // 4, s_max // 2, 3 * s_max // 4, s_max})
    for r in bench_attention(s_max, [x for x in lengths if x <= s_max], bw):
      records.append(r)
      print(f"attention S_max={s_max} len={r['length']}: ours {r['ours_us']:.2f} us, xla {r['xla_masked_us']:.2f} us, "
            f"ratio {r['ratio_vs_xla']:.2f}, floor {r['floor_us']:.2f} us", file=sys.stderr, flush=True)
  for r in records:
    r.update(env=env, copy_gb_s=bw)
  write_records(records, args.out)
  table = report(records, env, bw)
  print(table, file=sys.stderr)
  if args.report:
    with open(args.report, "w") as f:
      f.write(table + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
