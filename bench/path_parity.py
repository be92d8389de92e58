"""FFI path vs XLA path: greedy tokens, first divergence, and the decode logits' relative error.

  python bench/path_parity.py [--model synthetic:qwen2.5-0.5b] [--new 128] [--json out.json]

1. Greedy generation with each kernel path (Engine, graphs on) from the same random prompt.
2. Teacher forcing: the XLA path's tokens are fed one decode step at a time through both paths, and at
   every step the two logit vectors are compared (relative L2 error, top-1 agreement, and the XLA
   path's top-2 margin where they disagree), so a divergence can be told apart from a bug.
3. Where the FFI path decodes through the fused step (the GPU), the same forced tokens through that step
   (its logits head rather than its argmax) against the XLA path's rows ("fused_decode").
"""
from __future__ import annotations

import argparse
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.bench import environment, load_model
from jaxllm.cache import create_cache
from jaxllm.decode import sequence_logits
from jaxllm.engine import Engine
from jaxllm.kernels import resolve_kernels
from jaxllm.model import use_fused


def forced_logits(config, weights, tokens: list[int], prompt_len: int, kernels: str, dtype, step=None) -> np.ndarray:
  """f32 logits [len(tokens) - prompt_len + 1, V]: after the prompt, then after each forced token, each
  through sequence_logits on `kernels`, or (step) the tokens after the prompt through
  step(weights, cache, token [1], pos [1]) -> (logits [1, V], cache)."""
  prefill = jax.jit(functools.partial(sequence_logits, config, kernels=kernels), donate_argnums=(1,))
  run = jax.jit(step, donate_argnums=(1,)) if step else None
  cache = create_cache(config, 1, len(tokens) + 1, dtype)
  out, cache = prefill(weights, cache, jnp.asarray([tokens[:prompt_len]], jnp.int32), jnp.zeros((1,), jnp.int32))
  rows = [np.asarray(out[0, -1], np.float32)]
  for pos in range(prompt_len, len(tokens)):
    if run is None:
      out, cache = prefill(weights, cache, jnp.asarray([[tokens[pos]]], jnp.int32), jnp.full((1,), pos, jnp.int32))
      rows.append(np.asarray(out[0, 0], np.float32))
    else:
      out, cache = run(weights, cache, jnp.asarray([tokens[pos]], jnp.int32), jnp.full((1,), pos, jnp.int32))
      rows.append(np.asarray(out[0], np.float32))
  return np.stack(rows)


def forced_decode_logits(config, weights, tokens: list[int], prompt_len: int, dtype) -> np.ndarray:
  """The rows of forced_logits through the fused decode step instead (model.forward_decode_fused, then the
  LM head with the final norm, as logits): the prompt's row from the FFI prefill, then one per token."""
  from jaxllm.kernels import fused
  from jaxllm.model import forward_decode_fused

  def step(weights, cache, token, pos):
    x, cache = forward_decode_fused(config, weights, cache, token, pos, jnp.ones((1,), bool))
    out = fused.norm_linear(x, weights.out_norm, config.rms_eps, weights.head, dtype=cache.compute_dtype)
    return out.astype(jnp.float32), cache
  return forced_logits(config, weights, tokens, prompt_len, "ffi", dtype, step=step)


def compare(lf: np.ndarray, lx: np.ndarray) -> dict:
  """Relative L2 error of each row of lf against lx, top-1 agreement, the disagreements' XLA top-2 margins."""
  rel = np.linalg.norm(lf - lx, axis=-1) / np.linalg.norm(lx, axis=-1)
  top_f, top_x = lf.argmax(-1), lx.argmax(-1)
  srt = np.sort(lx, axis=-1)
  margin = srt[:, -1] - srt[:, -2]
  disagree = np.nonzero(top_f != top_x)[0]
  return {"forced_steps": int(len(rel)), "logits_rel_err_mean": float(rel.mean()),
          "logits_rel_err_max": float(rel.max()), "top1_agreement": float((top_f == top_x).mean()),
          "disagreements": [{"step": int(i), "xla_top2_margin": float(margin[i]), "rel_err": float(rel[i])}
                            for i in disagree],
          "min_xla_top2_margin": float(margin.min())}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="synthetic:qwen2.5-0.5b")
  p.add_argument("--prompt-len", type=int, default=32)
  p.add_argument("--new", type=int, default=128)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json", help="write the result here")
  args = p.parse_args(argv)
  if resolve_kernels("auto") != "ffi":
    raise SystemExit("the FFI kernels are not available here: nothing to compare")
  config, weights, tok, _ = load_model(args.model, "w8a16", args.seed)
  rng = np.random.default_rng(args.seed)
  prompt = [int(t) for t in rng.integers(0, config.vocab_size, args.prompt_len)]
  ids = {}
  for kernels in ("ffi", "xla"):
    engine = Engine(config, weights, tok, max_context=args.prompt_len + args.new + 8, kernels=kernels)
    ids[kernels] = engine.generate(prompt, args.new, ignore_eos=True).ids
    dtype = engine.dtype
  first = next((i for i, (a, b) in enumerate(zip(ids["ffi"], ids["xla"])) if a != b), None)
  tokens = prompt + ids["xla"][:-1]
  lf = forced_logits(config, weights, tokens, args.prompt_len, "ffi", dtype)
  lx = forced_logits(config, weights, tokens, args.prompt_len, "xla", dtype)
  result = {"model": args.model, "seed": args.seed, "prompt_len": args.prompt_len, "new_tokens": args.new,
            "dtype": str(np.dtype(dtype)), "tokens_identical": ids["ffi"] == ids["xla"],
            "first_divergence": first, "ffi_ids": ids["ffi"], "xla_ids": ids["xla"], **compare(lf, lx),
            "env": environment()}
  cache = create_cache(config, 1, 8, dtype)
  if use_fused(config, weights, cache, 1, "ffi"):   # the decode step the FFI path runs: the fused one
    result["fused_decode"] = compare(forced_decode_logits(config, weights, tokens, args.prompt_len, dtype), lx)
  summary = {k: v for k, v in result.items() if k not in ("ffi_ids", "xla_ids", "env")}
  print(json.dumps(summary, indent=1))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
