"""GGUF reading: metadata, tokenizer fields, and tensors dequantized to float32 on demand.

The file is memory-mapped by `gguf.GGUFReader`; a tensor is dequantized only when asked for, so a model
is never held in memory as float all at once. GGUF stores dims innermost first; the arrays returned here
are in numpy order, so a linear layer's weight is [N_out, K_in].
"""
from __future__ import annotations

import os
from typing import Any

import gguf
import numpy as np

from jaxllm.config import Config

MAGIC = b"GGUF"


class GGUFError(ValueError):
  """A file that is not a readable GGUF model of a supported kind."""


def _field_value(field) -> Any:
  types = field.types
  if types[:2] == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]:
    # contents() is slow on 150k-entry vocabularies; decode the parts directly.
    return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
  return field.contents()


class GGUFFile:
  """A memory-mapped GGUF file.

  Attributes:
    path: the file.
    metadata: dict of key -> Python value (scalars, strings, lists).
    config: the model Config.
  """

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)
    if not os.path.isfile(self.path):
      raise FileNotFoundError(f"no such model file: {self.path!r}")
    size = os.path.getsize(self.path)
    with open(self.path, "rb") as f:
      head = f.read(4)
    if head != MAGIC:
      raise GGUFError(f"{self.path!r} is not a GGUF file: it starts with {head!r}, expected {MAGIC!r}")
    try:
      self._reader = gguf.GGUFReader(self.path, "r")
    except Exception as e:  # the reader raises assorted errors on cut-off headers
      raise GGUFError(f"{self.path!r} is truncated or corrupt: the GGUF header cannot be read ({e})") from e
    self.metadata = {k: _field_value(f) for k, f in self._reader.fields.items()
                     if not k.startswith("GGUF.")}
    self._tensors = {t.name: t for t in self._reader.tensors}
    for t in self._reader.tensors:
      end = t.data_offset + t.n_bytes
      if end > size:
        raise GGUFError(f"{self.path!r} is truncated: tensor {t.name!r} ends at byte {end}, "
                        f"but the file has {size} bytes")
    config = Config.from_metadata(self.metadata)
    self.config = config.replace(
        tied_embeddings="output.weight" not in self._tensors,
        rope_scaling="llama3" if "rope_freqs.weight" in self._tensors else config.rope_scaling)
    self._check_tensors()

  def _check_tensors(self):
    c = self.config
    need = ["token_embd.weight", "output_norm.weight"]
    for i in range(c.n_layers):
      need += [f"blk.{i}.{n}.weight" for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                                "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")]
      if c.qkv_bias:
        need += [f"blk.{i}.attn_{n}.bias" for n in "qkv"]
      if c.qk_norm:
        need += [f"blk.{i}.attn_q_norm.weight", f"blk.{i}.attn_k_norm.weight"]
    missing = [n for n in need if n not in self._tensors]
    if missing:
      raise GGUFError(f"{self.path!r} lacks tensors a {c.arch} model needs: {missing[:5]}"
                      + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    checked = set()
    for t in self._tensors.values():
      if t.tensor_type not in checked:
        _check_dequantizable(t)
        checked.add(t.tensor_type)
  def __contains__(self, name: str) -> bool:
    return name in self._tensors

  def tensor_type(self, name: str) -> str:
    return self._tensors[name].tensor_type.name

  def tensor(self, name: str) -> np.ndarray:
    """The tensor dequantized to float32, in numpy dim order (outermost first)."""
    t = self._tensors[name]
    shape = tuple(int(d) for d in reversed(t.shape))
    data = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.asarray(data, np.float32).reshape(shape)

  def tensor_types(self) -> dict[str, int]:
    """How many tensors of each type the file holds."""
    counts: dict[str, int] = {}
    for t in self._tensors.values():
      counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts


def _check_dequantizable(t) -> None:
  """Dequantizes one block of `t`, so an unsupported type fails at load time with a clear message."""
  try:
    block, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
    gguf.quants.dequantize(np.asarray(t.data).reshape(-1)[:type_size].view(np.uint8), t.tensor_type)
  except (NotImplementedError, KeyError) as e:
    raise GGUFError(f"tensor {t.name!r} has type {t.tensor_type.name}, which jaxllm cannot dequantize "
                    f"(gguf {gguf.__version__ if hasattr(gguf, '__version__') else ''} says: {e})") from e
