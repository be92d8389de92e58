"""GGUFs of the synthetic presets' shapes with random quantized blocks, for peers that read GGUF files (llama.cpp).

  python bench/peers/random_gguf.py vocab qwen2.5-coder-0.5b vocab.gguf                  # tokenizer metadata only
  python bench/peers/random_gguf.py model qwen2.5-7b vocab.gguf q8.gguf --type Q8_0       # preset shape, random blocks

The vocabulary-only file (about 6 MB for Qwen) carries a real tokenizer to a machine without the model. `model`
writes the preset's architecture keys as llama.cpp's convert_hf_to_gguf.py writes them for its family (llama:
vocab_size, rope.dimension_count and, for llama-3.1's llama3 RoPE scaling, the rope_freqs.weight factors; qwen2:
q/k/v biases; qwen3: q/k norms; key/value lengths for all), that tokenizer cut or padded to the preset's
vocabulary (padding as [PAD<id>] unused tokens, as the converter pads Qwen2.5-7B's; a cut drops the merges
and special ids past it), norms of 1 and zero biases, and random blocks built directly as bytes, one tensor in
memory at a time:

  Q8_0  f16 scale 0.02 / 73, 32 int8 in [-127, 127]                           (0.02: a fresh model's spread)
  Q4_0  f16 scale 0.02 / 4.61, 16 bytes of nibbles (value (q - 8) * d)
  Q4_K  per 256 values: f16 d and dmin, eight 6-bit scales in [32, 63] and mins packed in 12 bytes as ggml's
        get_scale_min_k4 reads them (value d * sc * q - dmin * m, m centring q), 128 bytes of nibbles. A
        matrix whose K is not a multiple of 256 takes Q5_0 blocks instead, as llama-quantize does for Q4_K.

The same work per token as the real model at that quantization. Bad input (an unknown preset or type, a
missing vocabulary file) ends with a one-line error.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

TYPES = ("Q8_0", "Q4_0", "Q4_K")
STD = 0.02                     # the spread of every random matrix's values
_FILE_TYPE = {"Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0", "Q4_K": "MOSTLY_Q4_K_S"}
_UNUSED = 5                    # gguf.TokenType.UNUSED: the converter's type for [PAD<id>] tokens


# ---- blocks ---------------------------------------------------------------------------------------------------

def _f16_bytes(value: float, shape) -> np.ndarray:
  """[*shape, 2] uint8: one f16 value repeated."""
  return np.broadcast_to(np.frombuffer(np.float16(value).tobytes(), np.uint8), (*shape, 2))


def q8_0_blocks(rng, rows: int, k: int) -> np.ndarray:
  """[rows, K / 32 * 34] bytes: per block of 32 an f16 scale, then 32 int8 weights (std(U[-127, 127]) = 73.3)."""
  blocks = np.empty((rows, k // 32, 34), np.uint8)
  blocks[..., :2] = _f16_bytes(STD / 73.3, (rows, k // 32))
  blocks[..., 2:] = rng.integers(-127, 128, (rows, k // 32, 32), dtype=np.int8).view(np.uint8)
  return blocks.reshape(rows, -1)


def q4_0_blocks(rng, rows: int, k: int) -> np.ndarray:
  """[rows, K / 32 * 18] bytes: per block of 32 an f16 scale d, then 16 bytes of nibbles (value (q - 8) * d;
  std of q - 8 over U{0..15}: 4.61)."""
  blocks = np.empty((rows, k // 32, 18), np.uint8)
  blocks[..., :2] = _f16_bytes(STD / 4.61, (rows, k // 32))
  blocks[..., 2:] = rng.integers(0, 256, (rows, k // 32, 16), dtype=np.uint8)
  return blocks.reshape(rows, -1)


def q5_0_blocks(rng, rows: int, k: int) -> np.ndarray:
  """[rows, K / 32 * 22] bytes: per block of 32 an f16 scale d, 4 bytes of fifth bits, 16 of nibbles (value
  (q - 16) * d; std over U{0..31}: 9.23)."""
  blocks = np.empty((rows, k // 32, 22), np.uint8)
  blocks[..., :2] = _f16_bytes(STD / 9.23, (rows, k // 32))
  blocks[..., 2:] = rng.integers(0, 256, (rows, k // 32, 20), dtype=np.uint8)
  return blocks.reshape(rows, -1)


def pack_q4_k(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, mn: np.ndarray, q: np.ndarray) -> np.ndarray:
  """ggml's block_q4_K bytes [..., 144] of super-blocks of 256 values.

  Args:
    d, dmin: [...] f16-representable super-block scales.
    sc, mn: [..., 8] 6-bit scales and mins of the eight groups of 32.
    q: [..., 256] 4-bit values in order; value i = d * sc[i // 32] * q[i] - dmin * mn[i // 32].
  Bytes 0-3 of the 12 hold sc[0:4] and, in bits 6-7, sc[4:8] >> 4; bytes 4-7 mn[0:4] and mn[4:8] >> 4;
  bytes 8-11 the low nibbles of sc[4:8] and, above them, of mn[4:8] (ggml's get_scale_min_k4 reads them so).
  Chunk c of 64 values is 32 bytes: group 2c in the low nibbles, group 2c + 1 in the high ones.
  """
  sc, mn, q = (np.asarray(a, np.uint8) for a in (sc, mn, q))
  if sc.max(initial=0) > 63 or mn.max(initial=0) > 63 or q.max(initial=0) > 15:
    raise ValueError("Q4_K scales and mins are 6-bit, values 4-bit")
  scales = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                           (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)], axis=-1)     # [..., 12]
  g = q.reshape(*q.shape[:-1], 4, 2, 32)                                               # [..., chunk, lo/hi, 32]
  qs = (g[..., 0, :] | (g[..., 1, :] << 4)).reshape(*q.shape[:-1], 128)
  return np.concatenate([np.asarray(d, np.float16)[..., None].view(np.uint8),
                         np.asarray(dmin, np.float16)[..., None].view(np.uint8), scales, qs], axis=-1)


def q4_k_blocks(rng, rows: int, k: int) -> np.ndarray:
  """[rows, K / 256 * 144] bytes of random Q4_K super-blocks: scales in [32, 63] (rms 48.4), dmin = 8 d and
  mins round(sc * 7.5 / 8), so each group is centred on zero with std d * sc * 4.61."""
  shape = (rows, k // 256)
  sc = rng.integers(32, 64, (*shape, 8), dtype=np.uint8)
  mn = np.round(sc * (7.5 / 8)).astype(np.uint8)
  d = np.full(shape, STD / (4.61 * 48.4), np.float16)
  q = rng.integers(0, 16, (*shape, 256), dtype=np.uint8)
  return pack_q4_k(d, d * np.float16(8), sc, mn, q).reshape(rows, -1)


_BLOCKS = {"Q8_0": q8_0_blocks, "Q4_0": q4_0_blocks, "Q5_0": q5_0_blocks, "Q4_K": q4_k_blocks}


def matrix_type(qtype: str, k: int) -> str:
  """The block type a [N, K] matrix gets: Q4_K needs K % 256 == 0, else Q5_0 (llama-quantize's fallback)."""
  return "Q5_0" if qtype == "Q4_K" and k % 256 else qtype


# ---- tokenizer ------------------------------------------------------------------------------------------------

def tokenizer_fields(src: str) -> dict:
  """A GGUF's tokenizer.* metadata: key -> (value, value type, array item type or None). Read by jaxllm's
  parser: gguf.GGUFReader took 7.8 s over Qwen's 151k tokens and merges, this 0.3 s."""
  import gguf
  from jaxllm.gguf import read_metadata
  meta, types = read_metadata(src)
  out = {}
  for key, value in meta.items():
    if key.startswith("tokenizer."):
      vtype, item = types[key]
      value = value.tolist() if isinstance(value, np.ndarray) else value
      out[key] = (value, gguf.GGUFValueType(vtype), None if item is None else gguf.GGUFValueType(item))
  if "tokenizer.ggml.tokens" not in out:
    raise SystemExit(f"error: {src} has no tokenizer.ggml.tokens: give a vocabulary file written by "
                     f"`random_gguf.py vocab`")
  return out


def resize_tokenizer(fields: dict, n: int) -> dict:
  """The tokenizer cut or padded to n tokens. Padding: "[PAD<id>]" tokens of type unused (score 0); a cut drops
  the merges whose parts or result fall past it and the special-token ids past it."""
  fields = dict(fields)
  tokens = list(fields["tokenizer.ggml.tokens"][0])
  if len(tokens) == n:
    return fields
  per_token = {"tokenizer.ggml.tokens": [f"[PAD{i}]" for i in range(len(tokens), n)],
               "tokenizer.ggml.token_type": [_UNUSED] * max(0, n - len(tokens)),
               "tokenizer.ggml.scores": [0.0] * max(0, n - len(tokens))}
  for key, pad in per_token.items():
    if key in fields:
      value, vtype, sub = fields[key]
      fields[key] = ((list(value) + pad)[:n], vtype, sub)
  if n < len(tokens):
    kept = set(tokens[:n])
    if "tokenizer.ggml.merges" in fields:
      value, vtype, sub = fields["tokenizer.ggml.merges"]
      merges = [m for m in value if all(p in kept for p in m.split(" ")) and m.replace(" ", "") in kept]
      fields["tokenizer.ggml.merges"] = (merges, vtype, sub)
    for key in [k for k in fields if k.endswith("_token_id")]:
      if fields[key][0] >= n:
        del fields[key]
  return fields


def write_vocab(model: str, out: str) -> None:
  import gguf
  from jaxllm.models import resolve_model
  fields = tokenizer_fields(str(resolve_model(model)))
  w = gguf.GGUFWriter(out, "qwen2")
  for key, (value, vtype, sub) in fields.items():
    w.add_key_value(key, value, vtype, sub_type=sub)
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


# ---- model ----------------------------------------------------------------------------------------------------

def _tensors(c) -> list[tuple[str, tuple[int, ...], str]]:
  """(name, [N, K] or [N], "matrix" | "norm" | "bias" | "rope_freqs") in llama.cpp's names and file order."""
  out = [("token_embd.weight", (c.vocab_size, c.d_model), "matrix")]
  if c.rope_scaling == "llama3":
    out.append(("rope_freqs.weight", (c.head_dim // 2,), "rope_freqs"))
  for i in range(c.n_layers):
    p = f"blk.{i}."
    out.append((p + "attn_norm.weight", (c.d_model,), "norm"))
    out += [(p + f"attn_{n}.weight", (d, c.d_model), "matrix") for n, d in (("q", c.q_dim), ("k", c.kv_dim),
                                                                           ("v", c.kv_dim))]
    if c.qkv_bias:
      out += [(p + f"attn_{n}.bias", (d,), "bias") for n, d in (("q", c.q_dim), ("k", c.kv_dim), ("v", c.kv_dim))]
    if c.qk_norm:
      out += [(p + "attn_q_norm.weight", (c.head_dim,), "norm"), (p + "attn_k_norm.weight", (c.head_dim,), "norm")]
    out += [(p + "attn_output.weight", (c.d_model, c.q_dim), "matrix"), (p + "ffn_norm.weight", (c.d_model,), "norm"),
            (p + "ffn_gate.weight", (c.d_ff, c.d_model), "matrix"),
            (p + "ffn_up.weight", (c.d_ff, c.d_model), "matrix"),
            (p + "ffn_down.weight", (c.d_model, c.d_ff), "matrix")]
  out.append(("output_norm.weight", (c.d_model,), "norm"))
  if not c.tied_embeddings:
    out.append(("output.weight", (c.vocab_size, c.d_model), "matrix"))
  return out


def _arch_keys(w, c, qtype: str, name: str) -> None:
  """The architecture keys convert_hf_to_gguf.py writes for the preset's family."""
  import gguf
  a = c.arch
  w.add_name(name)
  w.add_uint32(f"{a}.block_count", c.n_layers)
  w.add_uint32(f"{a}.context_length", c.context_length)
  w.add_uint32(f"{a}.embedding_length", c.d_model)
  w.add_uint32(f"{a}.feed_forward_length", c.d_ff)
  w.add_uint32(f"{a}.attention.head_count", c.n_heads)
  w.add_uint32(f"{a}.attention.head_count_kv", c.n_kv_heads)
  w.add_uint32(f"{a}.attention.key_length", c.head_dim)
  w.add_uint32(f"{a}.attention.value_length", c.head_dim)
  w.add_float32(f"{a}.rope.freq_base", c.rope_base)
  w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", c.rms_eps)
  if a == "llama":
    w.add_uint32(f"{a}.vocab_size", c.vocab_size)
    w.add_uint32(f"{a}.rope.dimension_count", c.head_dim)
  w.add_uint32("general.file_type", int(gguf.LlamaFileType[_FILE_TYPE[qtype]]))
  w.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)


def write_model(preset_name: str, vocab: str, out: str, qtype: str = "Q8_0", seed: int = 0) -> None:
  """Writes the preset's shape with random `qtype` blocks and the vocabulary file's tokenizer to `out`."""
  import gguf
  from jaxllm.presets import preset
  if qtype not in TYPES:
    raise SystemExit(f"error: --type must be one of {', '.join(TYPES)}, got {qtype!r}")
  try:
    c = preset(preset_name)
  except ValueError as e:
    raise SystemExit(f"error: {e}")
  if not os.path.isfile(vocab):
    raise SystemExit(f"error: no vocabulary file {vocab!r} (write one with `random_gguf.py vocab MODEL FILE`)")
  fields = resize_tokenizer(tokenizer_fields(vocab), c.vocab_size)
  rng = np.random.default_rng(seed)
  w = gguf.GGUFWriter(out, c.arch)
  _arch_keys(w, c, qtype, f"random {preset_name.removeprefix('synthetic:')} {qtype}")
  for key, (value, vtype, sub) in fields.items():
    w.add_key_value(key, value, vtype, sub_type=sub)
  plan = _tensors(c)
  for name, shape, kind in plan:           # tensor infos first, then each tensor's bytes as it is made
    if kind == "matrix":
      t = matrix_type(qtype, shape[1])
      qt = gguf.GGMLQuantizationType[t]
      block, size = gguf.GGML_QUANT_SIZES[qt]
      w.add_tensor_info(name, (shape[0], shape[1] // block * size), np.dtype(np.uint8),
                        shape[0] * shape[1] // block * size, raw_dtype=qt)
    else:
      w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_ti_data_to_file()
  for name, shape, kind in plan:
    if kind == "matrix":
      data = _BLOCKS[matrix_type(qtype, shape[1])](rng, *shape)
    elif kind == "rope_freqs":
      from jaxllm.rope import llama3_rope_freqs
      data = np.asarray(llama3_rope_freqs(c), np.float32)
    else:
      data = np.full(shape, 1.0 if kind == "norm" else 0.0, np.float32)
    w.write_tensor_data(data)
  w.close()


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="what", required=True)
  v = sub.add_parser("vocab", help="copy a GGUF's tokenizer metadata into a file without tensors")
  v.add_argument("model", help="a .gguf path or demo-model name")
  v.add_argument("out")
  m = sub.add_parser("model", help="a preset's shape with random blocks and a vocabulary file's tokenizer")
  m.add_argument("preset")
  m.add_argument("vocab")
  m.add_argument("out")
  m.add_argument("--type", default="Q8_0", choices=TYPES, help="the matrices' block type (default Q8_0)")
  m.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  try:
    if args.what == "vocab":
      write_vocab(args.model, args.out)
    else:
      write_model(args.preset, args.vocab, args.out, args.type, args.seed)
  except (ValueError, OSError) as e:
    raise SystemExit(f"error: {e}") from None
  return 0


if __name__ == "__main__":
  # A writer of files, run beside the measured process (bench/scaling.py writes the next preset's GGUFs while
  # jaxllm runs): it must not take the GPU. jax (llama3_rope_freqs, for llama-3.1's rope factors) would
  # otherwise start the GPU's client, whose preallocation left that process out of memory.
  os.environ["JAX_PLATFORMS"] = "cpu"
  sys.exit(main())
