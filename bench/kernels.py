"""Kernel microbenchmarks: jaxllm's FFI kernels vs XLA on the same shapes, timed as the decode step uses
them: many calls back to back in one compiled program (one CUDA graph), weights rotated across copies so
the L2 cache does not help, medians of repeated runs, with the byte floor beside each.

  python bench/kernels.py --out docs/results/kernels.jsonl --report docs/results/kernels.md
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.bench import copy_bandwidth_gb_s, environment
from jaxllm.kernels import decode_attention_reference, ffi
from jaxllm.quant import GROUP, Linear

# (name, K, N): Qwen2.5-0.5B per-layer shapes and its LM head.
MATMUL_SHAPES = [("qkv", 896, 1152), ("o", 896, 896), ("gate_up", 896, 9728), ("down", 4864, 896),
                 ("lm_head", 896, 151936)]
ROTATE_BYTES = 256 << 20   # weights touched per timed program, well past the 60 MB L2


def _time(f, args, outs, graphs: bool = True, runs: int = 20) -> float:
  """Median seconds of one call of f(*args), after two warm-up calls (record + first replay).

  The outputs are donated back into the next call, so every call writes the same buffers: a command
  buffer then replays as recorded instead of being updated for fresh output addresses.
  """
  options = None if graphs else {"xla_gpu_enable_command_buffer": ""}
  fn = jax.jit(lambda *a: f(*a[:-1]), donate_argnums=(len(args),), compiler_options=options)
  for _ in range(2):
    outs = fn(*args, outs)
  jax.block_until_ready(outs)
  times = []
  for _ in range(runs):
    t0 = time.perf_counter()
    outs = fn(*args, outs)
    jax.block_until_ready(outs)
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def bench_matmul(name: str, k: int, n: int, m: int, bandwidth: float) -> dict:
  copies = int(max(2, min(64, ROTATE_BYTES // (n * k))))
  key = jax.random.PRNGKey(n + k)
  w8 = jax.random.randint(key, (copies, n, k), -127, 128, jnp.int32).astype(jnp.int8)
  scale = jnp.full((copies, n, k // GROUP), 0.01, jnp.float32)
  wbf = [jax.random.normal(jax.random.fold_in(key, i), (n, k), jnp.bfloat16) for i in range(copies)]
  x = jax.random.normal(jax.random.fold_in(key, 99), (m, k), jnp.bfloat16)

  def ours(x, w8, scale):
    return [ffi.w8a16_matmul(x, Linear(w8, scale), i) for i in range(copies)]

  def xla_bf16(x, ws):
    return [x @ w.T for w in ws]

  def xla_w8a16(x, w8, scale):   # the naive XLA path: dequantize in the dot's fusion
    return [jnp.dot(x, Linear(w8[i], scale[i]).dequantize(jnp.bfloat16).T) for i in range(copies)]

  def outs():
    return [jnp.zeros((m, n), jnp.bfloat16) for _ in range(copies)]

  t_ours = _time(ours, (x, w8, scale), outs()) / copies
  t_ours_nograph = _time(ours, (x, w8, scale), outs(), graphs=False) / copies
  t_bf16 = _time(xla_bf16, (x, wbf), outs()) / copies
  t_naive = _time(xla_w8a16, (x, w8, scale), outs()) / copies
  bytes_int8 = n * k + n * (k // GROUP) * 4
  return {"bench": "w8a16_matmul", "shape": name, "m": m, "k": k, "n": n, "copies": copies,
          "ours_us": t_ours * 1e6, "ours_no_graph_us": t_ours_nograph * 1e6, "xla_bf16_dot_us": t_bf16 * 1e6, "xla_w8a16_us": t_naive * 1e6,
          "ratio_vs_bf16": t_ours / t_bf16, "weight_bytes": bytes_int8,
          "floor_us": bytes_int8 / (bandwidth * 1e9) * 1e6, "ours_gb_s": bytes_int8 / t_ours / 1e9}


def bench_attention(s_max: int, length: int, bandwidth: float, layers: int = 24) -> dict:
  b, h, g, d = 1, 14, 2, 64   # Qwen2.5-0.5B
  key = jax.random.PRNGKey(s_max + length)
  kc = jax.random.normal(key, (layers, b, g, s_max, d), jnp.bfloat16)
  vc = jax.random.normal(jax.random.fold_in(key, 1), (layers, b, g, s_max, d), jnp.bfloat16)
  q = jax.random.normal(jax.random.fold_in(key, 2), (b, h, d), jnp.bfloat16)
  n = jnp.full((b,), length, jnp.int32)

  def ours(q, kc, vc, n):
    return [ffi.decode_attention(q, kc, vc, i, n) for i in range(layers)]

  def xla(q, kc, vc, n):
    return [decode_attention_reference(q, kc, vc, i, n) for i in range(layers)]

  def outs():
    return [jnp.zeros((b, h, d), jnp.bfloat16) for _ in range(layers)]

  t_ours = _time(ours, (q, kc, vc, n), outs()) / layers
  t_xla = _time(xla, (q, kc, vc, n), outs()) / layers
  kv_bytes = 2 * b * g * length * d * 2
  return {"bench": "decode_attention", "s_max": s_max, "length": length, "b": b, "h": h, "g": g, "d": d,
          "ours_us": t_ours * 1e6, "xla_masked_us": t_xla * 1e6, "ratio_vs_xla": t_ours / t_xla,
          "kv_bytes": kv_bytes, "floor_us": kv_bytes / (bandwidth * 1e9) * 1e6}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", help="JSON lines file (appended)")
  p.add_argument("--report", help="markdown table file")
  p.add_argument("--m", type=int, nargs="+", default=[1, 4, 16])
  p.add_argument("--s-max", type=int, nargs="+", default=[4096, 32768])
  args = p.parse_args(argv)
  if ffi.unavailable_reason():
    raise SystemExit(f"FFI kernels unavailable: {ffi.unavailable_reason()}")
  env, bw = environment(), copy_bandwidth_gb_s()
  records = []
  for m in args.m:
    for name, k, n in MATMUL_SHAPES:
      records.append(bench_matmul(name, k, n, m, bw))
      r = records[-1]
      print(f"matmul {name:8s} M={m:2d} K={k} N={n}: ours {r['ours_us']:.2f} us ({r['ours_gb_s']:.0f} GB/s; "
            f"no graph {r['ours_no_graph_us']:.2f}), "
            f"bf16 dot {r['xla_bf16_dot_us']:.2f} us, naive w8a16 {r['xla_w8a16_us']:.2f} us, "
            f"ratio {r['ratio_vs_bf16']:.2f}, floor {r['floor_us']:.2f} us", file=sys.stderr, flush=True)
  for s_max in args.s_max:
    for length in sorted({1, 256, 1024, 4096, s_max // 4, s_max // 2, s_max} & set(range(1, s_max + 1))):
      records.append(bench_attention(s_max, length, bw))
      r = records[-1]
      print(f"attention S_max={s_max} len={length}: ours {r['ours_us']:.2f} us, xla {r['xla_masked_us']:.2f} us, "
            f"ratio {r['ratio_vs_xla']:.2f}, floor {r['floor_us']:.2f} us", file=sys.stderr, flush=True)
  for r in records:
    r.update(env=env, copy_gb_s=bw)
  if args.out:
    with open(args.out, "a") as f:
      f.writelines(json.dumps(r) + "\n" for r in records)
  lines = [f"Device {env['device']}, copy bandwidth {bw:.0f} GB/s (read + write), jax {env['jax']}, "
           f"commit {env['git_commit']}", "",
           "| shape | M | K -> N | ours (us) | ours, no graph (us) | XLA bf16 dot (us) | ours / bf16 | naive XLA W8A16 (us) | byte floor (us) | ours GB/s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in records:
    if r["bench"] == "w8a16_matmul":
      lines.append(f"| {r['shape']} | {r['m']} | {r['k']} -> {r['n']} | {r['ours_us']:.2f} | {r['ours_no_graph_us']:.2f} | {r['xla_bf16_dot_us']:.2f} | "
                   f"{r['ratio_vs_bf16']:.2f} | {r['xla_w8a16_us']:.2f} | {r['floor_us']:.2f} | {r['ours_gb_s']:.0f} |")
  lines += ["", "| S_max | visible length | ours (us) | XLA masked (us) | ours / XLA | KV byte floor (us) |",
            "|---|---|---|---|---|---|"]
  for r in records:
    if r["bench"] == "decode_attention":
      lines.append(f"| {r['s_max']} | {r['length']} | {r['ours_us']:.2f} | {r['xla_masked_us']:.2f} | "
                   f"{r['ratio_vs_xla']:.2f} | {r['floor_us']:.3f} |")
  table = "\n".join(lines)
  print(table)
  if args.report:
    with open(args.report, "w") as f:
      f.write(table + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
