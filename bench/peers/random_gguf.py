"""A GGUF of a synthetic preset's shape with random Q8_0 weights, for peers that read GGUF files (llama.cpp).

  python bench/peers/random_gguf.py vocab qwen2.5-coder-0.5b vocab.gguf        # the tokenizer metadata only
  python bench/peers/random_gguf.py model qwen2.5-0.5b vocab.gguf model.gguf    # preset shape, random Q8_0

The vocabulary-only file (about 6 MB for Qwen) carries the real tokenizer to a machine without the model;
`model` writes the preset's architecture keys, that tokenizer, and random Q8_0 blocks (scale 0.02 / 73, so
weights have about the spread of a freshly initialized model) built directly as bytes: the same work per
token as the real model at the same quantization.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np


def _copy_tokenizer(src: str, writer) -> None:
  import gguf
  reader = gguf.GGUFReader(src)
  for key, field in reader.fields.items():
    if not key.startswith("tokenizer."):
      continue
    vtype = field.types[0]
    writer.add_key_value(key, field.contents(), vtype,
                         sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)


def write_vocab(model: str, out: str) -> None:
  import gguf
  from jaxllm.models import resolve_model
  w = gguf.GGUFWriter(out, "qwen2")
  _copy_tokenizer(str(resolve_model(model)), w)
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def _q8_0(rng, rows: int, k: int) -> np.ndarray:
  """Random Q8_0 data [rows, K / 32 * 34] bytes: per block an f16 scale, then 32 int8 weights."""
  blocks = np.empty((rows, k // 32, 34), np.uint8)
  blocks[..., :2] = np.frombuffer(np.float16(0.02 / 73).tobytes(), np.uint8)
  blocks[..., 2:] = rng.integers(-127, 128, (rows, k // 32, 32), dtype=np.int8).view(np.uint8)
  return blocks.reshape(rows, -1)


def write_model(preset_name: str, vocab: str, out: str, seed: int = 0) -> None:
  import gguf
  from jaxllm.presets import preset
  c = preset(preset_name)
  rng = np.random.default_rng(seed)
  a = c.arch
  w = gguf.GGUFWriter(out, a)
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
  w.add_uint32("general.file_type", 7)   # MOSTLY_Q8_0
  _copy_tokenizer(vocab, w)
  q8 = gguf.GGMLQuantizationType.Q8_0

  def mat(name, n, k):
    w.add_tensor(name, _q8_0(rng, n, k), raw_dtype=q8)

  def vec(name, n, value=1.0):
    w.add_tensor(name, np.full((n,), value, np.float32))

  mat("token_embd.weight", c.vocab_size, c.d_model)
  for i in range(c.n_layers):
    p = f"blk.{i}."
    vec(p + "attn_norm.weight", c.d_model)
    mat(p + "attn_q.weight", c.q_dim, c.d_model)
    mat(p + "attn_k.weight", c.kv_dim, c.d_model)
    mat(p + "attn_v.weight", c.kv_dim, c.d_model)
    if c.qkv_bias:
      for n, d in (("q", c.q_dim), ("k", c.kv_dim), ("v", c.kv_dim)):
        vec(p + f"attn_{n}.bias", d, 0.0)
    if c.qk_norm:
      vec(p + "attn_q_norm.weight", c.head_dim)
      vec(p + "attn_k_norm.weight", c.head_dim)
    mat(p + "attn_output.weight", c.d_model, c.q_dim)
    vec(p + "ffn_norm.weight", c.d_model)
    mat(p + "ffn_gate.weight", c.d_ff, c.d_model)
    mat(p + "ffn_up.weight", c.d_ff, c.d_model)
    mat(p + "ffn_down.weight", c.d_model, c.d_ff)
  vec("output_norm.weight", c.d_model)
  if not c.tied_embeddings:
    mat("output.weight", c.vocab_size, c.d_model)
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="what", required=True)
  v = sub.add_parser("vocab", help="copy a GGUF's tokenizer metadata into a file without tensors")
  v.add_argument("model", help="a .gguf path or demo-model name")
  v.add_argument("out")
  m = sub.add_parser("model", help="a preset's shape with random Q8_0 weights and a vocabulary file's tokenizer")
  m.add_argument("preset")
  m.add_argument("vocab")
  m.add_argument("out")
  m.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  if args.what == "vocab":
    write_vocab(args.model, args.out)
  else:
    write_model(args.preset, args.vocab, args.out, args.seed)
  return 0


if __name__ == "__main__":
  sys.exit(main())
