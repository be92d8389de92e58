"""GGUF files are untrusted: the committed corpus of malformed files and a fuzz test of the loader.

Every malformed file must end in a GGUFError whose message says what was expected and what was found,
within a second and in bounded memory: never a hang, a traceback of another kind, or a crash. The corpus
is written by tests/gguf_corpus.py (a byte-level writer that shares no code with jaxllm's reader).
"""
import json
import os
import re
import struct
import tempfile
import time
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gguf_corpus
from jaxllm import GGUFError
from jaxllm.generate import main as cli_main
from jaxllm.load import read_model

CORPUS = gguf_corpus.CORPUS
CASES = json.loads((CORPUS / "manifest.json").read_text())
VALID = (CORPUS / "valid_micro.gguf.bin").read_bytes()
SECONDS, PEAK_BYTES = 1.0, 64 << 20


def _open_bounded(path):
  """read_model(path) -> (error or None, seconds, peak bytes Python allocated meanwhile)."""
  tracemalloc.start()
  t0 = time.perf_counter()
  try:
    read_model(path)
    err = None
  except GGUFError as e:
    err = e
  finally:
    elapsed = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
  return err, elapsed, peak


def test_corpus_is_what_the_writer_writes():
  """The committed files are the builder's output (so each case is the defect its name says)."""
  cases = gguf_corpus.cases()
  assert sorted(cases) == sorted(CASES)
  for name, (data, pattern) in cases.items():
    assert (CORPUS / name).read_bytes() == data, name
    assert CASES[name] == pattern
  assert gguf_corpus.build() == VALID


def test_the_valid_micro_model_loads(tmp_path):
  p = tmp_path / "micro.gguf"
  p.write_bytes(VALID)
  gf, tok = read_model(p)
  assert gf.config.n_layers == 1 and gf.config.vocab_size == tok.vocab_size == 32
  assert gf.tensor("blk.0.ffn_down.weight").shape == (16, 32)


@pytest.mark.parametrize("name", sorted(CASES))
def test_corpus_file_fails_cleanly(name):
  err, elapsed, peak = _open_bounded(CORPUS / name)
  assert err is not None, f"{name} loaded without an error"
  assert re.search(CASES[name], str(err)), (name, str(err))
  assert elapsed < SECONDS, (name, elapsed)
  assert peak < PEAK_BYTES, (name, peak)


