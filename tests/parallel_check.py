"""Tensor parallel against one device, run in a process of its own with 4 simulated CPU devices (XLA_FLAGS must
be set before jax starts, so tests/test_parallel.py runs this as a script). Prints one JSON line per case.

  XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/parallel_check.py
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import model, parallel
from jaxllm.cache import create_cache
from jaxllm.presets import PRESETS
from jaxllm.weights import random_weights

# Small models of each family's features: qwen2 (QKV bias), qwen3 (q/k norms), llama (llama3 RoPE factors,
# tied embeddings); 8 query heads over 2 or 4 KV heads, so N = 4 covers both G >= N and G < N (replicated).
SHAPE = dict(n_layers=2, d_model=256, n_heads=8, head_dim=64, d_ff=512, vocab_size=512)
FAMILIES = {
    "qwen2": PRESETS["qwen2.5-0.5b"].replace(n_kv_heads=2, **SHAPE),
    "qwen3": PRESETS["qwen3-0.6b"].replace(n_kv_heads=4, **SHAPE),
    "llama": PRESETS["llama-3.2-1b"].replace(n_kv_heads=2, tied_embeddings=True, **SHAPE),
}


def _kv_by_head(tp, cache_k: np.ndarray) -> np.ndarray:
  """A sharded cache's keys [L, B, N * G_local, S, Dh] as the model's heads [L, B, G, S, Dh] (the first copy
  of a replicated head)."""
  out = {}
  g_local = tp.local.n_kv_heads
  for s in range(tp.n):
    for j, head in enumerate(parallel.kv_heads_of(tp, s)):
      out.setdefault(head, cache_k[:, :, s * g_local + j])
  return np.stack([out[h] for h in range(tp.config.n_kv_heads)], axis=2)


def check(name: str, kernels: str, quant: str) -> list[dict]:
  config = FAMILIES[name]
  weights = random_weights(config, seed=1, quant=quant, dtype=jnp.float32)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (3, 6)), jnp.int32)
  start = jnp.asarray([0, 4, 9], jnp.int32)
  valid = jnp.asarray(rng.random((3, 6)) < 0.8)
  cache = create_cache(config, 3, 32, jnp.float32)
  cache = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype) if a.ndim == 5 else a, cache)

  def run(w, c):
    hidden, c = model.forward(config, w, c, tokens, start, valid, kernels=kernels)
    return hidden, model.logits(w, hidden, jnp.float32, kernels=kernels), c

  hidden0, logits0, cache0 = jax.jit(run)(weights, cache)
  out = []
  for n in (1, 2, 4):
    tp = parallel.plan(config, parallel.make_mesh(n))
    sharded = parallel.shard_weights(weights, tp)
    # The same cache contents, each shard holding its heads (copies of a replicated one).
    heads = [h for s in range(n) for h in parallel.kv_heads_of(tp, s)]
    c = create_cache(parallel.cache_config(tp), 3, 32, jnp.float32)
    c = jax.tree.map(lambda a, a0: a0[:, :, heads] if a.ndim == 5 else a, c, cache)
    hidden, logits, c = jax.jit(run)(sharded, parallel.shard_cache(c, tp))
    ok_shards = len(sharded.wqkv.w.sharding.device_set) == n and len(c.k.sharding.device_set) == n
    ok_shards &= parallel.shard_weights(sharded, tp) is sharded        # laid out already: not reordered again
    out.append({"family": name, "kernels": kernels, "quant": quant, "n": n, "sharded": ok_shards,
                "hidden": float(np.abs(np.asarray(hidden) - np.asarray(hidden0)).max()),
                "logits": float(np.abs(np.asarray(logits) - np.asarray(logits0)).max()),
                "logits_scale": float(np.abs(np.asarray(logits0)).max()),
                "k": float(np.abs(_kv_by_head(tp, np.asarray(c.k)) - np.asarray(cache0.k)).max()),
                "v": float(np.abs(_kv_by_head(tp, np.asarray(c.v)) - np.asarray(cache0.v)).max()),
                "argmax_same": bool((np.argmax(logits, -1) == np.argmax(logits0, -1)).all())})
  return out


def engine_tokens() -> list[dict]:
  """Greedy and penalized tokens of an Engine on N = 1, 2, 4: a batch of two prompts of different lengths,
  the longer over two prefill chunks, and that prompt alone."""
  from jaxllm import Engine, SamplingParams
  config = FAMILIES["qwen2"]
  weights = random_weights(config, seed=2, dtype=jnp.float32)
  prompts = [[1, 5, 9, 3, 4, 8, 2, 7, 11, 13] * 3, [7, 2]]
  out = []
  for kernels, ns in (("ffi", (1, 2, 4)), ("xla", (1, 4))):
    for n in ns:
      engine = Engine(config, weights, None, max_context=64, kernels=kernels, prefill_chunk=16,
                      mesh=None if n == 1 else parallel.make_mesh(n))
      out.append({"kernels": kernels, "n": n, "on": len(engine.weights.wqkv.w.sharding.device_set),
                  "batch": [r.ids for r in engine.generate_batch(prompts, 12, SamplingParams(), ignore_eos=True)],
                  "alone": engine.generate(prompts[0], 12, ignore_eos=True).ids,
                  "penalized": [r.ids for r in engine.generate_batch(prompts, 12, SamplingParams(repeat_penalty=1.3),
                                                                    ignore_eos=True)]})
  return out


def greedy_heads() -> list[dict]:
  """TensorParallel.greedy (each shard's argmax, reduced) against the argmax of the gathered logits on N = 2, 4,
  W8A16 and float heads: rows of random hidden states (their tokens in shards past the first), a zero row (every
  logit 0: the tie goes to id 0, as jnp.argmax's first maximum) and a NaN row (not finite); and float heads whose
  first or last row is inf, so that only the first or the last shard's logits are not finite (every row then is
  not)."""
  config = FAMILIES["qwen2"]
  out = []
  for quant in ("w8a16", "none", "none-inf-first", "none-inf-last"):
    weights = random_weights(config, seed=4, quant=quant.split("-")[0], dtype=jnp.float32)
    if "-inf-" in quant:
      head = dataclasses.replace(weights.head, w=weights.head.w.at[0 if quant.endswith("first") else -1].set(jnp.inf))
      weights = dataclasses.replace(weights, head=head)
    rng = np.random.default_rng(1)
    hidden = rng.standard_normal((5, config.d_model)).astype(np.float32)
    hidden[2] = 0.0
    hidden[4] = np.nan
    for n in (2, 4):
      tp = parallel.plan(config, parallel.make_mesh(n))
      sharded = parallel.shard_weights(weights, tp)
      logits = np.asarray(jax.jit(lambda w, h: tp.logits(w, h, jnp.float32))(sharded, hidden))
      tokens, finite = jax.jit(lambda w, h: tp.greedy(w, h, jnp.float32))(sharded, hidden)
      want = np.argmax(np.where(np.isnan(logits), -np.inf, logits), -1)
      out.append({"quant": quant, "n": n, "tokens": np.asarray(tokens).tolist(), "want": want.tolist(),
                  "finite": np.asarray(finite).tolist(), "want_finite": np.isfinite(logits).all(-1).tolist(),
                  "shards": sorted({int(want[i]) * n // config.vocab_size for i in (0, 1, 3)})})
  return out


def greedy_step_gathers() -> dict:
  """The all-gathers in the lowered decode step on 2 devices (their result shapes): the greedy step without
  penalties (TensorParallel.greedy: [2, B] values) and the sampled one (the logits [B, V])."""
  from jaxllm.decode import DecodeState, decode_step, eog_table
  from jaxllm.sampling import Sampler, SamplingParams
  config = FAMILIES["qwen2"]
  tp = parallel.plan(config, parallel.make_mesh(2))
  weights = parallel.shard_weights(random_weights(config, seed=2, dtype=jnp.float32), tp)
  cache = parallel.shard_cache(create_cache(parallel.cache_config(tp), 3, 32, jnp.float32), tp)
  state = DecodeState(cache=cache, tokens=np.zeros(3, np.int32), pos=np.zeros(3, np.int32), done=np.zeros(3, bool),
                      limit=np.full(3, 31, np.int32), eog=eog_table((), 3), sampler=Sampler.create(SamplingParams(), 3))
  out = {}
  for name, flags in (("argmax", dict(greedy_only=True, penalties=False)), ("sampled", {})):
    text = jax.jit(lambda w, s: decode_step(config, w, s, **flags)).lower(weights, state).as_text()
    out[name] = sorted({line.split("->")[-1].strip() for line in text.splitlines() if "all_gather" in line})
  return out


def admitted() -> list[dict]:
  """The server's admission on N = 1, 2 (FFI path, f32): two prompts' first tokens admitted in one call
  (serve.rows.admit_rows: rows gathered and scattered on the mesh) and each admitted alone."""
  from jaxllm import Engine, SamplingParams
  from jaxllm.serve.slots import SlotPrograms
  config = FAMILIES["qwen2"]
  weights = random_weights(config, seed=2, dtype=jnp.float32)
  prompts = [[1, 5, 9, 3, 4, 8, 2, 7, 11, 13], [7, 2, 30, 41]]
  out = []
  for n in (1, 2):
    engine = Engine(config, weights, None, max_context=64, prefill_chunk=32,
                    mesh=None if n == 1 else parallel.make_mesh(n))
    rec, states = {"n": n}, {}
    for name, group, sets in (("together", 2, [(0, 1)]), ("alone", 1, [(0,), (1,)])):
      slots = SlotPrograms(engine, 4, admit_group=group)
      tokens, calls = [], []
      for rows in sets:
        jobs = [slots.plan(3 - i, prompts[i], 0, SamplingParams(), 0, 63, ()) for i in rows]
        groups = slots.groups(jobs)
        calls += [len(g) for g in groups]
        tokens += [int(t) for first in slots.admit(groups) for t in np.asarray(first)]
      rec[name], rec[name + "_calls"] = tokens, calls
      rec["on"] = len(slots.state.cache.k.sharding.device_set)
      states[name] = jax.device_get(slots.state)
    # The whole states, every row: the admitted rows' caches written in their own rows, the others untouched.
    a, b = states["together"], states["alone"]
    rec["cache_diff"] = float(max(np.abs(a.cache.k - b.cache.k).max(), np.abs(a.cache.v - b.cache.v).max()))
    rec["cache_scale"] = float(np.abs(b.cache.k).max())
    rec["pos"] = [a.pos.tolist(), b.pos.tolist()]
    out.append(rec)
  return out


def errors() -> list[str]:
  """The messages for models that do not split."""
  msgs = []
  mesh = parallel.make_mesh(4)
  for bad in (FAMILIES["qwen2"].replace(n_heads=6, n_kv_heads=3), FAMILIES["qwen2"].replace(vocab_size=510)):
    try:
      parallel.plan(bad, mesh)
      msgs.append("no error")
    except ValueError as e:
      msgs.append(str(e))
  try:
    parallel.make_mesh(8)
  except ValueError as e:
    msgs.append(str(e))
  return msgs


def main() -> int:
  if len(jax.devices()) < 4:
    print(f"needs 4 devices (XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}), got {len(jax.devices())}", file=sys.stderr)
    return 2
  cases = [(name, "ffi", "w8a16") for name in FAMILIES] + [("qwen2", "xla", "w8a16"), ("qwen3", "xla", "none")]
  for name, kernels, quant in cases:
    for rec in check(name, kernels, quant):
      print(json.dumps(rec), flush=True)
  for rec in engine_tokens():
    print(json.dumps({"engine": rec}), flush=True)
  for rec in greedy_heads():
    print(json.dumps({"greedy": rec}), flush=True)
  print(json.dumps({"gathers": greedy_step_gathers()}), flush=True)
  for rec in admitted():
    print(json.dumps({"admit": rec}), flush=True)
  print(json.dumps({"errors": errors()}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
