"""Bad input gets a clear error that says what was expected and what was given."""
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
