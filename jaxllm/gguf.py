"""GGUF reading: a bounded header parser, metadata, and tensors dequantized on demand.

GGUF files are untrusted input. The header is parsed here, not by `gguf.GGUFReader`, because that reader
trusts every count it reads (a file that declares an array of 2^62 bytes and then ends makes it loop
forever). Every count and length is checked against the bytes left in the file before anything is
allocated or looped over; every tensor's type, shape, alignment and extent are checked before its data is
touched; every failure is a `GGUFError` that names the file, what was expected and what was found.
gguf-py supplies the type tables and the dequantizers (`gguf.quants`).

The file is memory-mapped; a tensor is dequantized only when asked for, so a model is never held in
memory as float all at once. GGUF stores dims innermost first; the arrays returned here are in numpy
order, so a linear layer's weight is [N_out, K_in].
"""
from __future__ import annotations

import mmap
import os
import re
import struct
from typing import Any

import gguf
import numpy as np

from jaxllm.config import Config

MAGIC = b"GGUF"
VERSIONS = (2, 3)            # v1 used 32-bit counts; nothing current writes it
MAX_DIMS = 4                 # GGML_MAX_DIMS
MAX_ARRAY = 1 << 24          # items in one metadata array (the largest vocabularies have ~256k)
MAX_NAME = 1 << 16           # bytes in a key or tensor name
DEFAULT_ALIGNMENT = 32

V = gguf.GGUFValueType
# Fixed-size metadata value types: struct format (little-endian) and numpy dtype.
_SCALARS = {
    V.UINT8: ("<B", np.uint8), V.INT8: ("<b", np.int8), V.UINT16: ("<H", np.uint16), V.INT16: ("<h", np.int16),
    V.UINT32: ("<I", np.uint32), V.INT32: ("<i", np.int32), V.FLOAT32: ("<f", np.float32),
    V.BOOL: ("<?", np.bool_), V.UINT64: ("<Q", np.uint64), V.INT64: ("<q", np.int64),
    V.FLOAT64: ("<d", np.float64),
}


class GGUFError(ValueError):
  """A file that is not a readable GGUF model of a supported kind."""


class _Cursor:
  """Reads little-endian values from the mapped header, never past the end of the file."""

  def __init__(self, buf, path: str):
    self.buf, self.size, self.pos, self.path = buf, len(buf), 0, path
    self.types: dict[str, tuple[int, int | None]] = {}    # per key read by value(): (value type, item type)

  def fail(self, what: str) -> GGUFError:
    return GGUFError(f"{self.path!r} is truncated or corrupt: {what}")

  def need(self, n: int, what: str) -> None:
    if n < 0 or self.pos + n > self.size:
      raise self.fail(f"{what} needs {n} bytes at offset {self.pos}, but the file has {self.size} bytes")

  def scalar(self, fmt: str, what: str):
    n = struct.calcsize(fmt)
    self.need(n, what)
    (value,) = struct.unpack_from(fmt, self.buf, self.pos)
    self.pos += n
    return value

  def string(self, what: str, limit: int | None = None, strict: bool = False) -> str:
    n = self.scalar("<Q", f"the length of {what}")
    if limit is not None and n > limit:
      raise self.fail(f"{what} is {n} bytes long, more than the {limit} allowed")
    self.need(n, what)
    raw = bytes(self.buf[self.pos:self.pos + n])
    self.pos += n
    try:
      return raw.decode("utf-8", errors="strict" if strict else "replace")
    except UnicodeDecodeError:
      raise self.fail(f"{what} is not valid UTF-8: {raw[:40]!r}") from None

  def value(self, vtype: int, key: str, depth: int = 0) -> Any:
    self.types[key] = (vtype, None)
    if vtype in _SCALARS:
      return self.scalar(_SCALARS[vtype][0], f"the value of {key!r}")
    if vtype == V.STRING:
      return self.string(f"the value of {key!r}")
    if vtype != V.ARRAY:
      raise self.fail(f"metadata {key!r} has value type {vtype}, which GGUF does not define (0-12)")
    if depth:
      raise self.fail(f"metadata {key!r} nests arrays, which no supported model uses")
    item = self.scalar("<I", f"the item type of {key!r}")
    self.types[key] = (vtype, item)
    count = self.scalar("<Q", f"the item count of {key!r}")
    if count > MAX_ARRAY:
      raise self.fail(f"metadata {key!r} declares {count} items, more than the {MAX_ARRAY} allowed")
    if item in _SCALARS:
      fmt, dtype = _SCALARS[item]
      self.need(count * struct.calcsize(fmt), f"the {count} items of {key!r}")
      arr = np.frombuffer(self.buf, dtype=np.dtype(dtype).newbyteorder("<"), count=count, offset=self.pos)
      self.pos += arr.nbytes
      # A numpy array, not a list: its items cost their own bytes, not a Python object each (~36 bytes an
      # int8), so the metadata of a 1 GiB file cannot need tens of GiB. Copied: the map may be closed.
      out = arr.astype(dtype)
      out.flags.writeable = False
      return out
    if item == V.STRING:
      self.need(count * 8, f"the {count} strings of {key!r}")   # each string has at least its length
      return [self.string(f"item {i} of {key!r}") for i in range(count)]
    if item == V.ARRAY:
      raise self.fail(f"metadata {key!r} nests arrays, which no supported model uses")
    raise self.fail(f"metadata {key!r} has item type {item}, which GGUF does not define (0-12)")


