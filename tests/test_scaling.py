"""The scaling study's tooling: bench/peers/random_gguf.py (random Q8_0 / Q4_0 / Q4_K GGUFs of the presets) and
bench/scaling.py (llama.cpp's output parsers, the report and its 3% check, one whole run on the tiny preset with
fake llama.cpp binaries). The llama.cpp samples follow llama.cpp's printers as vendored in llama-cpp-python
0.3.36 (tools/llama-bench/llama-bench.cpp's jsonl_printer, tools/batched-bench/batched-bench.cpp's table)."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _module(path: Path):
  """A bench script as a module, loaded from its file: bench/ stays off sys.path, where its kernels.py would
  shadow the `kernels` package transformers looks for (test_hf and test_presets then failed to import it)."""
  import importlib.util
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[path.stem] = module
  spec.loader.exec_module(module)
  return module


random_gguf = _module(ROOT / "bench" / "peers" / "random_gguf.py")
scaling = _module(ROOT / "bench" / "scaling.py")

from tiny import write_tiny_model  # noqa: E402

import jax  # noqa: E402

from jaxllm.presets import PRESETS  # noqa: E402

PLATFORM = jax.devices()[0].platform        # what the bench records as env.platform ("cpu", "gpu")

# One decode test and one prompt test of `llama-bench -o jsonl` (every field of test::get_fields, in order).
LLAMA_BENCH_JSONL = "".join(
    '{"build_commit": "3a3bd8a", "build_number": 1, "cpu_info": "AMD EPYC 9654 96-Core Processor", '
    '"gpu_info": "NVIDIA H200", "backends": "CUDA", "model_filename": "gguf/qwen2.5-7b-Q8_0.gguf", '
    '"model_type": "qwen2 7B Q8_0", "model_size": 8098525184, "model_n_params": 7615616512, "n_batch": 2048, '
    '"n_ubatch": 512, "n_threads": 8, "cpu_mask": "0x0", "cpu_strict": false, "poll": 50, "type_k": "f16", '
    '"type_v": "f16", "n_gpu_layers": 99, "n_cpu_moe": 0, "split_mode": "layer", "main_gpu": 0, '
    '"no_kv_offload": false, "flash_attn": 1, "devices": "auto", "tensor_split": "0.00", '
    '"tensor_buft_overrides": "none", "load_mode": "mmap", "lazy_mode": "auto", "embeddings": false, '
    f'"no_op_offload": 0, "no_host": false, "repack": true, "fit_target": 1024, "fit_min_ctx": 4096, '
    f'"n_prompt": {p}, "n_gen": {g}, "n_depth": 0, "test_time": "2026-12-05T09:12:40Z", "avg_ns": {ns}, '
    f'"stddev_ns": 1210453, "avg_ts": {ts}, "stddev_ts": 0.612734, "samples_ns": [ {ns}, {ns}, {ns} ],'
    f'"samples_ts": [ {ts}, {ts}, {ts} ]}}\n'
    for p, g, ns, ts in ((512, 0, 48512000, 10554.08), (0, 128, 496432000, 257.836)))

BATCHED_BENCH_MD = """\
llama_model_loader: loaded meta data with 30 key-value pairs and 339 tensors from gguf/qwen2.5-7b-Q8_0.gguf
load_tensors: offloaded 29/29 layers to GPU

llama_batched_bench: n_kv_max = 16640, n_batch = 2048, n_ubatch = 512, flash_attn = 1, is_pp_shared = 0, \
is_tg_separate = 0, n_gpu_layers = 99, n_threads = 8, n_threads_batch = 8

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |    128 |    1 |    256 |    0.021 |  6095.24 |    0.490 |   261.22 |    0.511 |   500.98 |
|   128 |    128 |   16 |   4096 |    0.142 | 14422.54 |    0.980 |  2089.80 |    1.122 |  3650.62 |
|   128 |    128 |   64 |  16384 |    0.521 | 15723.61 |    1.556 |  5264.78 |    2.077 |  7888.30 |

