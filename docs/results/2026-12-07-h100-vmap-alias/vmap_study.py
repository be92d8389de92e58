"""Why jax.vmap over the GPU's fused ops gives other values than each state alone (tests/test_fused.py's vmap test).

  python docs/results/2026-12-07-h100-vmap-alias/vmap_study.py CASE            one case in this process (env decides flags), prints one JSON line
  python docs/results/2026-12-07-h100-vmap-alias/vmap_study.py all OUTDIR      every case x variant in child processes, JSON lines to stdout

Cases: step (the test: batch-1 fused step, per-op calls, JAXLLM_LAYERS_CALL=0, a lab build), batched (a
batch-2 step, kernels="ffi", mapped random caches: the release path), and single ops mapped alone: qkv,
attn, norm_linear, residual. Variants: default, graphs off, dynamic-slice fusion off, sequential_unrolled.
"""
import json
import os
import subprocess
import sys
import time

VARIANTS = {
  "default": {},
  "graphs_off": {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="},
  "dsf_off": {"XLA_FLAGS": "--xla_gpu_enable_dynamic_slice_fusion=false"},
  "both_off": {"XLA_FLAGS": "--xla_gpu_enable_command_buffer= --xla_gpu_enable_dynamic_slice_fusion=false"},
  "unrolled": {"STUDY_UNROLLED": "1"},
}


def run_case(case):
  os.environ["JAXLLM_LAYERS_CALL"] = "0"
  import jax
  if os.environ.get("STUDY_UNROLLED"):
    orig = jax.ffi.ffi_call
    def patched(*a, **kw):
      if kw.get("vmap_method") == "sequential":
        kw["vmap_method"] = "sequential_unrolled"
      return orig(*a, **kw)
    jax.ffi.ffi_call = patched
  import dataclasses
  import jax.numpy as jnp
  import numpy as np
  sys.path.insert(0, "tests")
  import test_fused as T
  from jaxllm import lab
  from jaxllm.kernels import fused
  if case == "step" and jax.default_backend() == "gpu" and not lab.lab_build():
    return {"case": case, "lab": False, "skipped": "the per-op step needs a lab build"}
  config, weights = T._synthetic("qwen2.5-0.5b")
  rng = np.random.default_rng(6)
  S = 3

  def compare(mapped_fn, alone_fn, args, in_axes):
    mapped = jax.jit(jax.vmap(mapped_fn, in_axes=in_axes))(*args)
    alone = jax.jit(alone_fn)
    res = []
    for i in range(S):
      each = [a if ax is None else a[i] for a, ax in zip(args, in_axes)]
      want = alone(*each)
      for j, (g, w) in enumerate(zip(mapped, want)):
        g = np.asarray(g[i], np.float32); w = np.asarray(w, np.float32)
        bad = int((g != w).sum())
        res.append({"state": i, "out": j, "bad": bad, "n": int(g.size),
                    "maxdiff": float(np.nanmax(np.abs(g - w))) if bad else 0.0,
                    "rel": float(np.nanmax(np.abs(g - w)) / max(np.nanmax(np.abs(w)), 1e-30)) if bad else 0.0})
    return res

  if case == "step":
    from jaxllm.model import forward_decode_fused_head
    base = T._cache(config, 1, 64)
    k0 = jnp.asarray(rng.standard_normal((S,) + base.k.shape), base.k.dtype)
    v0 = jnp.asarray(rng.standard_normal((S,) + base.v.shape), base.v.dtype)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (S, 1)), jnp.int32)
    pos = jnp.asarray([[40], [7], [0]], jnp.int32)
    active = jnp.ones((S, 1), bool)
    def step(w, k, v, t, p, a):
      out, cache = forward_decode_fused_head(config, w, dataclasses.replace(base, k=k, v=v), t, p, a, greedy=False)
      return out, cache.k, cache.v
    res = compare(step, step, (weights, k0, v0, tokens, pos, active), (None, 0, 0, 0, 0, 0))
  elif case == "batched":
    from jaxllm.model import forward
    base = T._cache(config, 2, 64)
    k0 = jnp.asarray(rng.standard_normal((S,) + base.k.shape), base.k.dtype)
    v0 = jnp.asarray(rng.standard_normal((S,) + base.v.shape), base.v.dtype)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (S, 2, 1)), jnp.int32)
    pos = jnp.asarray([[40, 3], [7, 20], [0, 50]], jnp.int32)
    def step(w, k, v, t, p):
      h, cache = forward(config, w, dataclasses.replace(base, k=k, v=v), t, p, kernels="ffi", layers="unrolled")
      return h, cache.k, cache.v
    res = compare(step, step, (weights, k0, v0, tokens, pos), (None, 0, 0, 0, 0))
  elif case in ("qkv", "attn"):
    base = T._cache(config, 1, 64)
    L, B, G, smax, dh = base.k.shape
    H = config.n_heads
    k0 = jnp.asarray(rng.standard_normal((S,) + base.k.shape), base.k.dtype)
    v0 = jnp.asarray(rng.standard_normal((S,) + base.v.shape), base.v.dtype)
    pos = jnp.asarray([[40], [7], [0]], jnp.int32)
    if case == "qkv":
      n = (H + 2 * G) * dh
      qkv = jnp.asarray(rng.standard_normal((S, 1, n)), base.k.dtype)
      bias = jnp.asarray(rng.standard_normal((L, n)), jnp.float32)
      inv = jnp.asarray(1.0 / (10000 ** (np.arange(0, dh, 2) / dh)), jnp.float32)
      def op(qkv, k, v, p):
        q, k, v, c = fused.qkv_epilogue(qkv, bias, None, None, inv, 1, p, p, k, v, n_heads=H, n_kv_heads=G,
                                        neox=True, pos_scale=1.0, eps=1e-6)
        return q, k, v, c
      res = compare(op, op, (qkv, k0, v0, pos), (0, 0, 0, 0))
    else:
      q = jnp.asarray(rng.standard_normal((S, 1, H, dh)), base.k.dtype)
      counters = jnp.zeros((S, 1, G), jnp.int32)
      def op(q, k, v, p, c):
        out, c = fused.decode_attention_merged(q, k, v, 1, p + 1, c, with_counters=True)
        return out, c
      res = compare(op, op, (q, k0, v0, pos, counters), (0, 0, 0, 0, 0))
  elif case == "norm_linear":
    d = config.d_model
    x = jnp.asarray(rng.standard_normal((S, 1, d)), jnp.float32)
    def op(x):
      return (fused.norm_linear(x, weights.attn_norm, 1e-6, weights.wqkv, 1, dtype=jnp.bfloat16),)
    res = compare(op, op, (x,), (0,))
  elif case == "residual":
    d = config.d_model
    a = jnp.asarray(rng.standard_normal((S, 1, d)), jnp.bfloat16)
    r = jnp.asarray(rng.standard_normal((S, 1, d)), jnp.float32)
    def op(a, r):
      return (fused.linear_residual(a, weights.wo, 1, r),)
    res = compare(op, op, (a, r), (0, 0))
  bad = sum(r["bad"] for r in res)
  return {"case": case, "lab": lab.lab_build(), "layers_call": str(fused.layers_call()), "bad": bad, "maxrel": max(r["rel"] for r in res),
          "worst": max(res, key=lambda r: r["bad"]), "per": [(r["state"], r["out"], r["bad"]) for r in res]}