class _Tensor:
  """One tensor's entry in the header, checked against the file."""

  __slots__ = ("name", "type", "shape", "offset", "nbytes")

  def __init__(self, name: str, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...], offset: int, nbytes: int):
    self.name, self.type, self.shape, self.offset, self.nbytes = name, qtype, shape, offset, nbytes


def _parse(buf, path: str) -> tuple[int, dict[str, Any], dict[str, _Tensor], dict[str, tuple[int, int | None]]]:
  """(version, metadata, tensors, each key's (value type, array item type or None)) from a mapped file; raises
  GGUFError on anything out of bounds."""
  cur = _Cursor(buf, path)
  if cur.size < 4 or bytes(buf[:4]) != MAGIC:
    raise GGUFError(f"{path!r} is not a GGUF file: it starts with {bytes(buf[:4])!r}, expected {MAGIC!r}")
  cur.pos = 4
  version = cur.scalar("<I", "the version")
  if version not in VERSIONS:
    if version and not version & 0xFFFF:
      raise GGUFError(f"{path!r} is a big-endian GGUF file (version {version >> 24}); jaxllm reads little-endian ones")
    raise GGUFError(f"{path!r} is GGUF version {version}; jaxllm reads versions {VERSIONS}")
  n_tensors = cur.scalar("<Q", "the tensor count")
  n_kv = cur.scalar("<Q", "the metadata count")
  # Each entry takes at least its fixed-size fields: no count can exceed what the file could hold.
  if n_kv > (cur.size - cur.pos) // 12:
    raise cur.fail(f"the header declares {n_kv} metadata entries, more than {cur.size} bytes can hold")
  meta: dict[str, Any] = {}
  for i in range(n_kv):
    key = cur.string(f"metadata key {i}", MAX_NAME, strict=True)
    if key in meta:
      raise cur.fail(f"metadata key {key!r} appears twice")
    meta[key] = cur.value(cur.scalar("<I", f"the value type of {key!r}"), key)
  if n_tensors > (cur.size - cur.pos) // 24:
    raise cur.fail(f"the header declares {n_tensors} tensors, more than {cur.size} bytes can hold")
  infos = []
  for i in range(n_tensors):
    name = cur.string(f"tensor name {i}", MAX_NAME, strict=True)
    n_dims = cur.scalar("<I", f"the dims of tensor {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
      raise cur.fail(f"tensor {name!r} has {n_dims} dims, expected 1 to {MAX_DIMS}")
    dims = [cur.scalar("<Q", f"dim {d} of tensor {name!r}") for d in range(n_dims)]
    qtype = cur.scalar("<I", f"the type of tensor {name!r}")
    offset = cur.scalar("<Q", f"the data offset of tensor {name!r}")
    infos.append((name, dims, qtype, offset))

  alignment = meta.get("general.alignment", DEFAULT_ALIGNMENT)
  if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1 or alignment & (alignment - 1) \
      or alignment > 1 << 20:
    raise GGUFError(f"{path!r}: general.alignment must be a power of two up to 2^20, got {alignment!r}")
  data_start = -(-cur.pos // alignment) * alignment
  tensors: dict[str, _Tensor] = {}
  for name, dims, qtype, offset in infos:
    if name in tensors:
      raise GGUFError(f"{path!r}: tensor {name!r} appears twice")
    try:
      qt = gguf.GGMLQuantizationType(qtype)
      block, type_size = gguf.GGML_QUANT_SIZES[qt]
    except (ValueError, KeyError):
      raise GGUFError(f"{path!r}: tensor {name!r} has type {qtype}, which gguf {_gguf_version()} does not know") from None
    if any(d < 1 for d in dims) or dims[0] % block:
      raise GGUFError(f"{path!r}: tensor {name!r} has dims {dims} (innermost first): each must be >= 1 and the "
                      f"first a multiple of {block}, the {qt.name} block size")
    elements = 1
    for d in dims:
      elements *= d
    nbytes = elements // block * type_size
    if offset % alignment:
      raise GGUFError(f"{path!r}: tensor {name!r} starts at data offset {offset}, not a multiple of the "
                      f"alignment {alignment}")
    end = data_start + offset + nbytes
    if end > cur.size:
      raise GGUFError(f"{path!r} is truncated: tensor {name!r} ends at byte {end}, but the file has {cur.size} bytes")
    tensors[name] = _Tensor(name, qt, tuple(reversed(dims)), data_start + offset, nbytes)
  spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values())
  for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:]):
    if start_b < end_a:
      raise GGUFError(f"{path!r}: the data of tensors {a!r} and {b!r} overlap")
  return version, meta, tensors, cur.types


