"""Matmul throughput of the CPU handlers, one shape at a time (G weights/s).

  python bench/cpu_gemv.py [--m 1 4]
  python bench/cpu_gemv.py --chain 30      # a layer stack: each shape 30 times, chained, in one program
  python bench/cpu_gemv.py --chain 30 --weights w8a16 q4 q5   # the low-bit handler's 4- and 5-bit weights too
  python bench/cpu_gemv.py --chain 24 --weights q4 q5 --shapes qwen   # Qwen2.5-0.5B's layer shapes
  python bench/cpu_gemv.py --prefill 32 64 128 512 --weights q4 q5 q6 --shapes qwen   # many rows of x

Each shape's weights are one random [N, K] int8 matrix (64-wide groups), x random f32; one jitted call
timed back to back, best of three batches. Shapes: SmolLM2-135M's gate/up (4096 rows), part of and its
whole LM head, Qwen2.5-0.5B's LM head and down projection. Rates on weights far larger than the caches are
bounded by what the memory delivers; those that fit (the first) show the compute ceiling.

--prefill M... times the low-bit and Q6_K kernels at M rows of x (a prefill chunk) against the reference they
fall back to past linear.lowbit_max_m() rows (XLA's dot on the layer dequantized in the call), each the layer
shapes of --shapes, one layer, best of three batches; GFLOP/s = 2 M N K / time.

--chain L times what a decode step sees instead: L stacked copies of each shape (SmolLM2-135M's four layer
matmuls), each call's input depending on the previous call's output, in one jitted program, so no call
finds its weights in the caches; per call = (that program - the same chain without the matmuls) / L.
"""
from __future__ import annotations

import argparse
import sys

SHAPES = [(576, 4096), (576, 16384), (576, 49152), (896, 151936), (4864, 896)]
CHAIN_SHAPES = {"smollm2": [(576, 960), (576, 576), (576, 3072), (1536, 576)],   # SmolLM2-135M: qkv, o, gate/up, down
                "qwen": [(896, 1152), (896, 896), (896, 9728), (4864, 896)]}      # Qwen2.5-0.5B


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--m", type=int, nargs="+", default=[1, 4], help="rows of x")
  p.add_argument("--chain", type=int, default=0, metavar="L", help="time L chained layers of each shape instead")
  p.add_argument("--prefill", type=int, nargs="+", default=[], metavar="M",
                 help="time the low-bit kernels (--weights q4 q5 q6) against their reference at these rows of x instead")
  p.add_argument("--shapes", default="smollm2", choices=tuple(CHAIN_SHAPES),
                 help="with --chain or --prefill: whose layer shapes")
  p.add_argument("--weights", nargs="+", default=["w8a16"], choices=("w8a16", "q4", "q5", "q6"),
                 help="with --chain: W8A16 (int8, an f32 scale per 64), LowBit 4- or 5-bit (f16 scale, min per 32), "
                      "Q6K (Q6_K's fields; shapes whose K is a multiple of 256)")
  args = p.parse_args(argv)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jaxllm.bench import best_seconds
  from jaxllm.kernels import ffi
  from jaxllm.quant import Linear, quantize_int8
  rng = np.random.default_rng(0)
  if args.chain:
    return chain(args.chain, args.weights, args.shapes)
  if args.prefill:
    if "w8a16" in args.weights:
      p.error(f"--prefill times the low-bit kernels: give --weights among q4, q5, q6, got {args.weights}")
    return prefill(args.prefill, args.weights, args.shapes)
  print("| K | N | weights (MB) | M | us per call | G weights/s |\n|---|---|---|---|---|---|")
  for k, n in SHAPES:
    q, s = quantize_int8(rng.standard_normal((1, n, k)).astype(np.float32))
    lin = Linear(jnp.asarray(q), jnp.asarray(s))
    for m in args.m:
      x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
      f = jax.jit(lambda x, lin: ffi.w8a16_matmul(x, lin, 0))    # the weights an argument, as in a model's step
      best = best_seconds(f, x, lin, calls=max(10, int(2e8 / (n * k))), batches=3)
      print(f"| {k} | {n} | {n * k / 1e6:.1f} | {m} | {best * 1e6:.1f} | {n * k / best / 1e9:.2f} |")
  return 0