def test_a_large_numeric_metadata_array_costs_its_own_bytes(tmp_path):
  """A valid file whose metadata holds a 2^24-item int8 array (16 MiB in the file): reading it needs about
  that much memory, not a Python object per item (a list of them was ~8x the file's bytes and more)."""
  import numpy as np
  from jaxllm import GGUFFile
  n = 1 << 24
  meta = gguf_corpus.micro_metadata()
  raw = gguf_corpus.s("general.padding") + struct.pack("<IIQ", gguf_corpus.ARR, 1, n) + bytes(range(256)) * (n // 256)
  body = gguf_corpus.build(meta + [("x", gguf_corpus.U32, 0)])
  # The extra key is spliced in by hand (the corpus writer builds arrays item by item, slow at 2^24 items).
  marker = gguf_corpus.kv("x", gguf_corpus.U32, 0)
  body = body.replace(marker, raw, 1)
  path = tmp_path / "big-meta.gguf"
  path.write_bytes(body)
  tracemalloc.start()
  try:
    gf = GGUFFile(path)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  arr = gf.metadata["general.padding"]
  assert isinstance(arr, np.ndarray) and arr.dtype == np.int8 and arr.shape == (n,) and not arr.flags.writeable
  assert arr[:3].tolist() == [0, 1, 2] and int(arr[255]) == -1
  assert peak < 2 * n, peak


@pytest.mark.parametrize("name", ["head_count_0.gguf", "block_count_2e32.gguf", "huge_array_count_68.gguf"])
def test_cli_reports_a_bad_file_as_an_error(name):
  """The CLI prints `error: ...` (SystemExit with the message), not a traceback."""
  with pytest.raises(SystemExit) as info:
    cli_main([str(CORPUS / name), "--prompt", "hi"])
  assert str(info.value).startswith("error: ") and re.search(CASES[name], str(info.value))


# ---- fuzzing ------------------------------------------------------------------------------------------

def _field_offsets(data: bytes) -> list[int]:
  """Offsets of the header's length and count fields (8-byte values), where a wrong number does most harm."""
  offsets = [8, 16]
  pos = 24
  try:
    n_kv = struct.unpack_from("<Q", data, 16)[0]
    for _ in range(n_kv):
      offsets.append(pos)
      pos += 8 + struct.unpack_from("<Q", data, pos)[0]
      vtype = struct.unpack_from("<I", data, pos)[0]
      pos += 4
      if vtype == gguf_corpus.STR:
        offsets.append(pos)
        pos += 8 + struct.unpack_from("<Q", data, pos)[0]
      elif vtype == gguf_corpus.ARR:
        item, count = struct.unpack_from("<IQ", data, pos)
        offsets.append(pos + 4)
        pos += 12
        for _ in range(count):
          if item == gguf_corpus.STR:
            pos += 8 + struct.unpack_from("<Q", data, pos)[0]
          else:
            pos += struct.calcsize(gguf_corpus._FMT[item])
      else:
        pos += struct.calcsize(gguf_corpus._FMT[vtype])
  except struct.error:
    pass
  return offsets


FIELDS = _field_offsets(VALID)
NUMBERS = [0, 1, 2, 3, 5, 31, 255, 1 << 16, 1 << 31, 1 << 32, (1 << 32) - 1, 1 << 62, 1 << 63, (1 << 64) - 1]


@st.composite
def mutated(draw):
  data = bytearray(VALID)
  for _ in range(draw(st.integers(1, 4))):
    kind = draw(st.sampled_from(["flip", "truncate", "number", "insert", "delete", "splice"]))
    if not data:
      break
    at = draw(st.integers(0, len(data) - 1))
    if kind == "flip":
      data[at] ^= 1 << draw(st.integers(0, 7))
    elif kind == "truncate":
      del data[at:]
    elif kind == "number":
      where = draw(st.sampled_from(FIELDS)) if draw(st.booleans()) else at
      value = draw(st.sampled_from(NUMBERS) | st.integers(0, (1 << 64) - 1))
      data[where:where + 8] = struct.pack("<Q", value)
    elif kind == "insert":
      data[at:at] = draw(st.binary(min_size=1, max_size=16))
    elif kind == "delete":
      del data[at:at + draw(st.integers(1, 64))]
    else:
      src = draw(st.integers(0, len(data) - 1))
      data[at:at + 16] = data[src:src + 16]
  return bytes(data)


@settings(max_examples=int(os.environ.get("JAXLLM_FUZZ_EXAMPLES", "300")), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_fuzz_mutations_of_a_valid_file(data):
  """A mutated file either loads or fails with a GGUFError, in bounded time and memory (JAXLLM_FUZZ_EXAMPLES
  sets how many; CI runs the derandomized 300)."""
  with tempfile.NamedTemporaryFile(suffix=".gguf", delete=False) as f:
    f.write(data)
  try:
    err, elapsed, peak = _open_bounded(f.name)
  finally:
    os.unlink(f.name)
  assert elapsed < SECONDS and peak < PEAK_BYTES, (elapsed, peak)
  if err is not None:
    assert len(str(err)) > 20


@settings(max_examples=int(os.environ.get("JAXLLM_FUZZ_EXAMPLES", "300")) // 2, deadline=None, derandomize=True)
@given(st.binary(max_size=200))
def test_fuzz_random_headers(tail):
  """Random bytes after a valid magic and version."""
  with tempfile.NamedTemporaryFile(suffix=".gguf", delete=False) as f:
    f.write(b"GGUF" + struct.pack("<I", 3) + tail)
  try:
    err, elapsed, peak = _open_bounded(f.name)
  finally:
    os.unlink(f.name)
  assert err is not None and elapsed < SECONDS and peak < PEAK_BYTES


def test_read_metadata_gives_the_declared_types_and_refuses_as_the_file_reader(tmp_path):
  """jaxllm.gguf.read_metadata (bench/peers/random_gguf.py copies a tokenizer with it): the values GGUFFile reads
  and each key's value and item types as gguf's own reader sees them; a truncated file is the same GGUFError."""
  import gguf
  from jaxllm.gguf import GGUFFile, read_metadata
  from tiny import write_tiny_model
  path = write_tiny_model(tmp_path / "tiny.gguf", "qwen2")
  meta, types = read_metadata(path)
  assert meta.keys() == GGUFFile(path).metadata.keys() == types.keys()
  for key, field in gguf.GGUFReader(path).fields.items():
    if key.startswith("GGUF."):                          # the reader's own entries for the header's counts
      continue
    want = (field.types[0], field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    assert types[key] == want, key
  assert {types[k][0] for k in types} >= {gguf.GGUFValueType.STRING, gguf.GGUFValueType.UINT32,
                                          gguf.GGUFValueType.ARRAY}
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(open(path, "rb").read()[:2000])
  with pytest.raises(GGUFError) as a:
    read_metadata(cut)
  with pytest.raises(GGUFError) as b:
    GGUFFile(cut)
  assert str(a.value) == str(b.value) and "truncated" in str(a.value)
