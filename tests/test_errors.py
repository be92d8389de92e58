"""Bad input gets a clear error that says what was expected and what was given."""
import time

import gguf
import numpy as np
import pytest

from jaxllm import Engine, GGUFError, GGUFFile, Tokenizer, fetch_demo_model
from jaxllm.generate import main as cli_main
from jaxllm.weights import load_weights
from tiny import write_tiny_model


def test_not_a_gguf_file(tmp_path):
  p = tmp_path / "model.gguf"
  p.write_bytes(b"PK\x03\x04 this is a zip, not a model")
  with pytest.raises(GGUFError, match=r"not a GGUF file: it starts with b'PK\\x03\\x04', expected b'GGUF'"):
    GGUFFile(p)


def test_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="no such model file"):
    GGUFFile(tmp_path / "absent.gguf")


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.95])
def test_truncated_file(tmp_path, keep):
  full = write_tiny_model(tmp_path / "full.gguf", "qwen2")
  data = open(full, "rb").read()
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(data[: int(len(data) * keep)])
  with pytest.raises(GGUFError, match="truncated"):
    GGUFFile(cut)


def test_unsupported_architecture(tmp_path):
  p = tmp_path / "gpt2.gguf"
  w = gguf.GGUFWriter(str(p), "gpt2")
  w.add_uint32("gpt2.block_count", 1)
  w.add_tensor("token_embd.weight", np.ones((4, 4), np.float32))
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
  with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
    GGUFFile(p)


