"""Tiny synthetic GGUF models for tests, written with gguf.GGUFWriter, and an independent numpy forward.

The numpy forward reads the file with gguf's own reader, keeps q/k/v and gate/up separate, runs full
causal attention in float64 without a cache: it shares no code with jaxllm's model.
"""
from __future__ import annotations

import gguf
import numpy as np

from jaxllm.tokenizer import _bytes_to_unicode

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

SHAPES = {  # d_model, n_heads, n_kv_heads, head_dim, d_ff, n_layers
    "llama": (64, 4, 2, 16, 128, 2),
    "qwen2": (64, 4, 2, 16, 128, 2),
    "qwen3": (64, 4, 2, 32, 128, 2),   # head_dim * heads != d_model, as in real Qwen3
}


def vocab() -> tuple[list[str], list[int]]:
  byte_chars = [_bytes_to_unicode()[b] for b in range(256)]
  tokens = byte_chars + ["".join(m) for m in MERGES] + SPECIALS
  types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)
  return tokens, types


def random_k_blocks(rng, n: int, k: int, kind: str, std: float) -> np.ndarray:
  """[n, k] weights of about this std as random Q4_K or Q6_K super-blocks (gguf-py cannot quantize to
  them): random values, scales and mins, laid out as ggml's block_q4_K / block_q6_K. k a multiple of 256."""
  s = n * (k // 256)
  if kind == "Q4_K":     # d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
    d = np.full((s, 1), std / (4.6 * 40), np.float16)            # a value's std: d * sc * std(U{0..15})
    dmin = np.full((s, 1), std * 7.5 / (4.6 * 32), np.float16)   # centres q * sc against the min
    body = [d.view(np.uint8), dmin.view(np.uint8), rng.integers(0, 256, (s, 12 + 128))]
  else:                  # 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d (f16)
    scales = rng.integers(16, 64, (s, 16)) * rng.choice([-1, 1], (s, 16))
    d = np.full((s, 1), std / (18.5 * 40), np.float16)           # std(U{0..63}) ~ 18.5
    body = [rng.integers(0, 256, (s, 192)), scales.astype(np.int8).view(np.uint8), d.view(np.uint8)]
  return np.concatenate([b.astype(np.uint8) for b in body], axis=1).reshape(n, -1)


def write_tiny_model(path, arch: str = "qwen2", seed: int = 0, tensor_type: str = "F32",
                     context: int = 512, rope_scale: float | None = None,
                     tensor_types: dict[str, str] | None = None, d_ff: int | None = None,
                     n_layers: int | None = None) -> str:
  """Writes a random tiny model of `arch`; tensor_type F32 | F16 | Q8_0 | Q4_0 | Q4_1 | Q5_0 | Q5_1 for the
  2-D weights, `tensor_types` naming another type for some of them ({"blk.1.attn_v.weight": "Q8_0"}; also
  Q4_K and Q6_K, random blocks, for tensors whose K is a multiple of 256: ffn_down with d_ff 256); d_ff and
  n_layers replace the arch's.
  "F32-int8" is F32 on jaxllm's W8A16 grid (each 64 values q * 2^e with integer |q| <= 127, 127 among
  them), which W8A16 holds exactly: a head that adds no error of its own."""
  d, h, g, dh, f, n_layers_default = SHAPES[arch]
  f, n_layers = d_ff or f, n_layers or n_layers_default
  tokens, types = vocab()
  v = len(tokens)
  rng = np.random.default_rng(seed)
  w = gguf.GGUFWriter(str(path), arch)
  w.add_uint32(f"{arch}.block_count", n_layers)
  w.add_uint32(f"{arch}.context_length", context)
  w.add_uint32(f"{arch}.embedding_length", d)
  w.add_uint32(f"{arch}.feed_forward_length", f)
  w.add_uint32(f"{arch}.attention.head_count", h)
  w.add_uint32(f"{arch}.attention.head_count_kv", g)
  w.add_uint32(f"{arch}.attention.key_length", dh)
  w.add_uint32(f"{arch}.attention.value_length", dh)
  w.add_float32(f"{arch}.rope.freq_base", 10000.0)
  w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
  if rope_scale:
    w.add_string(f"{arch}.rope.scaling.type", "linear")
    w.add_float32(f"{arch}.rope.scaling.factor", rope_scale)
  w.add_string("tokenizer.ggml.model", "gpt2")
  w.add_string("tokenizer.ggml.pre", "smollm" if arch == "llama" else "qwen2")
  w.add_array("tokenizer.ggml.tokens", tokens)
  w.add_array("tokenizer.ggml.token_type", types)
  w.add_array("tokenizer.ggml.merges", [" ".join(m) for m in MERGES])
  w.add_uint32("tokenizer.ggml.eos_token_id", tokens.index("<|im_end|>"))
  w.add_uint32("tokenizer.ggml.bos_token_id", tokens.index("<|endoftext|>"))
  w.add_bool("tokenizer.ggml.add_bos_token", False)
  w.add_string("tokenizer.chat_template", CHAT_TEMPLATE)

  def mat(name, n, k, scale=0.3):
    a = (rng.standard_normal((n, k)) * scale / np.sqrt(k) * 3).astype(np.float32)
    kind = (tensor_types or {}).get(name, tensor_type)
    if kind == "F32-int8":
      g = a.reshape(n, k // 64, 64)
      step = 2.0 ** np.round(np.log2(np.abs(g).max(-1, keepdims=True) / 127))
      q = np.clip(np.round(g / step), -127, 127)
      np.put_along_axis(q, np.abs(q).argmax(-1)[..., None], 127, axis=-1)
      a, kind = (q * step).astype(np.float32).reshape(n, k), "F32"
    if kind in ("Q4_K", "Q6_K"):
      w.add_tensor(name, random_k_blocks(rng, n, k, kind, float(a.std())), raw_dtype=gguf.GGMLQuantizationType[kind])
    elif kind == "F16":
      w.add_tensor(name, a.astype(np.float16))
    elif kind == "F32":
      w.add_tensor(name, a)
    else:
      t = gguf.GGMLQuantizationType[kind]
      w.add_tensor(name, gguf.quants.quantize(a, t), raw_dtype=t)

  def vec(name, n, base=1.0, spread=0.2):
    w.add_tensor(name, (base + spread * rng.standard_normal(n)).astype(np.float32))

  mat("token_embd.weight", v, d, scale=1.0)
  for i in range(n_layers):
    p = f"blk.{i}."
    vec(p + "attn_norm.weight", d)
    mat(p + "attn_q.weight", h * dh, d)
    mat(p + "attn_k.weight", g * dh, d)
    mat(p + "attn_v.weight", g * dh, d)
    if arch == "qwen2":
      vec(p + "attn_q.bias", h * dh, 0.0, 0.1)
      vec(p + "attn_k.bias", g * dh, 0.0, 0.1)
      vec(p + "attn_v.bias", g * dh, 0.0, 0.1)
    if arch == "qwen3":
      vec(p + "attn_q_norm.weight", dh)
      vec(p + "attn_k_norm.weight", dh)
    mat(p + "attn_output.weight", d, h * dh)
    vec(p + "ffn_norm.weight", d)
    mat(p + "ffn_gate.weight", f, d)
    mat(p + "ffn_up.weight", f, d)
    mat(p + "ffn_down.weight", d, f)
  vec("output_norm.weight", d)
  if arch != "llama":          # llama ties the head to the embedding, as SmolLM2 does
    mat("output.weight", v, d, scale=1.0)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)


def numpy_forward(path: str, tokens: list[int]) -> np.ndarray:
  """Float64 logits [T, V] of `tokens` (one sequence from position 0)."""
  r = gguf.GGUFReader(path)
  arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

  def meta(key):
    return r.fields[f"{arch}.{key}"].contents()

  t = {x.name: gguf.quants.dequantize(x.data, x.tensor_type).astype(np.float64).reshape(
      tuple(int(s) for s in reversed(x.shape))) for x in r.tensors}
  n_layers, h, g = meta("block_count"), meta("attention.head_count"), meta("attention.head_count_kv")
  dh, eps, base = meta("attention.key_length"), meta("attention.layer_norm_rms_epsilon"), meta("rope.freq_base")
  scale = meta("rope.scaling.factor") if f"{arch}.rope.scaling.factor" in r.fields else 1.0
  T = len(tokens)

  def norm(x, wt):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * wt

  inv = base ** (-np.arange(0, dh, 2) / dh)
  ang = (np.arange(T)[:, None] / scale) * inv[None, :]           # [T, Dh/2]
  cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

  def rope(x):                                                    # [T, N, Dh]
    out = np.empty_like(x)
    if arch == "llama":   # adjacent pairs
      a, b = x[..., 0::2], x[..., 1::2]
      out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
    else:                 # halves
      a, b = x[..., : dh // 2], x[..., dh // 2:]
      out[..., : dh // 2], out[..., dh // 2:] = a * cos - b * sin, b * cos + a * sin
    return out

  x = t["token_embd.weight"][tokens]
  mask = np.tril(np.ones((T, T), bool))
  for i in range(n_layers):
    p = f"blk.{i}."
    hn = norm(x, t[p + "attn_norm.weight"])
    q, k, v = (hn @ t[p + f"attn_{n}.weight"].T for n in "qkv")
    if p + "attn_q.bias" in t:
      q, k, v = q + t[p + "attn_q.bias"], k + t[p + "attn_k.bias"], v + t[p + "attn_v.bias"]
    q, k, v = q.reshape(T, h, dh), k.reshape(T, g, dh), v.reshape(T, g, dh)
    if p + "attn_q_norm.weight" in t:
      q, k = norm(q, t[p + "attn_q_norm.weight"]), norm(k, t[p + "attn_k_norm.weight"])
    q, k = rope(q), rope(k)
    k, v = np.repeat(k, h // g, axis=1), np.repeat(v, h // g, axis=1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(dh)
    s = np.where(mask[None], s, -np.inf)
    pr = np.exp(s - s.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    o = np.einsum("hts,shd->thd", pr, v).reshape(T, h * dh)
    x = x + o @ t[p + "attn_output.weight"].T
    hn = norm(x, t[p + "ffn_norm.weight"])
    gate, up = hn @ t[p + "ffn_gate.weight"].T, hn @ t[p + "ffn_up.weight"].T
    x = x + (gate / (1 + np.exp(-gate)) * up) @ t[p + "ffn_down.weight"].T
  x = norm(x, t["output_norm.weight"])
  head = t["output.weight"] if "output.weight" in t else t["token_embd.weight"]
  return x @ head.T
