"""Building the Weights pytree: from a GGUF file (dequantize, fuse, re-quantize) or at random.

Matrices are fused where the model multiplies the same input by several of them (q/k/v, gate/up) and
stacked over layers, then quantized per output channel (jaxllm.quant). `quant="none"` keeps them float
for reference runs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxllm.config import Config
from jaxllm.gguf import GGUFFile
from jaxllm.model import Weights
from jaxllm.quant import GROUP, Linear, quantize_int8

QUANT_CHOICES = ("w8a16", "none")


def _check_quant(quant: str) -> None:
  if quant not in QUANT_CHOICES:
    raise ValueError(f"quant must be one of {QUANT_CHOICES}, got {quant!r}")


def _linear(w: np.ndarray, quant: str, dtype) -> Linear:
  """w [..., N, K] float32 -> device Linear (int8 + scale, or float in dtype)."""
  if quant == "none":
    return Linear(w=jnp.asarray(w, dtype))
  q, scale = quantize_int8(w)
  return Linear(w=jnp.asarray(q), scale=jnp.asarray(scale))


def load_weights(gf: GGUFFile, quant: str = "w8a16", dtype=jnp.float32, progress: bool = True) -> Weights:
  """Reads, fuses and quantizes the model's weights.

  Args:
    gf: an open GGUF file.
    quant: "w8a16" (int8 weights, per-channel scales) or "none" (float weights in `dtype`).
    dtype: activation dtype; float weights are stored in it.
    progress: show a progress bar over the layers.
  """
  _check_quant(quant)
  c = gf.config
  per_layer: dict[str, list[np.ndarray]] = {k: [] for k in (
      "attn_norm", "wqkv", "bqkv", "wo", "ffn_norm", "w_gate_up", "w_down", "q_norm", "k_norm")}
  for i in tqdm(range(c.n_layers), desc=f"load+quantize {c.arch}", unit="layer", disable=not progress,
                leave=False):
    def t(name, i=i):
      return gf.tensor(f"blk.{i}.{name}")
    per_layer["attn_norm"].append(t("attn_norm.weight"))
    per_layer["wqkv"].append(np.concatenate([t("attn_q.weight"), t("attn_k.weight"), t("attn_v.weight")]))
    if c.qkv_bias:
      per_layer["bqkv"].append(np.concatenate([t("attn_q.bias"), t("attn_k.bias"), t("attn_v.bias")]))
    if c.qk_norm:
      per_layer["q_norm"].append(t("attn_q_norm.weight"))
      per_layer["k_norm"].append(t("attn_k_norm.weight"))
    per_layer["wo"].append(t("attn_output.weight"))
    per_layer["ffn_norm"].append(t("ffn_norm.weight"))
    per_layer["w_gate_up"].append(np.concatenate([t("ffn_gate.weight"), t("ffn_up.weight")]))
    per_layer["w_down"].append(t("ffn_down.weight"))
  stacked = {k: np.stack(v) for k, v in per_layer.items() if v}
  embed = _linear(gf.tensor("token_embd.weight"), quant, dtype)
  head = embed if c.tied_embeddings else _linear(gf.tensor("output.weight"), quant, dtype)

  def vector(name):
    return jnp.asarray(stacked[name], jnp.float32) if name in stacked else None
  return Weights(
      embed=embed,
      attn_norm=vector("attn_norm"),
      wqkv=_linear(stacked["wqkv"], quant, dtype),
      wo=_linear(stacked["wo"], quant, dtype),
      ffn_norm=vector("ffn_norm"),
      w_gate_up=_linear(stacked["w_gate_up"], quant, dtype),
      w_down=_linear(stacked["w_down"], quant, dtype),
      out_norm=jnp.asarray(gf.tensor("output_norm.weight"), jnp.float32),
      head=head,
      bqkv=vector("bqkv"),
      q_norm=vector("q_norm"),
      k_norm=vector("k_norm"),
      rope_freqs=jnp.asarray(gf.tensor("rope_freqs.weight")) if "rope_freqs.weight" in gf else None,
  )


def random_weights(config: Config, seed: int = 0, quant: str = "w8a16", dtype=jnp.bfloat16) -> Weights:
  """Random weights of the model's real shapes, made on the device (for benchmarks: same cost to run).

  Float weights are N(0, 0.02) like a freshly initialized model; norms are 1.
  """
  _check_quant(quant)
  c = config
  keys = iter(jax.random.split(jax.random.PRNGKey(seed), 16))

  def lin(*shape):
    if quant == "none":
      return Linear(w=(0.02 * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype))
    q = jax.random.randint(next(keys), shape, -127, 128, jnp.int32).astype(jnp.int8)
    groups = (*shape[:-1], shape[-1] // GROUP)
    return Linear(w=q, scale=jnp.full(groups, 0.02 / 73.0, jnp.float32))  # std of U(-127,127) ~ 73

  L, qkv = c.n_layers, c.q_dim + 2 * c.kv_dim
  embed = lin(c.vocab_size, c.d_model)
  return Weights(
      embed=embed,
      attn_norm=jnp.ones((L, c.d_model), jnp.float32),
      wqkv=lin(L, qkv, c.d_model),
      wo=lin(L, c.d_model, c.q_dim),
      ffn_norm=jnp.ones((L, c.d_model), jnp.float32),
      w_gate_up=lin(L, 2 * c.d_ff, c.d_model),
      w_down=lin(L, c.d_model, c.d_ff),
      out_norm=jnp.ones((c.d_model,), jnp.float32),
      head=embed if c.tied_embeddings else lin(c.vocab_size, c.d_model),
      bqkv=0.02 * jax.random.normal(next(keys), (L, qkv), jnp.float32) if c.qkv_bias else None,
      q_norm=jnp.ones((L, c.head_dim), jnp.float32) if c.qk_norm else None,
      k_norm=jnp.ones((L, c.head_dim), jnp.float32) if c.qk_norm else None,
  )
