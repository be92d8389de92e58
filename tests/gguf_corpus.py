"""The malformed-GGUF corpus: a byte-level GGUF writer, a valid micro model, and the broken variants of it.

`python tests/gguf_corpus.py` rewrites tests/corpus/ (the files and manifest.json, which maps each file to
the error message it must produce). The writer is written here, byte by byte, because gguf.GGUFWriter
cannot write broken files; it shares nothing with jaxllm's reader.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

CORPUS = Path(__file__).resolve().parent / "corpus"
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q",
        I64: "<q", F64: "<d"}
ARCH = "llama"
D, H, G, DH, F, L, VOCAB = 16, 2, 1, 8, 32, 1, 32


def s(text: str | bytes) -> bytes:
  raw = text.encode() if isinstance(text, str) else text
  return struct.pack("<Q", len(raw)) + raw


def value(vtype: int, v) -> bytes:
  if vtype == STR:
    return s(v)
  if vtype == ARR:
    item, items = v
    body = b"".join(value(item, x) for x in items)
    return struct.pack("<IQ", item, len(items)) + body
  return struct.pack(_FMT[vtype], v)


def kv(key: str | bytes, vtype: int, v) -> bytes:
  return s(key) + struct.pack("<I", vtype) + value(vtype, v)


def micro_metadata() -> list[tuple[str, int, object]]:
  tokens = [chr(ord("a") + i) for i in range(26)] + ["<s>", "</s>", "0", "1", "2", "ab"]
  return [
      ("general.architecture", STR, ARCH),
      (f"{ARCH}.block_count", U32, L), (f"{ARCH}.context_length", U32, 64),
      (f"{ARCH}.embedding_length", U32, D), (f"{ARCH}.feed_forward_length", U32, F),
      (f"{ARCH}.attention.head_count", U32, H), (f"{ARCH}.attention.head_count_kv", U32, G),
      (f"{ARCH}.attention.layer_norm_rms_epsilon", F32, 1e-5), (f"{ARCH}.rope.freq_base", F32, 10000.0),
      ("tokenizer.ggml.model", STR, "gpt2"), ("tokenizer.ggml.pre", STR, "default"),
      ("tokenizer.ggml.tokens", ARR, (STR, tokens)), ("tokenizer.ggml.token_type", ARR, (I32, [1] * VOCAB)),
      ("tokenizer.ggml.merges", ARR, (STR, ["a b"])), ("tokenizer.ggml.bos_token_id", U32, 26),
      ("tokenizer.ggml.eos_token_id", U32, 27),
  ]


def micro_tensors() -> list[tuple[str, tuple[int, ...]]]:
  """(name, numpy shape) of every tensor of the micro llama model."""
  out = [("token_embd.weight", (VOCAB, D)), ("output_norm.weight", (D,))]
  p = "blk.0."
  out += [(p + "attn_norm.weight", (D,)), (p + "attn_q.weight", (H * DH, D)), (p + "attn_k.weight", (G * DH, D)),
          (p + "attn_v.weight", (G * DH, D)), (p + "attn_output.weight", (D, H * DH)), (p + "ffn_norm.weight", (D,)),
          (p + "ffn_gate.weight", (F, D)), (p + "ffn_up.weight", (F, D)), (p + "ffn_down.weight", (D, F))]
  return out


def build(meta=None, tensors=None, *, version=3, align=32, tensor_type=0, magic=b"GGUF", kv_count=None,
          tensor_count=None, patch=None) -> bytes:
  """A GGUF file. tensors: (name, shape[, type[, offset]]); patch(name, info_bytes) may rewrite an entry."""
  meta = micro_metadata() if meta is None else meta
  tensors = micro_tensors() if tensors is None else tensors
  rng = np.random.default_rng(0)
  kv_bytes = b"".join(kv(*m) for m in meta)
  infos, blobs, offset = [], [], 0
  for entry in tensors:
    name, shape = entry[0], entry[1]
    ttype = entry[2] if len(entry) > 2 else tensor_type
    data = rng.standard_normal(shape).astype(np.float32).tobytes() if ttype == 0 else \
        np.ones(int(np.prod(shape)), np.int32).tobytes()
    at = entry[3] if len(entry) > 3 else offset
    info = s(name) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in reversed(shape)) + \
        struct.pack("<IQ", ttype, at)
    infos.append(patch(name, info) if patch else info)
    blobs.append(data + b"\0" * (-len(data) % align))
    offset += len(blobs[-1])
  head = magic + struct.pack("<IQQ", version, len(tensors) if tensor_count is None else tensor_count,
                             len(meta) if kv_count is None else kv_count)
  body = head + kv_bytes + b"".join(infos)
  body += b"\0" * (-len(body) % align)
  return body + b"".join(blobs)


def _replace(meta, key, vtype, v):
  return [(k, vtype, v) if k == key else (k, t, x) for k, t, x in meta]


def _drop(items, name):
  return [x for x in items if x[0] != name]


def cases() -> dict[str, tuple[bytes, str]]:
  """file name -> (bytes, regex the error message must match)."""
  good = build()
  meta = micro_metadata()
  kv_end = 24 + sum(len(kv(*m)) for m in meta)
  data_bytes = sum(-(-4 * int(np.prod(shape)) // 32) * 32 for _, shape in micro_tensors())
  infos_end = len(good) - data_bytes                # the padded end of the tensor infos: data starts here
  first_info = kv_end + len(s("token_embd.weight"))
  c = {
      "wrong_magic.gguf": (b"GGUG" + good[4:], r"not a GGUF file: it starts with b'GGUG'"),
      "empty.gguf": (b"", r"not a GGUF file: it has 0 bytes"),
      "version_1.gguf": (build(version=1), r"GGUF version 1; jaxllm reads versions \(2, 3\)"),
      "version_99.gguf": (build(version=99), r"GGUF version 99"),
      "big_endian.gguf": (good[:4] + struct.pack(">I", 3) + good[8:], r"big-endian GGUF file"),
      # The reproduced hang: 68 bytes declaring one array of 2^62 uint8, then the end of the file.
      "huge_array_count_68.gguf": (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + s("a" * 20) +
                                   struct.pack("<IIQ", ARR, U8, 1 << 62), r"declares 4611686018427387904 items"),
      "huge_string_array.gguf": (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + s("k") +
                                 struct.pack("<IIQ", ARR, STR, 1 << 20), r"the 1048576 strings of 'k' needs"),
      "huge_key_length.gguf": (b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1 << 63) + b"key" * 8,
                              r"metadata key 0 is \d+ bytes long"),
      "huge_string_value.gguf": (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + s("k") + struct.pack("<IQ", STR, 1 << 40),
                                 r"the value of 'k' needs 1099511627776 bytes"),
      "huge_kv_count.gguf": (build(kv_count=1 << 60), r"declares 1152921504606846976 metadata entries"),
      "huge_tensor_count.gguf": (build(tensor_count=1 << 59), r"declares 576460752303423488 tensors"),
      "bad_value_type.gguf": (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + s("x.bad") + struct.pack("<I", 99),
                              r"value type 99, which GGUF does not define"),
      "nested_array.gguf": (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + s("x") + struct.pack("<IIQ", ARR, ARR, 1),
                            r"nests arrays"),
      "duplicate_key.gguf": (build(meta + [meta[1]]), r"metadata key 'llama.block_count' appears twice"),
      "invalid_utf8_key.gguf": (build(meta + [(b"bad\xff\xfekey", U32, 1)]), r"is not valid UTF-8"),
      "alignment_3.gguf": (build(meta + [("general.alignment", U32, 3)]), r"general.alignment must be a power of two"),
      "alignment_0.gguf": (build(meta + [("general.alignment", U32, 0)]), r"general.alignment must be a power of two"),
      "alignment_string.gguf": (build(meta + [("general.alignment", STR, "32")]), r"general.alignment must be"),
      "misaligned_offset.gguf": (build(patch=lambda n, b: b[:-8] + struct.pack("<Q", 4) if n == "output_norm.weight"
                                       else b), r"starts at data offset 4, not a multiple of the alignment 32"),
      "tensor_past_end.gguf": (build(patch=lambda n, b: b[:-8] + struct.pack("<Q", 1 << 40) if n == "output_norm.weight"
                                     else b), r"truncated: tensor 'output_norm.weight' ends at byte"),
      "overlapping_tensors.gguf": (build(patch=lambda n, b: b[:-8] + struct.pack("<Q", 0) if n == "output_norm.weight"
                                         else b), r"overlap"),
      "duplicate_tensor.gguf": (build(tensors=micro_tensors() + [("output_norm.weight", (D,))]),
                                r"tensor 'output_norm.weight' appears twice"),
      "missing_tensor.gguf": (build(tensors=_drop(micro_tensors(), "blk.0.ffn_down.weight")),
                              r"lacks tensors a llama model needs: \['blk.0.ffn_down.weight'\]"),
      "wrong_shape.gguf": (build(tensors=[(n, (sh[1], sh[0]) if n == "blk.0.ffn_gate.weight" else sh)
                                          for n, sh in micro_tensors()]),
                           r"tensor 'blk.0.ffn_gate.weight' has shape \[16, 32\], but .* needs \[32, 16\]"),
      "unknown_tensor_type.gguf": (build(tensors=[(n, sh, 99 if n == "output_norm.weight" else 0)
                                                  for n, sh in micro_tensors()]), r"has type 99, which gguf"),
      "undequantizable_type.gguf": (build(tensors=[(n, sh, 26 if n == "output_norm.weight" else 0)
                                                   for n, sh in micro_tensors()]),
                                    r"tensor 'output_norm.weight' has type I32, which jaxllm cannot dequantize"),
      "five_dims.gguf": (build(tensors=micro_tensors() + [("extra", (1, 1, 1, 1, 2))]), r"has 5 dims, expected 1 to 4"),
      "zero_dim.gguf": (build(tensors=micro_tensors() + [("extra", (0, 4))]), r"has dims \[4, 0\]"),
      "block_count_2e32.gguf": (build(_replace(meta, f"{ARCH}.block_count", U64, 1 << 32)),
                                r"n_layers must be an integer in \[1, 1024\], got 4294967296"),
      "block_count_more_than_tensors.gguf": (build(_replace(meta, f"{ARCH}.block_count", U32, 9)),
                                             r"block_count is 9, but the file has tensors for 1 blocks"),
      "block_count_0.gguf": (build(_replace(meta, f"{ARCH}.block_count", U32, 0)), r"n_layers must be an integer"),
      "head_count_0.gguf": (build(_replace(meta, f"{ARCH}.attention.head_count", U32, 0)),
                            r"head_count' must be >= 1, got 0"),
      "head_count_kv_3.gguf": (build(_replace(meta, f"{ARCH}.attention.head_count_kv", U32, 3)),
                               r"n_heads=2 is not a multiple of n_kv_heads=3"),
      "head_count_string.gguf": (build(_replace(meta, f"{ARCH}.attention.head_count", STR, "2")),
                                 r"'llama.attention.head_count' must be int, got '2'"),
      "embedding_length_huge.gguf": (build(_replace(meta, f"{ARCH}.embedding_length", U64, 1 << 40)),
                                     r"d_model must be an integer in \[1, 65536\], got 1099511627776"),
      "rms_eps_nan.gguf": (build(_replace(meta, f"{ARCH}.attention.layer_norm_rms_epsilon", F32, float("nan"))),
                           r"rms_eps must be a finite number"),
      "context_length_0.gguf": (build(_replace(meta, f"{ARCH}.context_length", U32, 0)), r"context_length must be"),
      "missing_block_count.gguf": (build(_drop(meta, f"{ARCH}.block_count")), r"lacks 'llama.block_count'"),
      "no_architecture.gguf": (build(_drop(meta, "general.architecture")), r"unsupported architecture None"),
      "gpt2_architecture.gguf": (build(_replace(meta, "general.architecture", STR, "gpt2")),
                                 r"unsupported architecture 'gpt2'"),
      "vocab_mismatch.gguf": (build(meta + [(f"{ARCH}.vocab_size", U32, 40)]),
                              r"'token_embd.weight' has shape \[32, 16\], but .* needs \[40, 16\]"),
      "eos_out_of_range.gguf": (build(_replace(meta, "tokenizer.ggml.eos_token_id", U32, 5000)),
                                r"eos_id must be a token id in \[0, 32\), got 5000"),
      "tokens_not_strings.gguf": (build(_replace(meta, "tokenizer.ggml.tokens", ARR, (I32, list(range(VOCAB))))),
                                  r"tokenizer.ggml.tokens must be a list of strings"),
      "token_type_short.gguf": (build(_replace(meta, "tokenizer.ggml.token_type", ARR, (I32, [1] * 3))),
                                r"tokenizer.ggml.token_type has 3 entries, but there are 32 tokens"),
      "merge_without_space.gguf": (build(_replace(meta, "tokenizer.ggml.merges", ARR, (STR, ["ab"]))),
                                   r"merge 0 .* is not two tokens separated by a space"),
      "merge_unknown_token.gguf": (build(_replace(meta, "tokenizer.ggml.merges", ARR, (STR, ["a zz"]))),
                                   r"BPE vocabulary in tokenizer.ggml.\* is inconsistent"),
      "tokenizer_model_llama.gguf": (build(_replace(meta, "tokenizer.ggml.model", STR, "llama")),
                                     r"unsupported tokenizer model 'llama'"),
  }
  # Truncated at every section boundary (and inside each section).
  for name, at in [("magic", 3), ("version", 6), ("counts", 16), ("after_counts", 24), ("first_key", 30),
                   ("kv_section", kv_end - 5), ("after_kv", kv_end), ("tensor_info", first_info + 3),
                   ("after_infos", infos_end), ("data_half", len(good) // 2), ("data_last_byte", len(good) - 1)]:
    c[f"truncated_{name}.gguf"] = (good[:at], r"truncated|not a GGUF file")
  return c


def write(directory: Path = CORPUS) -> None:
  directory.mkdir(parents=True, exist_ok=True)
  for old in directory.glob("*.gguf"):
    old.unlink()
  manifest = {}
  for name, (data, pattern) in sorted(cases().items()):
    (directory / name).write_bytes(data)
    manifest[name] = pattern
  (directory / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
  (directory / "valid_micro.gguf.bin").write_bytes(build())   # the base the cases break (not a case)


if __name__ == "__main__":
  write()
  print(f"wrote {len(cases())} cases into {CORPUS}")