llama_perf_context_print:        load time =    1534.12 ms
llama_perf_context_print:       total time =    5034.71 ms / 20736 tokens
"""

BATCHED_BENCH_JSONL = (
    '{"n_kv_max": 16448, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 1, "is_pp_shared": 0, "n_gpu_layers": 99, '
    '"n_threads": 8, "n_threads_batch": 8, "pp": 128, "tg": 128, "pl": 16, "n_kv": 4096, "t_pp": 0.142000, '
    '"speed_pp": 14422.540000, "t_tg": 0.980000, "speed_tg": 2089.800000, "t": 1.122000, "speed": 3650.620000}\n')


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
  """A vocabulary file from the tiny test tokenizer (262 tokens), as `random_gguf.py vocab` writes it."""
  d = tmp_path_factory.mktemp("vocab")
  random_gguf.main(["vocab", write_tiny_model(d / "tiny.gguf", "llama"), str(d / "vocab.gguf")])
  return str(d / "vocab.gguf")


def _dequantized(path):
  return {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(s) for s in reversed(t.shape)])
          for t in gguf.GGUFReader(path).tensors}, {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q5_0", "Q4_K"])
def test_blocks_dequantize_to_the_intended_spread(kind):
  rng = np.random.default_rng(1)
  raw = random_gguf._BLOCKS[kind](rng, 64, 512)
  w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
  assert w.shape == (64, 512) and np.isfinite(w).all()
  assert 0.019 < w.std() < 0.021, w.std()
  assert abs(w.mean()) < 0.003, w.mean()
  assert len({round(float(v), 6) for v in w[0]}) > 8      # random values, not one repeated


def test_q4_k_packing_is_ggmls_layout():
  """Chosen 6-bit scales, mins and values come back through gguf's own Q4_K dequantizer."""
  rng = np.random.default_rng(2)
  n = 6
  d = rng.uniform(1e-4, 1e-3, n).astype(np.float16)
  dmin = rng.uniform(1e-4, 1e-3, n).astype(np.float16)
  sc, mn = rng.integers(0, 64, (n, 8)), rng.integers(0, 64, (n, 8))
  q = rng.integers(0, 16, (n, 256))
  raw = random_gguf.pack_q4_k(d, dmin, sc, mn, q)
  assert raw.shape == (n, 144)
  got = gguf.quants.dequantize(raw.reshape(1, -1), gguf.GGMLQuantizationType.Q4_K).reshape(n, 256)
  group = np.repeat(np.arange(8), 32)
  want = (d.astype(np.float32)[:, None] * sc[:, group] * q
          - dmin.astype(np.float32)[:, None] * mn[:, group])
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  with pytest.raises(ValueError, match="6-bit"):
    random_gguf.pack_q4_k(d, dmin, sc + 64, mn, q)


@pytest.mark.parametrize("qtype", random_gguf.TYPES)
def test_tiny_model_reads_back_and_jaxllm_runs_it(qtype, vocab, tmp_path, capsys):
  out = str(tmp_path / f"{qtype}.gguf")
  random_gguf.main(["model", "tiny", vocab, out, "--type", qtype])
  c = PRESETS["tiny"]
  values, types = _dequantized(out)
  assert values["token_embd.weight"].shape == (c.vocab_size, c.d_model)
  assert values["blk.1.ffn_down.weight"].shape == (c.d_model, c.d_ff)
  assert values["blk.0.attn_k.weight"].shape == (c.kv_dim, c.d_model)
  assert "output.weight" not in values                     # tied, as smollm2's
  mats = [n for n in values if values[n].ndim == 2]
  for name in mats:
    assert np.isfinite(values[name]).all(), name
    assert 0.018 < values[name].std() < 0.022, (name, values[name].std())
  # Q4_K where K is a multiple of 256 (ffn_down: d_ff 1536), llama-quantize's Q5_0 elsewhere (d_model 576)
  want = {"Q4_K": {"blk.0.ffn_down.weight": "Q4_K", "blk.0.ffn_up.weight": "Q5_0"}}.get(qtype, {n: qtype for n in mats})
  assert {n: types[n] for n in want} == want
  r = gguf.GGUFReader(out)
  assert len(r.fields["tokenizer.ggml.tokens"].contents()) == c.vocab_size         # padded from 262
  assert r.fields["tokenizer.ggml.tokens"].contents()[-1] == f"[PAD{c.vocab_size - 1}]"
  from jaxllm.generate import main as generate
  assert generate([out, "-p", "hi", "-n", "2", "--quiet"]) == 0


