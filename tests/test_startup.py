"""Start-up: the cache of converted models and of compiled executables, the CLI's flags and stages, and the
interactive chat driven through a pseudo-terminal."""
import importlib
import json
import os
import pty
import select
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import jaxllm
from jaxllm import cachedir, store
from jaxllm.generate import main as cli_main
from jaxllm.progress import Stages
from agree import same_or_near_tie
from tiny import write_tiny_model


def _leaves_equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_second_load_maps_the_cached_conversion(tmp_path, arch):
  path = write_tiny_model(tmp_path / f"{arch}.gguf", arch)
  first_stages, second_stages = Stages(quiet=True), Stages(quiet=True)
  c1, w1, t1 = jaxllm.load(path, progress=first_stages)
  c2, w2, t2 = jaxllm.load(path, progress=second_stages)
  assert "read model" in first_stages.times and "load cached conversion" in second_stages.times
  assert "read model" not in second_stages.times                     # the GGUF is not parsed again
  assert c1 == c2 and _leaves_equal(w1, w2)
  assert (w2.head is w2.embed) == (w1.head is w1.embed)
  text = "the cat 一二三 <|im_end|>"
  assert t1.encode(text) == t2.encode(text) and t1.eog_ids == t2.eog_ids
  assert t1.apply_chat_template([{"role": "user", "content": "hi"}]) == \
      t2.apply_chat_template([{"role": "user", "content": "hi"}])
  _, w_none, _ = jaxllm.load(path, quant="none", progress=False)        # another key: float weights
  assert not w_none.wqkv.quantized
  _, w_bf16, _ = jaxllm.load(path, quant="none", dtype=jax.numpy.bfloat16, progress=False)
  _, w_bf16_again, _ = jaxllm.load(path, quant="none", dtype=jax.numpy.bfloat16, progress=False)
  assert w_bf16.wqkv.w.dtype == jax.numpy.bfloat16 and _leaves_equal(w_bf16, w_bf16_again)


@pytest.mark.parametrize("default", ["platform", "bfloat16"])
def test_a_damaged_entry_is_converted_again(tmp_path, monkeypatch, default):
  load_module = importlib.import_module("jaxllm.load")                 # the module (jaxllm.load is the function)
  if default == "bfloat16":                                           # the GPU's default, on any platform
    monkeypatch.setattr(load_module, "default_dtype", lambda: jax.numpy.bfloat16)
  path = write_tiny_model(tmp_path / "m.gguf", "qwen2")
  _, w1, _ = jaxllm.load(path, quant="w8a16", progress=False)
  key = store.model_key(path, "w8a16", jax.numpy.dtype(load_module.default_dtype()).name)   # the dtype load() chose
  victim = cachedir.models_dir() / key / "w_down.w.npy"
  victim.write_bytes(victim.read_bytes()[:-100])                      # truncated
  stages = Stages(quiet=True)
  _, w2, _ = jaxllm.load(path, quant="w8a16", progress=stages)
  assert "read model" in stages.times and _leaves_equal(w1, w2)
  assert store.load(key) is not None                                  # written whole again


def test_a_changed_file_gets_a_new_key(tmp_path):
  path = write_tiny_model(tmp_path / "m.gguf", "llama", seed=1)
  key = store.model_key(path, "w8a16", "float32")
  write_tiny_model(tmp_path / "m.gguf", "llama", seed=2)
  os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
  assert store.model_key(path, "w8a16", "float32") != key
  assert store.model_key(path, "none", "float32") != store.model_key(path, "w8a16", "float32")


def test_concurrent_writers_leave_one_whole_entry(tmp_path):
  path = write_tiny_model(tmp_path / "m.gguf", "qwen2")
  config, weights, tok = jaxllm.load(path, progress=False, cache=False)
  key = "concurrent-test"
  a, b = store.Entry(key), store.Entry(key)
  for e in (a, b):
    e.add("x", np.arange(10, dtype=np.int8))
  a.commit(config, tok.to_state())
  b.commit(config, tok.to_state())                                    # loses the race: no error
  assert store.load(key)[2]["x"].tolist() == list(range(10))
  assert not [p for p in cachedir.models_dir().iterdir() if p.name.startswith(f".{key}.")]