def _map(path: str) -> mmap.mmap:
  """The file mapped read-only; FileNotFoundError where there is none, GGUFError where it cannot be read or is
  too short to be GGUF."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no such model file: {path!r}")
  try:
    with open(path, "rb") as f:
      size = os.fstat(f.fileno()).st_size
      if size < 4:
        raise GGUFError(f"{path!r} is not a GGUF file: it has {size} bytes")
      return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
  except OSError as e:
    raise GGUFError(f"cannot read {path!r}: {e.strerror or e}") from None


def read_metadata(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, tuple[int, int | None]]]:
  """The metadata of any GGUF file (a model's, or one of metadata alone, a tokenizer's say), parsed and bounded
  as GGUFFile parses it, and each key's types as the file declares them: (gguf.GGUFValueType of the value, of
  an array's items or None). No model is required of it. Raises FileNotFoundError or GGUFError."""
  path = os.fspath(path)
  buf = _map(path)
  try:
    _, meta, _, types = _parse(buf, path)
  finally:
    buf.close()
  return meta, types


def _gguf_version() -> str:
  try:
    from importlib.metadata import version
    return version("gguf")
  except Exception:  # metadata missing in odd installs: the message only loses the version
    return ""


_BLOCK = re.compile(r"blk\.(\d+)\.")


