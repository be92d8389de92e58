"""Where the fused decode step's time goes: each stage timed as a chain of one call per layer.

  python bench/step_breakdown.py [--model synthetic:qwen2.5-0.5b] [--length 256] [--out out.json]

Each program runs one stage `--reps` x L times (layer i % L, each call depending on the previous one through
the residual stream, as in the step), compiled with command buffers like the engine's step, and is
dispatched `--calls` times back to back: long enough that the device, not the host, sets the pace; time
per stage = program time / calls in it.
Stages that do not feed the residual stream themselves are timed within a prefix of the layer and the
prefix without them subtracted:
  o        x = linear_residual(attn0, wo[i], x)                      (O projection + residual)
  qkv      x -> norm_linear(x, attn_norm, wqkv) -> sink               minus sink (a [D, N] residual matmul)
  epilogue x -> qkv -> qkv_epilogue -> q -> o                        minus qkv + o
  attention ... -> decode_attention_merged -> o                      minus epilogue + qkv + o
  down     x = linear_residual(act0, w_down[i], x)
  gate_up  x -> norm_linear(swiglu) -> down                          minus down
  head     one norm_argmax (per step, not per layer)
and the whole step (model.forward_decode_fused + the argmax head). The sum of the stages against the
step says what the stages leave out (the embedding, the state update, gaps between programs).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="synthetic:qwen2.5-0.5b")
  p.add_argument("--length", type=int, default=256, help="visible keys of the attention")
  p.add_argument("--max-context", type=int, default=4096)
  p.add_argument("--calls", type=int, default=100)
  p.add_argument("--reps", type=int, default=4, help="passes over the layers per program (device-bound)")
  p.add_argument("--out")
  args = p.parse_args(argv)

  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxllm.bench import environment, load_model
  from jaxllm.cache import create_cache
  from jaxllm.kernels import fused
  from jaxllm.model import forward_decode_fused
  from jaxllm.rope import rope_inv_freq, rope_position_scale
  if jax.default_backend() != "gpu":
    print("step_breakdown: needs a GPU (the stages are the CUDA fused kernels)")
    return 0
  config, weights, _, _ = load_model(args.model, "w8a16", 0)
  c, w = config, weights
  dtype = jnp.bfloat16
  cache = create_cache(c, 1, args.max_context, dtype)
  rng = np.random.default_rng(0)
  cache = dataclasses.replace(cache, k=jnp.asarray(rng.standard_normal(cache.k.shape), dtype),
                              v=jnp.asarray(rng.standard_normal(cache.v.shape), dtype))
  x0 = jnp.asarray(rng.standard_normal((1, c.d_model)), jnp.float32)
  attn0 = jnp.asarray(rng.standard_normal((1, c.q_dim)), dtype)
  act0 = jnp.asarray(rng.standard_normal((1, c.d_ff)), dtype)
  pos = jnp.asarray([args.length - 1], jnp.int32)
  inv_freq = rope_inv_freq(c, w.rope_freqs)
  L, eps = c.n_layers, c.rms_eps
  reason = fused.fused_decode_reason(c, w, cache, 1)
  if reason:
    print(f"step_breakdown: the fused step does not take {args.model}: {reason}")
    return 1

  from jaxllm.quant import Linear, quantize_int8
  sq, ss = quantize_int8(rng.standard_normal((L, c.d_model, c.q_dim + 2 * c.kv_dim)).astype(np.float32))
  sink = Linear(w=jnp.asarray(sq), scale=jnp.asarray(ss))   # qkv [1, N] -> the residual: the qkv stage's consumer
  qkv0 = jnp.asarray(rng.standard_normal((1, c.q_dim + 2 * c.kv_dim)), dtype)

  def epi(qkv, i, k, v):
    return fused.qkv_epilogue(qkv, w.bqkv, w.q_norm, w.k_norm, inv_freq, i, pos, pos, k, v, n_heads=c.n_heads,
                              n_kv_heads=c.n_kv_heads, neox=c.rope_style == "neox",
                              pos_scale=rope_position_scale(c), eps=eps)

  def chain(stage):
    def fn(w, x, k, v):
      for i in [j % L for j in range(L * args.reps)] if stage not in ("head", "step", "empty") else []:
        if stage == "sink":
          x = fused.linear_residual(qkv0, sink, i, x)
        elif stage == "qkv":
          x = fused.linear_residual(fused.norm_linear(x, w.attn_norm, eps, w.wqkv, i, dtype=dtype), sink, i, x)
        elif stage in ("epilogue", "attention"):
          qkv = fused.norm_linear(x, w.attn_norm, eps, w.wqkv, i, dtype=dtype)
          q, k, v, cnt = epi(qkv, i, k, v)
          if stage == "attention":
            q = fused.decode_attention_merged(q, k, v, i, pos + 1, cnt)
          x = fused.linear_residual(q.reshape(1, c.q_dim), w.wo, i, x)
        elif stage == "o":
          x = fused.linear_residual(attn0, w.wo, i, x)
        elif stage == "gate_up":
          act = fused.norm_linear(x, w.ffn_norm, eps, w.w_gate_up, i, dtype=dtype, epilogue="swiglu")
          x = fused.linear_residual(act, w.w_down, i, x)
        elif stage == "down":
          x = fused.linear_residual(act0, w.w_down, i, x)
      if stage == "head":
        tok, _ = fused.norm_argmax(x, w.out_norm, eps, w.head, dtype=dtype)
        x = x + tok[:, None].astype(jnp.float32) * 0
      if stage == "step":   # (the head in its own call, as lab switch JAXLLM_LAYERS_HEAD=0: the stage chains x)
        active = jnp.ones((1,), bool)
        x, kv = forward_decode_fused(c, w, dataclasses.replace(cache, k=k, v=v), jnp.zeros((1,), jnp.int32),
                                     pos, active)
        tok, _ = fused.norm_argmax(x, w.out_norm, eps, w.head, dtype=dtype)
        k, v = kv.k, kv.v
        x = x + tok[:, None].astype(jnp.float32) * 0
      return x, k, v
    return jax.jit(fn, donate_argnums=(2, 3))

  def timed(stage):
    f = chain(stage)
    x, k, v = x0, jnp.copy(cache.k), jnp.copy(cache.v)
    for _ in range(3):
      x, k, v = f(w, x0, k, v)
    jax.block_until_ready((x, k, v))
    best = []
    for _ in range(3):
      t0 = time.perf_counter()
      for _ in range(args.calls):
        x, k, v = f(w, x0, k, v)
      jax.block_until_ready((x, k, v))
      best.append((time.perf_counter() - t0) / args.calls * 1e3)
    return min(best)   # ms per program

  stages = ["empty", "sink", "o", "qkv", "epilogue", "attention", "down", "gate_up", "head", "step"]
  ms = {s: timed(s) for s in stages}
  n = L * args.reps
  us = lambda a: ms[a] * 1e3 / n   # per call: programs this long are device-bound (dispatch overlaps)
  per_layer = {
      "o": us("o"),
      "qkv": us("qkv") - us("sink"),
      "epilogue": us("epilogue") - us("qkv") + us("sink") - us("o"),
      "attention": us("attention") - us("epilogue"),
      "down": us("down"),
      "gate_up": us("gate_up") - us("down"),
  }
  head_us = (ms["head"] - ms["empty"]) * 1e3
  out = {"model": args.model, "length": args.length, "program_ms": ms, "per_layer_us": per_layer,
         "layer_us": sum(per_layer.values()), "head_us": head_us,
         "stages_sum_ms": (sum(per_layer.values()) * L + head_us) / 1e3, "step_ms": ms["step"],
         "env": environment()}
  print("| stage | us per layer | us per step |\n|---|---|---|")
  for k_, v_ in per_layer.items():
    print(f"| {k_} | {v_:.2f} | {v_ * L:.1f} |")
  print(f"| head (norm + LM head + argmax) | | {head_us:.1f} |")
  print(f"| sum of stages | {out['layer_us']:.2f} | {out['stages_sum_ms'] * 1e3:.1f} |")
  print(f"| whole step (program) | | {ms['step'] * 1e3:.1f} (empty program {ms['empty'] * 1e3:.1f}) |")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