def _weights(kind: str, layers: int, n: int, k: int, rng):
  """Random stacked weights [layers, n, k] of a kind, and the FFI matmul that takes them."""
  import jax.numpy as jnp
  import numpy as np
  from jaxllm.kernels import ffi
  from jaxllm.quant import Linear, LowBit, quantize_int8
  if kind == "w8a16":
    q, s = quantize_int8(rng.standard_normal((layers, n, k)).astype(np.float32))
    return Linear(jnp.asarray(q), jnp.asarray(s)), ffi.w8a16_matmul
  if kind == "q6":
    from jaxllm.quant import Q6K
    return Q6K(ql=jnp.asarray(rng.integers(0, 256, (layers, n, k // 2), dtype=np.uint8)),
               qh=jnp.asarray(rng.integers(0, 256, (layers, n, k // 4), dtype=np.uint8)),
               sc=jnp.asarray(rng.integers(-64, 64, (layers, n, k // 16), dtype=np.int8)),
               d=jnp.asarray(rng.uniform(1e-4, 1e-3, (layers, n, k // 256)).astype(np.float16))), ffi.q6k_matmul
  g = k // 32
  high = rng.integers(0, 2 ** 32, (layers, n, g if kind == "q5" else 0), dtype=np.uint32)
  lin = LowBit(q=jnp.asarray(rng.integers(0, 256, (layers, n, k // 2), dtype=np.uint8)), high=jnp.asarray(high),
               scale=jnp.asarray(rng.uniform(0.001, 0.01, (layers, n, g)).astype(np.float16)),
               min=jnp.asarray(rng.uniform(-0.1, 0.0, (layers, n, g)).astype(np.float16)))
  return lin, ffi.lowbit_matmul


def chain(layers: int, kinds=("w8a16",), shapes: str = "smollm2") -> int:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jaxllm.bench import best_seconds
  rng = np.random.default_rng(0)
  print("| weights | K | N | layers | MB | us per call | G weights/s | GB/s |\n|---|---|---|---|---|---|---|---|")
  for kind, (k, n) in ((kind, shape) for shape in CHAIN_SHAPES[shapes] for kind in kinds
                       if kind != "q6" or shape[0] % 256 == 0):
    lin, matmul = _weights(kind, layers, n, k, rng)
    mb = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(lin)) / 1e6
    x = jnp.asarray(rng.standard_normal((1, k)), jnp.float32)

    def with_matmuls(x, lin):
      for i in range(layers):
        x = x + matmul(x, lin, i)[:, :1] * 0   # a dependency on the call, nothing more
      return x

    def without(x, lin):
      for i in range(layers):
        x = x + x[:, :1] * 0
      return x
    per = (best_seconds(jax.jit(with_matmuls), x, lin, calls=20)
           - best_seconds(jax.jit(without), x, lin, calls=20)) / layers
    print(f"| {kind} | {k} | {n} | {layers} | {mb:.1f} | {per * 1e6:.1f} | {n * k / per / 1e9:.2f} | "
          f"{mb / layers / 1e3 / per:.2f} |")
  return 0


def prefill(ms, kinds, shapes: str) -> int:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jaxllm.bench import best_seconds
  from jaxllm.kernels import linear_reference
  rng = np.random.default_rng(0)
  print("| weights | K | N | M | kernel us | reference us | kernel / reference | kernel GFLOP/s |\n"
        "|---|---|---|---|---|---|---|---|")
  for kind, (k, n) in ((kind, shape) for shape in CHAIN_SHAPES[shapes] for kind in kinds
                       if kind != "q6" or shape[0] % 256 == 0):
    lin, matmul = _weights(kind, 1, n, k, rng)
    for m in ms:
      x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
      calls = max(3, int(2e9 / (m * n * k)))
      t = [best_seconds(jax.jit(lambda x, lin, f=f: f(x, lin, 0)), x, lin, calls=calls, batches=3)
           for f in (matmul, linear_reference)]
      print(f"| {kind} | {k} | {n} | {m} | {t[0] * 1e6:.0f} | {t[1] * 1e6:.0f} | {t[0] / t[1]:.2f} | "
            f"{2 * m * n * k / t[0] / 1e9:.1f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