@pytest.mark.parametrize("name", sorted(n for n in PRESETS if n != "tiny"))
def test_every_preset_reads_back_as_its_config(name, vocab, tmp_path, monkeypatch):
  """Each preset's family keys (llama3 RoPE factors, q/k norms, biases, head dims) give jaxllm the preset's
  Config back; one layer, a small FFN and vocabulary keep the files small."""
  from jaxllm.gguf import GGUFFile
  from jaxllm.rope import llama3_rope_freqs
  small = PRESETS[name].replace(n_layers=1, d_ff=256, vocab_size=300)
  monkeypatch.setitem(PRESETS, "small", small)
  out = str(tmp_path / "small.gguf")
  random_gguf.write_model("small", vocab, out, "Q8_0")
  f = GGUFFile(out)
  f32 = {k: float(np.float32(getattr(small, k))) for k in ("rms_eps", "rope_base")}   # GGUF holds them as f32
  assert dataclasses.replace(f.config, bos_id=None, eos_id=None) == small.replace(**f32)
  assert set(f.expected_shapes()) <= set(f.tensor_names())
  if small.rope_scaling == "llama3":
    np.testing.assert_array_equal(f.tensor("rope_freqs.weight"), np.asarray(llama3_rope_freqs(small)))
    assert f.metadata["llama.rope.dimension_count"] == small.head_dim
  tokens = f.metadata["tokenizer.ggml.tokens"]
  assert len(tokens) == 300 and tokens[:262] == gguf.GGUFReader(vocab).fields["tokenizer.ggml.tokens"].contents()


def test_the_writer_process_stays_off_the_gpu(vocab, tmp_path):
  """Run as a script (bench/scaling.py runs it beside the measured jaxllm process), the writer keeps jax on the CPU
  even where the environment names the GPU: on the H100 its llama3 RoPE factors started the GPU's client, whose
  preallocation left the llama-3.1-8b batch-1 run beside it out of memory."""
  script = ROOT / "bench" / "peers" / "random_gguf.py"
  out = tmp_path / "small.gguf"
  code = (f"import runpy, sys; sys.argv = ['random_gguf.py', 'model', 'tiny', {vocab!r}, {str(out)!r}]\n"
          f"try:\n  runpy.run_path({str(script)!r}, run_name='__main__')\n"
          "except SystemExit as e:\n  assert not e.code, e\n"
          "import os, jax; print(os.environ['JAX_PLATFORMS'], jax.default_backend())")
  env = dict(os.environ, JAX_PLATFORMS="cuda")
  r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.split() == ["cpu", "cpu"] and out.stat().st_size > 0


def test_a_cut_vocabulary_drops_merges_and_ids_past_it(vocab):
  fields = random_gguf.tokenizer_fields(vocab)
  cut = random_gguf.resize_tokenizer(fields, 258)          # the 256 bytes and two of the three merges' results
  tokens = cut["tokenizer.ggml.tokens"][0]
  assert len(tokens) == 258 == len(cut["tokenizer.ggml.token_type"][0])
  assert all(m.replace(" ", "") in tokens for m in cut["tokenizer.ggml.merges"][0])
  assert len(cut["tokenizer.ggml.merges"][0]) == 2
  assert "tokenizer.ggml.eos_token_id" not in cut        # <|im_end|> was past the cut


def test_bad_input_is_one_line(vocab, tmp_path, capsys):
  def err(*argv):
    with pytest.raises(SystemExit) as e:
      random_gguf.main(list(argv))
    return str(e.value.code) if e.value.code != 2 else capsys.readouterr().err.strip().splitlines()[-1]
  assert err("model", "nope-7b", vocab, "x.gguf").startswith("error: unknown synthetic preset 'nope-7b'")
  assert err("model", "tiny", "missing.gguf", "x.gguf") == \
      "error: no vocabulary file 'missing.gguf' (write one with `random_gguf.py vocab MODEL FILE`)"
  assert "invalid choice: 'Q2_K'" in err("model", "tiny", vocab, "x.gguf", "--type", "Q2_K")
  assert err("vocab", str(tmp_path / "none.gguf"), "v.gguf").startswith("error: ")
  assert err("model", "tiny", vocab, str(tmp_path / "no" / "dir" / "x.gguf")).startswith("error: [Errno 2]")