def test_engine_executables_load_from_disk(tmp_path, monkeypatch, own_compiles):
  path = write_tiny_model(tmp_path / "m.gguf", "llama")
  config, weights, tok = jaxllm.load(path, progress=False)
  prompt = tok.encode("the cat sat")
  first = jaxllm.Engine(config, weights, tok, max_context=64, cache_executables=True)
  a = first.generate(prompt, 8, ignore_eos=True)
  saved = sorted(p.name for p in cachedir.executables_dir().glob("*.bin"))
  assert len(saved) >= 2
  second = jaxllm.Engine(config, weights, tok, max_context=64, cache_executables=True)
  import jaxllm.programs as programs_mod

  def no_compiling(*args):
    raise AssertionError("compiled although the executable was on disk")
  with monkeypatch.context() as m:
    m.setattr(programs_mod, "_finish", no_compiling)
    b = second.generate(prompt, 8, ignore_eos=True)
  assert a.ids == b.ids and sorted(p.name for p in cachedir.executables_dir().glob("*.bin")) == saved
  other = jaxllm.Engine(config, weights, tok, max_context=96, cache_executables=True)   # other shapes: new keys
  other.generate(prompt, 2, ignore_eos=True)
  assert len(list(cachedir.executables_dir().glob("*.bin"))) > len(saved)


def test_clear_cache(tmp_path, capsys):
  path = write_tiny_model(tmp_path / "m.gguf", "llama")
  jaxllm.load(path, progress=False)
  assert any(cachedir.models_dir().iterdir())
  cachedir.tuning_dir().mkdir(parents=True)
  (cachedir.tuning_dir() / "GPU.json").write_text("{}")
  assert cli_main(["--clear-cache"]) == 0
  assert not cachedir.models_dir().exists() and "removed" in capsys.readouterr().err
  assert not cachedir.tuning_dir().exists()


def test_cli_stages_quiet_and_json(tmp_path, capsys):
  path = write_tiny_model(tmp_path / "m.gguf", "qwen2")
  assert cli_main([path, "-p", "the", "-n", "3", "--ignore-eos", "--json"]) == 0
  err = capsys.readouterr().err
  for stage in ("model: ", "read model: ", "re-quantize F32 weights to W8A16 for the ", "compiled and warmed up in "):
    assert stage in err, err
  assert "\r" not in err                                              # not a terminal: no bar frames
  assert cli_main([path, "-p", "the", "-n", "3", "--ignore-eos", "--json", "-q"]) == 0
  out, err = capsys.readouterr()
  rec = json.loads(out.strip().splitlines()[-1])
  assert err == "" and rec["stage_s"]["load cached conversion"] > 0 and rec["peak_rss_bytes"] > 0
  assert rec["load_s"] > 0 and rec["startup_s"] >= rec["load_s"]


def test_cli_prompt_from_file_context_flags_and_version(tmp_path, capsys):
  path = write_tiny_model(tmp_path / "m.gguf", "llama", context=64)
  f = tmp_path / "prompt.txt"
  f.write_text("the cat\nsat on the mat\n", encoding="utf-8")
  assert cli_main([path, "-f", str(f), "-n", "2", "--ignore-eos", "--json", "-q", "-c", "48"]) == 0
  rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  tok = jaxllm.load(path, progress=False)[2]
  assert rec["prompt_ids"] == tok.encode("the cat\nsat on the mat\n") and rec["max_context"] == 48
  with pytest.raises(SystemExit, match=r"--max-context 100 is longer than the 64 tokens the model was trained for"):
    cli_main([path, "-p", "hi", "-c", "100"])
  assert cli_main([path, "-p", "hi", "-n", "2", "-c", "100", "--allow-long-context", "-q"]) == 0
  assert "longer than the model's trained 64" in capsys.readouterr().err
  with pytest.raises(SystemExit) as info:
    cli_main(["--version"])
  assert info.value.code == 0 and "jaxllm " in capsys.readouterr().out


