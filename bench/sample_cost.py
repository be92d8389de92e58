"""What sampling costs per token on the device, by part: each part chained `--n` times in one program
(each call's input depends on the previous call's output), compiled with command buffers like the
engine's step; per call = (T(2n) - T(n)) / n, the best of 5.

  python bench/sample_cost.py [--vocab 151936] [--n 32] [--out out.json]

Parts (logits [1, V] f32, the settings of `jaxllm.sampling.sample` as data):
  chain        nothing but the chaining itself (one pass over V), included in every row below
  greedy       sample(..., greedy_only=True): the penalties, the finiteness check, the argmax
  full         sample(...) with temperature 0.7, top-p 0.9: everything the sampled step ran before the kernel
  full_ffi     the same with the candidates from the CUDA kernel (sample(..., kernels="ffi"), the
               default; the lab switch JAXLLM_CANDIDATES_KERNEL=0 turns it off in a lab build)
  penalties    apply_penalties alone
  candidates   top_candidates(z, MAX_TOP_K) (the exact two-stage top-k, jnp: XLA's sorts)
  candidates_ffi  the CUDA kernel's candidates (jaxllm.kernels.ffi.top_candidates)
  gumbel_full  the Gumbel-max draw over all V
  logsumexp    the full softmax's denominator
"""
from __future__ import annotations

import argparse
import json


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--vocab", type=int, default=151936)
  p.add_argument("--n", type=int, default=16)
  p.add_argument("--out")
  args = p.parse_args(argv)
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxllm import sampling
  from jaxllm.bench import best_seconds
  from jaxllm.kernels import ffi
  from jaxllm.sampling import SamplingParams, Sampler

  rng = np.random.default_rng(0)
  x0 = jnp.asarray(rng.standard_normal((1, args.vocab)) * 3, jnp.float32)
  smp = jax.tree.map(jnp.asarray, Sampler.create(SamplingParams(temperature=0.7, top_p=0.9), 1, seed=0,
                                                 vocab_size=args.vocab))

  def dep(x, scalar):   # the next call's input depends on this call's result (no reordering, no CSE)
    return x + (scalar.astype(jnp.float32) * 0.0)

  parts = {
      "chain": lambda x, s: x[0, 0],   # the chain's own cost (dep's pass over V), in every other row too
      "greedy": lambda x, s: sampling.sample(x, s, greedy_only=True)[0][0],
      "full": lambda x, s: sampling.sample(x, s)[0][0],
      "full_ffi": lambda x, s: sampling.sample(x, s, kernels="ffi")[0][0],
      "penalties": lambda x, s: sampling.apply_penalties(x, s)[0, 7],
      "candidates": lambda x, s: sampling.top_candidates(x / 0.7, sampling.MAX_TOP_K)[1][0, -1],
      "candidates_ffi": lambda x, s: ffi.top_candidates(x / 0.7, sampling.MAX_TOP_K)[1][0, -1],
      "gumbel_full": lambda x, s: jnp.argmax(x + jax.random.gumbel(jax.random.PRNGKey(0), x.shape), -1)[0],
      "logsumexp": lambda x, s: jax.nn.logsumexp(x, -1)[0],
  }

  def chain(fn, n):
    def run(x, s):
      for _ in range(n):
        x = dep(x, fn(x, s))
      return x
    return best_seconds(jax.jit(run), x0, smp)

  rows = []
  if ffi.unavailable_reason() or jax.default_backend() != "gpu":
    parts = {k: f for k, f in parts.items() if not k.endswith("_ffi")}
  for name, fn in parts.items():
    t1, t2 = chain(fn, args.n), chain(fn, 2 * args.n)
    rows.append({"part": name, "us_per_call": (t2 - t1) / args.n * 1e6})
    print(f"{name:12s} {rows[-1]['us_per_call']:8.2f} us", flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"vocab": args.vocab, "n": args.n, "backend": jax.default_backend(), "rows": rows}, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