@pytest.mark.network
def test_the_real_qwen_vocabulary_cut_and_padded(tmp_path, monkeypatch):
  """The demo model's 151936-token Qwen tokenizer cut to Llama 3's 128256 and padded to Qwen2.5-7B's 152064
  (small shapes otherwise): jaxllm's tokenizer reads both files and encodes text the same."""
  from jaxllm.gguf import GGUFFile
  from jaxllm.tokenizer import Tokenizer
  vocab = str(tmp_path / "vocab.gguf")
  random_gguf.main(["vocab", "qwen2.5-coder-0.5b", vocab])
  ids = []
  for n in (128256, 152064):
    monkeypatch.setitem(PRESETS, "small", PRESETS["tiny"].replace(arch="qwen2", qkv_bias=True, vocab_size=n))
    out = str(tmp_path / f"{n}.gguf")
    random_gguf.write_model("small", vocab, out, "Q4_0")
    f = GGUFFile(out)
    assert f.config.vocab_size == n
    ids.append(Tokenizer(f.metadata).encode("def hello_world():\n  return 42"))
  assert ids[0] == ids[1] and max(ids[0]) < 128256


def test_llama_bench_jsonl_parses():
  recs = scaling.parse_llama_bench("ggml_cuda_init: found 1 CUDA devices:\n" + LLAMA_BENCH_JSONL, "qwen2.5-7b", "Q8_0")
  assert len(recs) == 1                                   # the prompt test is not decode
  r = recs[0]
  assert (r["peer"], r["batch"], r["quant"], r["decode_len"]) == ("llama-bench", 1, "Q8_0", 128)
  assert r["decode_tok_s_total"] == pytest.approx(257.836)
  assert r["tpot_ms_mean"] == pytest.approx(1e3 / 257.836)
  assert r["raw"]["build_commit"] == "3a3bd8a" and r["raw"]["gpu_info"] == "NVIDIA H200"


def test_batched_bench_table_and_jsonl_parse():
  recs = scaling.parse_batched_bench(BATCHED_BENCH_MD, "qwen2.5-7b", "Q4_0")
  assert [(r["batch"], r["decode_tok_s_total"]) for r in recs] == [(1, 261.22), (16, 2089.80), (64, 5264.78)]
  assert recs[1]["decode_tok_s"] == pytest.approx(2089.80 / 16)
  assert recs[2]["tpot_ms_mean"] == pytest.approx(1e3 * 64 / 5264.78)
  (j,) = scaling.parse_batched_bench(BATCHED_BENCH_JSONL, "qwen2.5-7b", "Q4_0")
  assert (j["batch"], j["decode_tok_s_total"], j["peer"]) == (16, 2089.8, "llama-batched-bench")


# Captured from the tools themselves: llama.cpp of the llama-cpp-python 0.3.36 sdist built for this CPU (no
# CUDA), on random_gguf.py's tiny Q4_K file: `llama-bench -ngl 99 -fa 1 -p 0 -n 16 -r 2 -t 2 -o jsonl` and
# `llama-batched-bench -ngl 99 -fa on -c 600 -b 2048 -ub 512 -npp 16 -ntg 8 -npl 1,2,4 -t 2` (stdout).
CAPTURED_LLAMA_BENCH = (
    '{"build_commit": "unknown", "build_number": 0, "cpu_info": "AMD EPYC", "gpu_info": "", "backends'
    '": "CPU", "model_filename": "tiny-Q4_K.gguf", "model_type": "llama ?B Q4_K - Small", "model_size'
    '": 4859136, "model_n_params": 7375680, "n_batch": 2048, "n_ubatch": 512, "n_threads": 2, "cpu_ma'
    'sk": "0x0", "cpu_strict": false, "poll": 50, "type_k": "f16", "type_v": "f16", "n_gpu_layers": 9'
    '9, "n_cpu_moe": 0, "split_mode": "layer", "main_gpu": 0, "no_kv_offload": false, "flash_attn": 1'
    ', "devices": "auto", "tensor_split": "0.00", "tensor_buft_overrides": "none", "load_mode": "auto'
    '", "lazy_mode": "auto", "embeddings": false, "no_op_offload": 0, "no_host": false, "repack": tru'
    'e, "fit_target": 0, "fit_min_ctx": 0, "n_prompt": 0, "n_gen": 16, "n_depth": 0, "test_time": "20'
    '26-12-04T11:40:09Z", "avg_ns": 6465384, "stddev_ns": 469507, "avg_ts": 2481.259524, "stddev_ts":'
    ' 180.180597, "samples_ns": [ 6797367, 6133402 ],"samples_ts": [ 2353.85, 2608.67 ]}\n')