def _rewrite(src: str, dst, arch: str, tensor=lambda name, data: data) -> None:
  """Copies a GGUF file's metadata and tensors to dst; tensor(name, data) may change or drop (None) one."""
  r = gguf.GGUFReader(src)
  w = gguf.GGUFWriter(str(dst), arch)
  for k, f in r.fields.items():
    if k.startswith("GGUF.") or k == "general.architecture":
      continue
    vtype = f.types[0]
    w.add_key_value(k, f.contents(), vtype, sub_type=f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
  for t in r.tensors:
    data = tensor(t.name, np.asarray(t.data))
    if data is not None:
      w.add_tensor(t.name, data)
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def test_unsupported_tensor_type(tmp_path):
  """A tensor type that gguf cannot dequantize (I32 here) fails at load time, naming the tensor."""
  bad = tmp_path / "bad.gguf"
  _rewrite(write_tiny_model(tmp_path / "ok.gguf", "llama"), bad, "llama",
           lambda name, data: data.astype(np.int32) if name == "blk.0.ffn_up.weight" else data)
  with pytest.raises(GGUFError, match=r"tensor 'blk.0.ffn_up.weight' has type I32, which jaxllm cannot dequantize"):
    GGUFFile(bad)


def test_missing_tensor(tmp_path):
  bad = tmp_path / "bad.gguf"
  _rewrite(write_tiny_model(tmp_path / "ok.gguf", "qwen3"), bad, "qwen3",
           lambda name, data: None if name == "blk.1.attn_k_norm.weight" else data)
  with pytest.raises(GGUFError, match=r"lacks tensors a qwen3 model needs: \['blk.1.attn_k_norm.weight'\]"):
    GGUFFile(bad)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
  path = write_tiny_model(tmp_path_factory.mktemp("e") / "m.gguf", "qwen2")
  gf = GGUFFile(path)
  return Engine(gf.config, load_weights(gf, progress=False), Tokenizer(gf.metadata), max_context=32,
                kernels="xla")


def test_prompt_longer_than_context(engine):
  with pytest.raises(ValueError, match="the prompt has 40 tokens but the context holds 32"):
    engine.generate(list(range(40)), 4)
  with pytest.raises(ValueError, match="the prompt has 32 tokens but the context holds 32"):
    engine.generate(list(range(32)), 4)


def test_empty_prompt_and_bad_ids(engine):
  with pytest.raises(ValueError, match="the prompt is empty"):
    engine.generate([], 4)
  with pytest.raises(ValueError, match=r"must be integers in \[0, 262\), got \[999\]"):
    engine.generate([1, 999], 4)
  with pytest.raises(ValueError, match="max_tokens must be an integer >= 1, got 0"):
    engine.generate([1, 2], 0)


def test_engine_still_works_after_errors(engine):
  result = engine.generate([5, 6, 7], 4, ignore_eos=True)
  assert len(result.ids) == 4


def test_unknown_demo_model():
  with pytest.raises(ValueError, match=r"unknown demo model 'llama-9000': choose one of \['qwen2.5-coder-0.5b', 'smollm2-135m'\]"):
    fetch_demo_model("llama-9000")


def test_cli_reports_errors(capsys, tmp_path):
  path = write_tiny_model(tmp_path / "m.gguf", "llama")
  with pytest.raises(SystemExit, match="unknown demo model 'nope'"):
    cli_main(["nope", "--prompt", "hi"])
  with pytest.raises(SystemExit, match=r"top_p must be in \(0, 1\], got 2.0"):
    cli_main([path, "--prompt", "hi", "--top-p", "2"])
  with pytest.raises(SystemExit, match="the prompt has 6 tokens but the context holds 4"):
    cli_main([path, "--prompt", "abcdef", "--max-context", "4"])
  with pytest.raises(SystemExit, match="--max-tokens must be >= 1, got 0"):
    cli_main([path, "--prompt", "hi", "--max-tokens", "0"])
  with pytest.raises(SystemExit, match="no such model file"):
    cli_main([str(tmp_path / "missing.gguf"), "--prompt", "hi"])


def test_cli_rejects_hostile_text_inputs(tmp_path, capsys):
  path = write_tiny_model(tmp_path / "m.gguf", "llama")
  bad = tmp_path / "bad.txt"
  bad.write_bytes(b"fine line\n\xff\xfe not utf-8\n")
  with pytest.raises(SystemExit, match=r"--prompts-file .* is not UTF-8 text: byte b'\\xff' at offset 10"):
    cli_main([path, "--prompts-file", str(bad)])
  with pytest.raises(SystemExit, match=r"--file .* is not UTF-8 text"):
    cli_main([path, "-f", str(bad)])
  with pytest.raises(SystemExit, match=r"cannot read --file"):
    cli_main([path, "-f", str(tmp_path / "absent.txt")])
  t0 = time.monotonic()
  with pytest.raises(SystemExit, match=r"--file '/dev/zero' is longer than \d+ bytes"):
    cli_main([path, "-f", "/dev/zero"])                           # endless: read up to the bound, then refused
  assert time.monotonic() - t0 < 5
  with pytest.raises(SystemExit, match=r"the text is not valid Unicode: surrogates not allowed at position 1"):
    cli_main([path, "-p", "a\udcff", "-q"])                       # what undecodable argv bytes become
  with pytest.raises(SystemExit, match="is a directory"):
    cli_main([str(tmp_path), "-p", "hi"])
  with pytest.raises(SystemExit, match="-i reads its prompts from the terminal"):
    cli_main([path, "-i", "-p", "hi"])
  with pytest.raises(SystemExit, match=r"--seed must be in \[0, 2\^63\) or -1 \(random\), got -2"):
    cli_main([path, "-p", "hi", "--seed", "-2"])                 # -1 is llama.cpp's "random"


def test_a_broken_chat_template_is_a_clear_error(tmp_path):
  good = write_tiny_model(tmp_path / "ok.gguf", "qwen2")
  broken = tmp_path / "broken.gguf"
  r = gguf.GGUFReader(good)
  w = gguf.GGUFWriter(str(broken), "qwen2")
  for k, f in r.fields.items():
    if k.startswith("GGUF.") or k == "general.architecture":
      continue
    value = "{% for m in messages %}{{ m.content | nosuchfilter }}" if k == "tokenizer.chat_template" else f.contents()
    vtype = f.types[0]
    w.add_key_value(k, value, vtype, sub_type=f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
  for t in r.tensors:
    w.add_tensor(t.name, np.asarray(t.data))
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
  with pytest.raises(SystemExit, match="the model.s chat template failed: TemplateSyntaxError: Unexpected end of template"):
    cli_main([str(broken), "--chat", "-p", "hi", "-q"])


def test_engine_serves_one_request_at_a_time(engine):
  """A second request while a stream is suspended closes the abandoned stream (its cache comes back); a
  request from another thread while one computes is refused with a clear error."""
  import threading
  stream = engine.stream_tokens([[5, 6, 7]], 10, ignore_eos=True)
  next(stream)
  assert engine._cache is None                               # the suspended stream holds the cache
  assert len(engine.generate([5, 6, 7], 4, ignore_eos=True).ids) == 4
  assert list(stream) == []                                  # the abandoned stream was closed
  errors = []
  started, release = threading.Event(), threading.Event()

  def slow_text(piece):
    started.set()
    release.wait(10)

  def first():
    engine.generate([1, 2, 3], 6, ignore_eos=True, on_text=slow_text)

  t = threading.Thread(target=first)
  t.start()
  started.wait(10)
  try:
    try:
      engine.generate([4, 5], 2)
    except RuntimeError as e:
      errors.append(str(e))
  finally:
    release.set()
    t.join(30)
  assert errors and "running a request in another thread" in errors[0]
  assert len(engine.generate([5, 6, 7], 3, ignore_eos=True).ids) == 3   # and it still works


def test_a_cache_that_cannot_fit_fails_before_allocating(engine):
  """Asking for a context whose KV cache exceeds the device's free memory fails at once, with the size."""
  with pytest.raises(ValueError, match=r"a KV cache of 1000000000 tokens x batch 1 needs [0-9.]+ GiB .* but the "
                                       r"device has [0-9.]+ GiB free"):
    Engine(engine.config, engine.weights, engine.tokenizer, max_context=10**9)


def test_cli_summary_says_what_is_true_about_graphs(tmp_path, capsys):
  import jax
  path = write_tiny_model(tmp_path / "m.gguf", "llama")
  cli_main([path, "-p", "hi", "-n", "2", "--ignore-eos"])
  err = capsys.readouterr().err
  want = "graphs=n/a (cpu)" if jax.default_backend() == "cpu" else "graphs=on"
  assert want in err, err


@pytest.mark.parametrize("key, value, says", [
    ("tokenizer.ggml.pre", np.array([1, 2], np.int32), r"tokenizer.ggml.pre must be a string, got ndarray"),
    ("tokenizer.ggml.add_bos_token", np.array([1, 0], np.uint8),
     r"tokenizer.ggml.add_bos_token must be a boolean, got ndarray"),
    ("tokenizer.ggml.token_type", np.ones(1 << 20, np.int32), r"token_type has 1048576 entries, but there are"),
    ("tokenizer.ggml.token_type", np.ones(3, np.float32), r"token_type must be a list of integers, got float32"),
])
def test_numeric_metadata_arrays_where_the_tokenizer_wants_other_values(tmp_path, key, value, says):
  """GGUFFile gives a numeric metadata array as a numpy array: where the tokenizer expects a string, a flag or
  as many types as tokens, the error names the key (an array in a boolean test raised numpy's "truth value
  of an array is ambiguous", naming nothing)."""
  metadata = dict(GGUFFile(write_tiny_model(tmp_path / "m.gguf", "llama")).metadata)
  metadata[key] = value
  with pytest.raises(ValueError, match=says):
    Tokenizer(metadata)
