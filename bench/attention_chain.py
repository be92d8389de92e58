"""The decode attention's cost inside a command buffer: 240 calls chained (each call's output is the next
call's query), per call, for the one-kernel (merged) and the two-kernel (split + combine) forms, by visible
length and split count; beside them a W8A16 call of 64 x 64 (the fixed cost of any FFI kernel in the graph).

  python bench/attention_chain.py [--model synthetic:qwen2.5-0.5b] [--lengths 1 256 4096] [--splits 1 8 32 64]
                                  [--out out.json]

"default" among --splits is the engine's choice (fused.merged_splits). JAXLLM_ATTN_CLUSTER=0 merges the
one-kernel form's splits through global memory only (no thread-block clusters), for comparison: a lab switch,
read only by the lab build (pip install -e . -Ccmake.define.JAXLLM_LAB=ON; docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="synthetic:qwen2.5-0.5b")
  p.add_argument("--max-context", type=int, default=4096)
  p.add_argument("--calls", type=int, default=240)
  p.add_argument("--lengths", type=int, nargs="+", default=[1, 256, 4096])
  p.add_argument("--splits", nargs="+", default=["1", "8", "32", "64"], help="split counts, or 'default'")
  p.add_argument("--out")
  args = p.parse_args(argv)
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxllm.kernels import ffi, fused
  from jaxllm.presets import preset
  from jaxllm.quant import Linear, quantize_int8
  if jax.default_backend() != "gpu":
    print("attention_chain: needs a GPU")
    return 0
  c = preset(args.model)
  rng = np.random.default_rng(0)
  dt = jnp.bfloat16
  shape = (2, 1, c.n_kv_heads, args.max_context, c.head_dim)
  k = jnp.asarray(rng.standard_normal(shape), dt)
  v = jnp.asarray(rng.standard_normal(shape), dt)
  q0 = jnp.asarray(rng.standard_normal((1, c.n_heads, c.head_dim)), dt)
  n = args.calls

  def timed(fn, *a):
    f = jax.jit(fn)
    jax.block_until_ready(f(*a))
    best = []
    for _ in range(5):
      t0 = time.perf_counter()
      jax.block_until_ready(f(*a))
      best.append((time.perf_counter() - t0) / n * 1e6)
    return min(best)   # us per call

  rows = []
  tq, ts = quantize_int8(rng.standard_normal((1, 64, 64)).astype(np.float32))
  tiny = Linear(w=jnp.asarray(tq), scale=jnp.asarray(ts))

  def tiny_chain(x):
    for _ in range(n):
      x = ffi.w8a16_matmul(x, tiny, 0)
    return x
  base = timed(tiny_chain, jnp.ones((1, 64), dt))
  rows.append({"op": "w8a16 64x64", "us": base})
  for length in args.lengths:
    lengths = jnp.asarray([length], jnp.int32)
    for item in args.splits:
      splits = fused.merged_splits(1, k) if item == "default" else int(item)
      def merged(q, k, v, cnt):
        for i in range(n):   # the kernel leaves the counters zero: one buffer passed along
          q, cnt = fused.decode_attention_merged(q, k, v, i % 2, lengths, cnt, splits=splits, with_counters=True)
        return q
      rows.append({"op": "merged", "length": length, "splits": splits,
                   "us": timed(merged, q0, k, v, jnp.zeros((1, c.n_kv_heads), jnp.int32))})
    def unfused(q, k, v):
      for i in range(n):
        q = ffi.decode_attention(q, k, v, i % 2, lengths)
      return q
    rows.append({"op": "split+combine", "length": length,
                 "splits": ffi.attention_splits(1, c.n_kv_heads, args.max_context, 2, c.head_dim),
                 "us": timed(unfused, q0, k, v)})
  print("| op | length | splits | us per call |\n|---|---|---|---|")
  for r in rows:
    print(f"| {r['op']} | {r.get('length', '')} | {r.get('splits', '')} | {r['us']:.2f} |")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