def _pty_session(args, lines, env, timeout=240):
  """Runs the CLI on a pseudo-terminal, typing each line after the prompt '> ' appears; returns its output
  and exit code."""
  master, slave = pty.openpty()
  proc = subprocess.Popen([sys.executable, "-m", "jaxllm.generate", *args], stdin=slave, stdout=slave,
                          stderr=slave, env={**os.environ, "PYTHONUNBUFFERED": "1", **env}, close_fds=True)
  os.close(slave)
  out, pending, deadline = b"", list(lines), time.time() + timeout
  try:
    while time.time() < deadline and proc.poll() is None:
      ready, _, _ = select.select([master], [], [], 0.5)
      if ready:
        try:
          out += os.read(master, 65536)
        except OSError:
          break
      if pending and out.rstrip().endswith(b">"):
        os.write(master, (pending.pop(0) + "\n").encode())
        out += b"\n"
  finally:
    if proc.poll() is None:
      proc.kill()
    code = proc.wait()
    os.close(master)
  return out.decode("utf-8", "replace"), code


def test_interactive_chat_reuses_the_cache_and_matches_a_one_shot_run(tmp_path):
  """The second turn reuses the first's cache and gives a one-shot run's tokens: exactly in f32 (the CPU); in
  bf16 (the GPU), where keys cached by decode steps and a fresh prefill's differ in the last bits, every token of
  both the reference's argmax or a near tie of it (agree.same_or_near_tie)."""
  path = write_tiny_model(tmp_path / "chat.gguf", "qwen2")
  out, code = _pty_session([path, "-i", "-n", "6", "--ignore-eos", "--json", "-q", "--kernels", "xla"],
                            ["the cat", "sat on", "/exit"], {"JAXLLM_CACHE": str(tmp_path / "cache")})
  assert code == 0, out
  turns = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
  assert len(turns) == 2, out
  assert turns[0]["reused_tokens"] == 0 and turns[1]["reused_tokens"] > len(turns[0]["prompt_ids"]) // 2
  config, weights, tok = jaxllm.load(path, progress=False)
  history = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": turns[0]["text"]},
             {"role": "user", "content": "sat on"}]
  ids = tok.encode(tok.apply_chat_template(history))
  assert turns[1]["prompt_ids"] == ids
  one_shot = jaxllm.Engine(config, weights, tok, max_context=config.context_length, kernels="xla")
  same_or_near_tie(one_shot, ids, turns[1]["ids"], one_shot.generate(ids, 6, ignore_eos=True).ids)


def _startup_script(*args):
  script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "startup.py")
  return subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=900)


@pytest.mark.network
def test_the_startup_scripts_smallest_case(tmp_path):
  """bench/startup.py, whose figures README.md and docs/benchmarks.md quote, on its smallest case: smollm2-135m,
  a first run on empty caches and one run after it, each a new process timed to its first byte of text."""
  out = tmp_path / "startup.json"
  proc = _startup_script("smollm2-135m", "--runs", "1", "--json", str(out))
  assert proc.returncode == 0, proc.stderr[-3000:]
  (rec,) = json.loads(out.read_text())
  first, (later,) = rec["first_run"], rec["later_runs"]
  assert rec["model"] == "smollm2-135m" and later["text"].strip()
  assert 0 < later["first_token_s"] < first["first_token_s"]        # the first run converted and compiled
  assert rec["first_ttft_ms"] > 0 and rec["second_ttft_ms"] > 0 and later["peak_rss_bytes"] > 0
  assert {"date", "cpu", "cpus", "load_avg_1m", "git_commit"} <= set(rec["env"])     # when and where
  assert "[startup] smollm2-135m: first run " in proc.stderr


def test_the_startup_script_refuses_bad_input_in_one_line():
  for args, said in ((["smollm2-135m", "--runs", "0"], "error: --runs must be >= 1 (the runs after the first), got 0"),
                     (["llama-9000"], "error: unknown demo model 'llama-9000': choose one of ")):
    proc = _startup_script(*args)
    assert proc.returncode == 1 and proc.stderr.startswith(said) and len(proc.stderr.splitlines()) == 1, proc.stderr