CAPTURED_BATCHED_BENCH = (
    '\nllama_batched_bench: n_kv_max = 1024, n_batch = 2048, n_ubatch = 512, flash_attn = 1, is_pp_sha'
    'red = 0, is_tg_separate = 0, n_gpu_layers = 99, n_threads = 2, n_threads_batch = 2\n\n|    PP |   '
    '  TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |\n|------'
    '-|--------|------|--------|----------|----------|----------|----------|----------|----------|\n| '
    '   16 |      8 |    1 |     24 |    0.002 |  6650.04 |    0.002 |  3234.94 |    0.005 |  4919.04'
    ' |\n|    16 |      8 |    2 |     48 |    0.005 |  6241.47 |    0.004 |  4456.82 |    0.009 |  55'
    '06.48 |\n|    16 |      8 |    4 |     96 |    0.008 |  7835.46 |    0.007 |  4735.83 |    0.015 '
    '|  6432.16 |\n\n')


def test_outputs_captured_from_llama_cpp_parse():
  (r,) = scaling.parse_llama_bench(CAPTURED_LLAMA_BENCH, "tiny", "Q4_K")
  assert (r["batch"], r["decode_len"], r["decode_tok_s_total"]) == (1, 16, 2481.259524)
  assert r["raw"]["model_type"] == "llama ?B Q4_K - Small"
  recs = scaling.parse_batched_bench(CAPTURED_BATCHED_BENCH, "tiny", "Q4_K")
  assert [(r["batch"], r["decode_tok_s_total"]) for r in recs] == [(1, 3234.94), (2, 4456.82), (4, 4735.83)]


def _ours(preset, batch, path, tpot, ran=None):
  return {"label": "", "model": f"synthetic:{preset}", "preset": preset, "requested_kernels": path,
          "kernels": ran or path, "batch": batch, "tpot_ms_mean": tpot, "decode_tok_s_total": batch * 1e3 / tpot,
          "byte_floor_ms": 1.85, "peak_memory_bytes": 21.2e9, "env": {"device": "NVIDIA H200", "platform": "gpu"}}


