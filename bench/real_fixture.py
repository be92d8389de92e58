"""The GPU kernels on real weights and real activations: a fixture made on the CPU, checked on the GPU.

  python bench/real_fixture.py make real.npz            # CPU: real layers + the activations reaching them
  python bench/real_fixture.py check real.npz --json r.json   # GPU: kernels vs a float64 reference

`make` loads SmolLM2-135M and Qwen2.5-Coder-0.5B (the demo GGUFs), runs a real prompt through the float
model on the CPU and keeps, for a few layers, each matmul's W8A16 weight (as the engine quantizes it) with
the activations that reach it at four positions (real outliers included), the layer's queries and KV
cache for decode and prefill attention, and SmolLM2's LM head (its first 32768 rows, past the size at
which the kernel switches to its LM-head configuration), small enough to carry to the GPU machine.
`check` runs, on bf16 activations as the GPU path does, jaxllm's CUDA kernels (W8A16 matmul at M = 1 and 4,
decode attention, flash prefill attention) and the XLA bf16 path on the same data, and reports each one's
error against float64 numpy on the same bf16-rounded inputs.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

MODELS = {"smollm2-135m": (0, 29), "qwen2.5-coder-0.5b": (23,)}
PROMPT = ("The history of computing is a story of abstraction. Early machines were programmed by rewiring "
          "panels; later, stored programs let the same hardware run many tasks. def softmax(x):\n    m = max(x)\n"
          "    e = [math.exp(v - m) for v in x]\n    return [v / sum(e) for v in e]\n人工智能的发展离不开硬件的进步。"
          "Rivers shape the land they cross, and the first cities grew along them. ") * 2
HEAD_ROWS = 32768
POSITIONS = 4


def make(path: str) -> None:
  import jax
  import jax.numpy as jnp
  import jaxllm
  from jaxllm.kernels import linear_reference, prefill_attention_reference
  from jaxllm.model import embed
  from jaxllm.norm import rms_norm
  from jaxllm.rope import apply_rope, rope_angles
  out = {}
  for name, layers in MODELS.items():
    config, wf, tok = jaxllm.load(name, quant="none", dtype=jnp.float32, progress=False)
    _, wq, _ = jaxllm.load(name, quant="w8a16", dtype=jnp.float32, progress=False)
    c = config
    ids = tok.encode(PROMPT)
    t = len(ids)
    rows = np.linspace(t // 4, t - 1, POSITIONS).astype(int)
    positions = jnp.arange(t)[None]
    angles = rope_angles(c, positions, wf.rope_freqs)
    x = embed(wf, jnp.asarray([ids]))
    for i in range(c.n_layers):
      h = rms_norm(x, wf.attn_norm[i], c.rms_eps)
      qkv = linear_reference(h, wf.wqkv, i)
      if wf.bqkv is not None:
        qkv = qkv + wf.bqkv[i]
      q, k, v = jnp.split(qkv, [c.q_dim, c.q_dim + c.kv_dim], axis=-1)
      q = q.reshape(1, t, c.n_heads, c.head_dim)
      k = k.reshape(1, t, c.n_kv_heads, c.head_dim)
      v = v.reshape(1, t, c.n_kv_heads, c.head_dim)
      if wf.q_norm is not None:
        q, k = rms_norm(q, wf.q_norm[i], c.rms_eps), rms_norm(k, wf.k_norm[i], c.rms_eps)
      q, k = apply_rope(q, angles, c.rope_style), apply_rope(k, angles, c.rope_style)
      kc = jnp.moveaxis(k, 1, 2)[None]                                         # [1, 1, G, T, Dh]
      vc = jnp.moveaxis(v, 1, 2)[None]
      attn = prefill_attention_reference(q, kc, vc, 0, jnp.zeros((1,), jnp.int32))
      o_in = attn.reshape(1, t, c.q_dim)
      x = x + linear_reference(o_in, wf.wo, i)
      h2 = rms_norm(x, wf.ffn_norm[i], c.rms_eps)
      gate, up = jnp.split(linear_reference(h2, wf.w_gate_up, i), 2, axis=-1)
      act = jax.nn.silu(gate) * up
      x = x + linear_reference(act, wf.w_down, i)
      if i in layers:
        p = f"{name}/L{i}/"
        for op, inp, lin in (("qkv", h, wq.wqkv), ("o", o_in, wq.wo), ("gate_up", h2, wq.w_gate_up),
                             ("down", act, wq.w_down)):
          out[p + op + "/x"] = np.asarray(inp[0, rows], np.float32)
          out[p + op + "/w"] = np.asarray(lin.w[i])
          out[p + op + "/scale"] = np.asarray(lin.scale[i])
        out[p + "attn/q"] = np.asarray(q[0], np.float32)                       # [T, H, Dh]
        out[p + "attn/k"] = np.asarray(kc[0, 0], np.float32)                   # [G, T, Dh]
        out[p + "attn/v"] = np.asarray(vc[0, 0], np.float32)
    if name == "smollm2-135m":
      hidden = rms_norm(x, wf.out_norm, c.rms_eps)
      out[name + "/head/x"] = np.asarray(hidden[0, rows], np.float32)
      out[name + "/head/w"] = np.asarray(wq.head.w[:HEAD_ROWS])
      out[name + "/head/scale"] = np.asarray(wq.head.scale[:HEAD_ROWS])
    print(f"{name}: {t} prompt tokens, layers {layers}", file=sys.stderr)
  np.savez(path, **out)
  print(f"wrote {path}: {sum(a.nbytes for a in out.values()) / 2**20:.1f} MiB", file=sys.stderr)


def _errors(got, ref) -> dict:
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  return {"max_rel": float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))),
          "rms_rel": float(np.sqrt(np.mean((got - ref) ** 2)) / np.sqrt(np.mean(ref ** 2)))}


def _softmax_attention(q, k, v, last):
  """float64 numpy: q [T, H, D], k/v [G, S, D], query t sees keys <= last[t] -> [T, H, D]."""
  t, h, d = q.shape
  g = k.shape[0]
  out = np.empty((t, h, d))
  for hh in range(h):
    kg, vg = k[hh // (h // g)], v[hh // (h // g)]
    s = q[:, hh] @ kg.T / np.sqrt(d)                                           # [T, S]
    s = np.where(np.arange(kg.shape[0])[None] <= np.asarray(last)[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    out[:, hh] = (p / p.sum(-1, keepdims=True)) @ vg
  return out


def check(path: str) -> dict:
  import jax
  import jax.numpy as jnp
  from jaxllm.kernels import ffi, linear_reference, prefill_attention_blocked
  from jaxllm.kernels.attention import decode_attention_reference
  from jaxllm.quant import Linear
  data = np.load(path)
  bf = jnp.bfloat16
  results = {"device": str(jax.devices()[0]), "ffi": ffi.unavailable_reason() or "ok", "ops": []}
  keys = sorted({k.rsplit("/", 1)[0] for k in data.files if k.endswith("/w")})
  for op in keys:
    x = jnp.asarray(data[op + "/x"], bf)                                       # [4, K], rounded as the GPU path
    lin = Linear(w=jnp.asarray(data[op + "/w"]), scale=jnp.asarray(data[op + "/scale"]))
    w64 = data[op + "/w"].astype(np.float64) * np.repeat(data[op + "/scale"].astype(np.float64), 64, axis=-1)
    ref = np.asarray(x, np.float64) @ w64.T
    for m in (1, POSITIONS):
      row = {"op": op, "m": m, "k": int(w64.shape[1]), "n": int(w64.shape[0]),
             "x_absmax_over_rms": float(np.max(np.abs(data[op + "/x"])) / np.sqrt(np.mean(data[op + "/x"] ** 2)))}
      row["ffi"] = _errors(jax.jit(lambda a: ffi.w8a16_matmul(a, lin))(x[:m]), ref[:m])
      row["xla_bf16"] = _errors(jax.jit(lambda a: linear_reference(a, lin))(x[:m]), ref[:m])
      results["ops"].append(row)
  for att in sorted({k.rsplit("/", 1)[0] for k in data.files if k.endswith("attn/q")}):
    q = jnp.asarray(data[att + "/q"], bf)                                      # [T, H, D]
    k = jnp.asarray(data[att + "/k"], bf)[None, None]                          # [1, 1, G, T, D]
    v = jnp.asarray(data[att + "/v"], bf)[None, None]
    t = q.shape[0]
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k[0, 0], v[0, 0]))
    dec_ref = _softmax_attention(q64[-1:], k64, v64, [t - 1])[0]
    dec_ffi = ffi.decode_attention(q[-1:], k, v, 0, jnp.asarray([t], jnp.int32))[0]
    dec_xla = decode_attention_reference(q[-1:], k, v, 0, jnp.asarray([t], jnp.int32))[0]
    results["ops"].append({"op": att, "kind": "decode attention", "length": int(t),
                           "ffi": _errors(dec_ffi, dec_ref), "xla_bf16": _errors(dec_xla, dec_ref)})
    pre_ref = _softmax_attention(q64, k64, v64, np.arange(t))
    st = jnp.zeros((1,), jnp.int32)
    row = {"op": att, "kind": "prefill attention", "length": int(t),
           "xla_bf16": _errors(prefill_attention_blocked(q[None], k, v, 0, st)[0], pre_ref)}
    if ffi.prefill_attention_supported(q.shape[-1], q.shape[1], k.shape[2], bf):
      row["ffi"] = _errors(ffi.prefill_attention(q[None], k, v, 0, st)[0], pre_ref)
    results["ops"].append(row)
  return results


def table(results: dict) -> str:
  lines = ["| op | M / length | FFI max / rms rel. err. | XLA bf16 max / rms rel. err. |", "|---|---|---|---|"]
  for r in results["ops"]:
    what = f"M={r['m']}" if "m" in r else f"{r['kind']}, {r['length']}"
    f = r.get("ffi")
    lines.append(f"| {r['op']} | {what} | " + (f"{f['max_rel']:.2e} / {f['rms_rel']:.2e}" if f else "n/a") +
                 f" | {r['xla_bf16']['max_rel']:.2e} / {r['xla_bf16']['rms_rel']:.2e} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("what", choices=("make", "check"))
  p.add_argument("path")
  p.add_argument("--json", help="check: write the results here")
  args = p.parse_args(argv)
  if args.what == "make":
    make(args.path)
    return 0
  results = check(args.path)
  print(table(results))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
