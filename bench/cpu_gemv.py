"""W8A16 matmul throughput of the CPU handler, one shape at a time (G weights/s; 1 byte each).

  python bench/cpu_gemv.py [--m 1 4]

Each shape's weights are one random [N, K] int8 matrix (64-wide groups), x random f32; one jitted call
timed back to back, best of three batches. Shapes: SmolLM2-135M's gate/up (4096 rows), part of and its
whole LM head, Qwen2.5-0.5B's LM head and down projection. Rates on weights far larger than the caches are
bounded by what the memory delivers; those that fit (the first) show the compute ceiling.
"""
from __future__ import annotations

import argparse
import sys
import time

SHAPES = [(576, 4096), (576, 16384), (576, 49152), (896, 151936), (4864, 896)]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--m", type=int, nargs="+", default=[1, 4], help="rows of x")
  args = p.parse_args(argv)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jaxllm.kernels import ffi
  from jaxllm.quant import Linear, quantize_int8
  rng = np.random.default_rng(0)
  print("| K | N | weights (MB) | M | us per call | G weights/s |\n|---|---|---|---|---|---|")
  for k, n in SHAPES:
    q, s = quantize_int8(rng.standard_normal((1, n, k)).astype(np.float32))
    lin = Linear(jnp.asarray(q), jnp.asarray(s))
    for m in args.m:
      x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
      f = jax.jit(lambda x: ffi.w8a16_matmul(x, lin, 0))
      f(x).block_until_ready()
      calls = max(10, int(2e8 / (n * k)))
      best = float("inf")
      for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
          r = f(x)
        r.block_until_ready()
        best = min(best, (time.perf_counter() - t0) / calls)
      print(f"| {k} | {n} | {n * k / 1e6:.1f} | {m} | {best * 1e6:.1f} | {n * k / best / 1e9:.2f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