def _made_up(dir_, auto_7b_16):
  recs = [_ours("qwen2.5-7b", b, k, t) for b, ts in ((1, (2.50, 2.73, 10.8)), (16, (4.10, 4.0, 9.0)))
          for k, t in zip(("auto", "ffi-unfused", "xla"), ts)]
  recs[3] = _ours("qwen2.5-7b", 16, "auto", auto_7b_16)
  recs += scaling.parse_llama_bench(LLAMA_BENCH_JSONL, "qwen2.5-7b", "Q8_0")
  recs += scaling.parse_batched_bench(BATCHED_BENCH_MD, "qwen2.5-7b", "Q8_0")
  os.makedirs(dir_, exist_ok=True)
  with open(os.path.join(dir_, "scaling.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in recs)


def test_report_and_check_on_made_up_records(tmp_path):
  d = str(tmp_path / "study")
  argv = ["--dir", d, "--render", "--check", "--presets", "qwen2.5-7b", "--batches", "1,16", "--peer-types", "Q8_0"]
  _made_up(d, 4.20)                                        # auto 5% slower than ffi-unfused at batch 16
  assert scaling.main(argv) == 1
  text = (tmp_path / "study.md").read_text()
  assert "- qwen2.5-7b batch 16: FAIL: auto (auto) 4.200 ms against ffi-unfused 4.000 ms (+5.0%" in text
  assert "- qwen2.5-7b batch 1: ok: auto (auto) 2.500 ms against ffi-unfused 2.730 ms" in text
  row1 = next(line for line in text.splitlines() if line.startswith("| qwen2.5-7b | 1 |"))
  assert row1.split(" | ")[2:5] == ["2.500 (auto)", "400", "74%"]
  assert "258 (1.55x)" in row1                              # llama-bench at batch 1: 400 / 257.8
  assert "2,090 (1.82x)" in text                            # batched-bench at 16: 3,810 / 2,089.8
  assert (tmp_path / "study" / "scaling.png").stat().st_size > 1000
  _made_up(d, 4.10)                                        # 2.5% slower: within 3%
  assert scaling.main(argv) == 0
  assert scaling.main(argv[:-3] + ["1,16,64", "--peer-types", "Q8_0"]) == 1   # batch 64 has no records
  assert "- qwen2.5-7b batch 64: MISSING" in (tmp_path / "study.md").read_text()


def test_bad_arguments_are_one_line(tmp_path):
  for argv, want in ((["--presets", "qwen9"], "error: unknown preset(s) ['qwen9']"),
                     (["--batches", "1,x"], "error: --batches takes positive integers"),
                     (["--kernels", "xla,auto"], "error: --kernels must list auto first"),
                     (["--llama-bench", str(tmp_path / "none")], "is not an executable file")):
    with pytest.raises(SystemExit, match=want.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
      scaling.main(["--dir", str(tmp_path / "d"), *argv])


def _logs(d: Path) -> str:
  """The tails of a study's run logs (<dir>/logs): why a run that wrote no records failed."""
  return "\n".join(f"== {p.name}\n{p.read_text()[-1500:]}" for p in sorted((d / "logs").glob("*.log")))


def _fake_tool(path: Path, text: str) -> str:
  """An executable that prints `text` after checking it was given a GGUF that exists (as llama.cpp would)."""
  path.write_text(f"#!{sys.executable}\nimport os, sys\nm = sys.argv[sys.argv.index('-m') + 1]\n"
                  f"assert os.path.getsize(m) > 1000, m\nsys.stderr.write('llama_model_loader: ' + m + '\\n')\n"
                  f"print({text!r}, end='')\n")
  path.chmod(0o755)
  return str(path)


def test_scaling_runs_end_to_end_on_the_tiny_preset(vocab, tmp_path):
  """Batch 1's jaxllm records are already in the JSONL (made up: the run resumes past them), so one jaxllm
  process runs (batch 2); the peers run through fake binaries on GGUFs written from the tiny vocabulary."""
  d = tmp_path / "run"
  d.mkdir()
  done = [_ours("tiny", 1, k, t) for k, t in (("auto", 1.0), ("xla", 2.0))]
  (d / "scaling.jsonl").write_text("".join(json.dumps(r) + "\n" for r in done))
  lb = _fake_tool(tmp_path / "llama-bench", LLAMA_BENCH_JSONL)
  bb = _fake_tool(tmp_path / "llama-batched-bench", BATCHED_BENCH_MD.replace("|   64 |", "|    2 |"))
  argv = [sys.executable, str(ROOT / "bench/scaling.py"), "--dir", str(d), "--presets", "tiny", "--batches", "1,2",
          "--kernels", "auto,xla", "--prompt-len", "16", "--decode-len", "18", "--repeat", "1", "--llama-bench", lb,
          "--llama-batched-bench", bb, "--vocab", vocab, "--peer-types", "Q4_0,Q4_K"]
  proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "tiny-b1" not in proc.stderr and "[scaling] tiny-b2: " in proc.stderr
  recs = scaling.read_jsonl(str(d / "scaling.jsonl"))
  ours = [(r["batch"], r["requested_kernels"], r["kernels"]) for r in recs[2:] if r.get("requested_kernels")]
  assert [o[:2] for o in ours] == [(2, "auto"), (2, "xla")] and ours[1][2] == "xla", _logs(d)
  assert recs[2]["env"]["platform"] == PLATFORM and recs[2]["decode_tok_s_total"] > 0
  peers = sorted((r["peer"], r["quant"], r["batch"]) for r in recs if r.get("peer"))
  assert peers == sorted([("llama-bench", t, 1) for t in ("Q4_0", "Q4_K")] +
                         [("llama-batched-bench", t, b) for t in ("Q4_0", "Q4_K") for b in (1, 2)])
  assert not list((d / "gguf").iterdir())                  # each preset's files removed after its peers
  text = (tmp_path / "run.md").read_text()
  assert "| tiny | 2 |" in text and "- tiny batch 2: " in text and (d / "scaling.png").exists()
  assert "| tiny | 1 | 1.000 (auto) | 1,000 |" in text and "258 (3.88x)" in text and "llama.cpp Q4_K tok/s" in text
  again = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120)   # resumes: nothing to run
  assert again.returncode == 0 and "[scaling] " not in again.stderr, again.stderr[-2000:]
  assert len(scaling.read_jsonl(str(d / "scaling.jsonl"))) == len(recs)


def test_time_limit_cuts_a_run_and_still_writes_the_report(tmp_path):
  d = tmp_path / "cut"
  argv = [sys.executable, str(ROOT / "bench/scaling.py"), "--dir", str(d), "--presets", "tiny", "--batches", "1,2",
          "--kernels", "auto,xla", "--prompt-len", "16", "--decode-len", "18", "--repeat", "1", "--time-limit", "2"]
  proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  text = (tmp_path / "cut.md").read_text()
  assert "- tiny-b1: cut at the time limit (2 s); logs/tiny-b1.log" in text
  assert "- tiny-b2: not started (time limit)" in text and "- tiny batch 2: MISSING" in text
  assert scaling.read_jsonl(str(d / "scaling.jsonl")) == []
  assert subprocess.run(argv[:-2] + ["--render", "--check"], capture_output=True, cwd=ROOT).returncode == 1


def test_llama_bench_prompt_tests_parse_as_prefill():
  recs = scaling.parse_llama_prefill(LLAMA_BENCH_JSONL, "qwen2.5-7b", "Q8_0")
  assert len(recs) == 1 and recs[0]["prompt_len"] == 512 and recs[0]["peer"] == "llama-bench-prefill"
  assert recs[0]["study"] == "prefill" and abs(recs[0]["ttft_ms"] - 1e3 * 512 / 10554.08) < 1e-9
  assert all(r["batch"] == 1 for r in scaling.parse_llama_bench(LLAMA_BENCH_JSONL, "qwen2.5-7b", "Q8_0"))
  assert not scaling.parse_llama_prefill(BATCHED_BENCH_MD, "qwen2.5-7b", "Q8_0")


def test_prefill_rows_run_beside_llama_bench(vocab, tmp_path):
  """--prefill 16: the decode rows are done already (made up), so one jaxllm prefill process runs and one
  llama-bench prompt test (a fake printing a 16-token prompt test); the report's prefill table has both and
  their ratio, and the decode rows' peers are untouched by the prompt test's record."""
  d = tmp_path / "pre"
  d.mkdir()
  done = [_ours("tiny", 1, k, t) for k, t in (("auto", 1.0), ("xla", 2.0))]
  done += [dict(r, preset="tiny", model="synthetic:tiny", quant="Q4_0")
           for r in scaling.parse_llama_bench(LLAMA_BENCH_JSONL, "tiny", "Q4_0")]
  (d / "scaling.jsonl").write_text("".join(json.dumps(r) + "\n" for r in done))
  lb = _fake_tool(tmp_path / "llama-bench", LLAMA_BENCH_JSONL.replace('"n_prompt": 512', '"n_prompt": 16'))
  argv = [sys.executable, str(ROOT / "bench/scaling.py"), "--dir", str(d), "--presets", "tiny", "--batches", "1",
          "--kernels", "auto,xla", "--prompt-len", "16", "--decode-len", "18", "--repeat", "1", "--llama-bench", lb,
          "--vocab", vocab, "--peer-types", "Q4_0", "--prefill", "16"]
  proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "[scaling] tiny-prefill-16: " in proc.stderr and "[scaling] llama-bench-prefill-tiny-Q4_0: " in proc.stderr
  assert "[scaling] tiny-b1" not in proc.stderr and "[scaling] llama-bench-tiny-Q4_0:" not in proc.stderr
  recs = scaling.read_jsonl(str(d / "scaling.jsonl"))
  ours = [r for r in recs if r.get("study") == "prefill" and r["label"] != "llama.cpp"]
  assert len(ours) == 1 and ours[0]["prompt_len"] == 16 and ours[0]["ttft_ms"] > 0 and "requested_kernels" not in ours[0], \
      _logs(d)
  peer = [r for r in recs if r.get("peer") == "llama-bench-prefill"]
  assert len(peer) == 1 and peer[0]["prompt_len"] == 16
  text = (tmp_path / "pre.md").read_text()
  ratio = peer[0]["ttft_ms"] / ours[0]["ttft_ms"]
  assert f"| tiny | 16 | {ours[0]['ttft_ms']:.1f} | {peer[0]['ttft_ms']:.1f} ({ratio:.2f}x) |" in text, text
  assert "| tiny | 1 | 1.000 (auto) | 1,000 |" in text and "258 (3.88x)" in text     # decode rows as before
  again = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert again.returncode == 0 and "[scaling] " not in again.stderr, again.stderr[-2000:]