if __name__ == "__main__":
  if sys.argv[1] != "all":
    print(json.dumps(run_case(sys.argv[1])), flush=True)
    sys.exit(0)
  out = sys.argv[2]
  os.makedirs(out, exist_ok=True)
  from jaxllm import lab
  VARIANTS["copy_off"] = {"JAXLLM_ALIAS_COPY": "0"}
  if lab.lab_build():   # the per-op step, and each aliased op with the handlers' copy off and on
    plan = [("step", v) for v in ("default", "copy_off", "graphs_off", "dsf_off", "unrolled")]
    plan += [(c, v) for c in ("qkv", "attn", "batched") for v in ("default", "copy_off")]
  else:
    plan = [("batched", v) for v in ("default", "graphs_off", "dsf_off", "unrolled")]
    plan += [(c, v) for c in ("qkv", "attn", "norm_linear", "residual") for v in ("default", "graphs_off", "dsf_off")]
  for case, name in plan:
    env = VARIANTS[name]
    t0 = time.time()
    e = dict(os.environ, **env)
    if name == "default" and case in ("step", "qkv"):
      e["XLA_FLAGS"] = f"--xla_dump_to={out}/dump_{case} --xla_dump_hlo_as_text"
    p = subprocess.run([sys.executable, __file__, case], env=e, capture_output=True, text=True, timeout=240)
    line = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    try:
      rec = json.loads(line)
    except ValueError:
      rec = {"case": case, "error": (p.stderr or "")[-1500:]}
    rec.update(variant=name, seconds=round(time.time() - t0, 1), rc=p.returncode)
    print(json.dumps(rec), flush=True)