class GGUFFile:
  """A memory-mapped, validated GGUF model file.

  Attributes:
    path: the file.
    metadata: dict of key -> value: Python scalars and strings, a list of str for a string array, a
      read-only 1-D numpy array for a numeric array.
    config: the model Config.
  """

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)
    self._map = _map(self.path)
    self.version, self.metadata, self._tensors, _ = _parse(self._map, self.path)
    try:
      config = Config.from_metadata(self.metadata)
    except ValueError as e:
      raise GGUFError(f"{self.path!r}: {e}") from None
    blocks = {int(m.group(1)) for n in self._tensors if (m := _BLOCK.match(n))}
    if config.n_layers > len(blocks):
      raise GGUFError(f"{self.path!r}: {config.arch}.block_count is {config.n_layers}, but the file has tensors "
                      f"for {len(blocks)} blocks")
    self.config = config.replace(
        tied_embeddings="output.weight" not in self._tensors,
        rope_scaling="llama3" if "rope_freqs.weight" in self._tensors else config.rope_scaling)
    self._check_tensors()

  def expected_shapes(self) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, with its shape in numpy order; optional ones too when present."""
    c = self.config
    q, kv, d, f = c.q_dim, c.kv_dim, c.d_model, c.d_ff
    need = {"token_embd.weight": (c.vocab_size, d), "output_norm.weight": (d,)}
    if "output.weight" in self._tensors:
      need["output.weight"] = (c.vocab_size, d)
    if "rope_freqs.weight" in self._tensors:
      need["rope_freqs.weight"] = (c.head_dim // 2,)
    for i in range(c.n_layers):
      p = f"blk.{i}."
      need.update({p + "attn_norm.weight": (d,), p + "attn_q.weight": (q, d), p + "attn_k.weight": (kv, d),
                   p + "attn_v.weight": (kv, d), p + "attn_output.weight": (d, q), p + "ffn_norm.weight": (d,),
                   p + "ffn_gate.weight": (f, d), p + "ffn_up.weight": (f, d), p + "ffn_down.weight": (d, f)})
      if c.qkv_bias:
        need.update({p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,)})
      if c.qk_norm:
        need.update({p + "attn_q_norm.weight": (c.head_dim,), p + "attn_k_norm.weight": (c.head_dim,)})
    return need

  def _check_tensors(self):
    c = self.config
    need = self.expected_shapes()
    missing = [n for n in need if n not in self._tensors]
    if missing:
      raise GGUFError(f"{self.path!r} lacks tensors a {c.arch} model needs: {missing[:5]}"
                      + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    for name, shape in need.items():
      got = self._tensors[name].shape
      if got != shape:
        raise GGUFError(f"{self.path!r}: tensor {name!r} has shape {list(got)}, but the metadata's {c.arch} "
                        f"config needs {list(shape)}")
    checked = set()
    for name in need:
      t = self._tensors[name]
      if t.type not in checked:
        self._check_dequantizable(t)
        checked.add(t.type)

  def _check_dequantizable(self, t: _Tensor) -> None:
    """Dequantizes one block of `t`, so an unsupported type fails at load time with a clear message."""
    type_size = gguf.GGML_QUANT_SIZES[t.type][1]
    try:
      gguf.quants.dequantize(self._bytes(t)[:type_size], t.type)
    except (NotImplementedError, KeyError, ValueError) as e:
      raise GGUFError(f"tensor {t.name!r} has type {t.type.name}, which jaxllm cannot dequantize "
                      f"(gguf {_gguf_version()} says: {e})") from None

  def _bytes(self, t: _Tensor) -> np.ndarray:
    return np.frombuffer(self._map, np.uint8, t.nbytes, t.offset)

  def __contains__(self, name: str) -> bool:
    return name in self._tensors

  def tensor_names(self) -> list[str]:
    return list(self._tensors)

  def tensor_type(self, name: str) -> str:
    return self._tensors[name].type.name

  def tensor_shape(self, name: str) -> tuple[int, ...]:
    return self._tensors[name].shape

  def tensor_nbytes(self, name: str) -> int:
    """The bytes the file stores the tensor in."""
    return self._tensors[name].nbytes

  def tensor(self, name: str) -> np.ndarray:
    """The tensor dequantized to float32, in numpy dim order (outermost first)."""
    t = self._tensors[name]
    rows = int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else 1
    raw = self._bytes(t).reshape(rows, -1)
    data = gguf.quants.dequantize(raw, t.type)
    return np.asarray(data, np.float32).reshape(t.shape)

  def tensor_blocks(self, name: str) -> np.ndarray:
    """A 2-D tensor's bytes as the file stores them: [rows, bytes a row] uint8 (a view of the mapping)."""
    t = self._tensors[name]
    return self._bytes(t).reshape(t.shape[0], -1)

  def tensor_rows(self, name: str, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of a 2-D tensor dequantized to float32 [stop - start, K]."""
    t = self._tensors[name]
    rows, k = t.shape
    row_bytes = t.nbytes // rows
    raw = np.frombuffer(self._map, np.uint8, (stop - start) * row_bytes, t.offset + start * row_bytes)
    return np.asarray(gguf.quants.dequantize(raw.reshape(stop - start, row_bytes), t.type), np.float32).reshape(-1, k)

  def release(self, name: str) -> None:
    """Tells the kernel the tensor's pages are not needed again (they leave this process's resident set)."""
    t = self._tensors[name]
    page = mmap.PAGESIZE
    start = t.offset // page * page
    end = -(-(t.offset + t.nbytes) // page) * page
    if hasattr(mmap, "MADV_DONTNEED") and end > start:
      self._map.madvise(mmap.MADV_DONTNEED, start, min(end, len(self._map)) - start)

  def tensor_types(self) -> dict[str, int]:
    """How many tensors of each type the file holds."""
    counts: dict[str, int] = {}
    for t in self._tensors.values():
      counts[t.type.name] = counts.get(t.type.name, 0) + 1
    return counts
