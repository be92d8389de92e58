"""The device out of memory (jaxllm.device_memory): told apart from other runtime errors, said so when the engine's
command-buffer trial meets it, and one line from generate, serve and bench. BFC and MODULE are XLA's texts as the
H100 gave them (docs/results/2026-12-07-h100-scaling-14b.md), raised where the device would raise them."""
import jax
import pytest

from jaxllm import Engine, GGUFFile, Tokenizer
from jaxllm.device_memory import DeviceMemoryError, explain, out_of_memory
from jaxllm.weights import load_weights

BFC = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes.\n"
       "=== Source Location Trace: ===\nexternal/xla+/xla/stream_executor/cuda/cuda_status.cc:45")
MODULE = ("RESOURCE_EXHAUSTED: [0] Failed to get module function fusion_1875: CUDA_ERROR_OUT_OF_MEMORY: out of "
          "memory [executable_name='jit_decode_steps']")
GRAPH = "RESOURCE_EXHAUSTED: Underlying backend ran out of memory trying to instantiate graph"   # openxla/xla#20611
SHARED = "RESOURCE_EXHAUSTED: Shared memory size limit exceeded: requested 73728, available: 65536"   # a compile


def test_out_of_memory_is_told_apart():
  for text in (BFC, MODULE, GRAPH, "INTERNAL: cuBLAS error: CUBLAS_STATUS_ALLOC_FAILED"):
    assert out_of_memory(jax.errors.JaxRuntimeError(text)), text
  for text in ("INTERNAL: simulated command buffer failure", SHARED):
    assert not out_of_memory(jax.errors.JaxRuntimeError(text)), text
  assert not out_of_memory(ValueError("the prompt is out of memory's reach"))     # not a runtime error
  assert out_of_memory(DeviceMemoryError("the device ran out of memory"))


def _explained(monkeypatch, figures, text=BFC):
  import jaxllm.device_memory as dm
  monkeypatch.setattr(dm, "_device_figures", lambda: figures)
  e = explain(jax.errors.JaxRuntimeError(text))
  assert isinstance(e, DeviceMemoryError) and isinstance(e, RuntimeError) and explain(e) is e
  assert "\n" not in str(e) and "Source Location" not in str(e)
  return str(e)


def test_explain_tells_a_full_pool_from_the_memory_outside_it(monkeypatch):
  full = _explained(monkeypatch, ("NVIDIA H100 80GB HBM3", 59.5e9, 60e9))
  assert full == ("the NVIDIA H100 80GB HBM3 ran out of memory (RESOURCE_EXHAUSTED: Out of memory while trying to "
                  "allocate 17179869184 bytes); this process holds 59.50 GB of the 60.00 GB pool it may use; a "
                  "shorter max context, fewer sequences at once or a smaller model need less")
  outside = _explained(monkeypatch, ("NVIDIA H100 80GB HBM3", 9e9, 60e9), MODULE)
  assert "holds 9.00 GB of the 60.00 GB pool" in outside and "the memory outside that pool ran out" in outside
  assert "XLA_PYTHON_CLIENT_MEM_FRACTION" in outside and "shorter max context" not in outside
  cpu = _explained(monkeypatch, ("cpu", 0, 0))
  assert cpu.startswith("the cpu ran out of memory (RESOURCE_EXHAUSTED") and "GPU" not in cpu


def test_explain_without_a_backend(monkeypatch):
  """The device full from the outset: the backend fails to start, and explain says it without the figures."""
  def broken():
    raise jax.errors.JaxRuntimeError(MODULE)
  monkeypatch.setattr(jax, "devices", broken)
  text = str(explain(jax.errors.JaxRuntimeError(BFC)))
  assert text.startswith("the device ran out of memory (RESOURCE_EXHAUSTED")


def test_an_oom_in_the_command_buffer_trial_falls_back_and_says_so(tiny_models, monkeypatch):
  """The trial holds a second copy of its state (zeros): out of memory there, the engine runs without command
  buffers, as on any trial failure, with a warning that names the memory."""
  import jaxllm.programs as programs_mod
  gf = GGUFFile(tiny_models["qwen2"])
  weights, tok = load_weights(gf, progress=False), Tokenizer(gf.metadata)
  reference = Engine(gf.config, weights, tok, max_context=64, graphs_on=False).generate(
      list(range(3, 19)), 6, ignore_eos=True).ids

  def trial(args):
    raise jax.errors.JaxRuntimeError(MODULE)
  monkeypatch.setattr(programs_mod, "_graphs_possible", lambda: True)    # as on a GPU: the mechanism under test
  monkeypatch.setattr(programs_mod, "_trial_args", trial)
  engine = Engine(gf.config, weights, tok, max_context=64, graphs_on=True)
  with pytest.warns(RuntimeWarning, match="CUDA graphs .* their trial ran out of device memory, running without "
                                          "them: JaxRuntimeError: RESOURCE_EXHAUSTED"):
    got = engine.generate(list(range(3, 19)), 6, ignore_eos=True).ids
  assert got == reference and not engine.graphs_active


def test_the_cli_says_it_in_one_line(tiny_models, monkeypatch, capsys):
  from jaxllm import generate

  def warmup(self, *args, **kwargs):
    raise jax.errors.JaxRuntimeError(BFC)
  monkeypatch.setattr(Engine, "warmup", warmup)
  with pytest.raises(SystemExit) as e:
    generate.main([tiny_models["llama"], "-p", "hi", "-n", "2", "--quiet", "--no-compile-cache"])
  text = str(e.value.code)
  assert text.startswith("error: the ") and "ran out of memory (RESOURCE_EXHAUSTED" in text and "\n" not in text


def test_the_servers_loader_says_it_in_one_line(tmp_path, monkeypatch):
  """jaxllm.serve's loader (run on a thread at start-up; its error goes to stderr and /health as one line)."""
  from jaxllm.serve.cli import build_parser, make_loader
  from jaxllm.serve.slots import SlotPrograms
  from tiny import write_tiny_model

  def warmup(self):
    raise jax.errors.JaxRuntimeError(MODULE)
  monkeypatch.setattr(SlotPrograms, "warmup", warmup)
  path = write_tiny_model(tmp_path / "tiny.gguf", "llama")
  args = build_parser().parse_args([path, "--max-batch", "1", "--max-context", "64", "--no-compile-cache", "--quiet"])
  args.template = None                       # what main() reads from --chat-template (none given)
  with pytest.raises(DeviceMemoryError, match="CUDA_ERROR_OUT_OF_MEMORY") as e:
    make_loader(args, path)()
  assert "\n" not in str(e.value)


def test_the_bench_says_it_in_one_line(monkeypatch):
  from jaxllm import bench

  def run(args):
    raise jax.errors.JaxRuntimeError(BFC)
  monkeypatch.setattr(bench, "run", run)
  with pytest.raises(SystemExit) as e:
    bench.main(["synthetic:tiny", "--decode-len", "8"])
  assert str(e.value.code).startswith("error: the ") and "ran out of memory" in str(e.value.code)


def test_an_oom_while_loading_is_one_line_too(tiny_models, monkeypatch):
  """generate's load error handler passes the device out of memory on to main's one line (its own would print
  XLA's lines)."""
  import importlib
  from jaxllm import generate

  def load(*args, **kwargs):
    raise jax.errors.JaxRuntimeError(BFC)
  monkeypatch.setattr(importlib.import_module("jaxllm.load"), "load", load)  # the module, not the function
  with pytest.raises(SystemExit) as e:
    generate.main([tiny_models["llama"], "-p", "hi", "-n", "2", "--quiet"])
  text = str(e.value.code)
  assert text.startswith("error: the ") and "ran out of memory (RESOURCE_EXHAUSTED" in text and "\n" not in text


def test_generate_checks_the_cache_of_every_prompt_at_once(tiny_models, monkeypatch):
  """Four prompts' cache past what the device has: one line before anything compiles (the engine's own check is
  for one row; the warmup at four rows raised it as a traceback)."""
  import numpy as np
  import jaxllm.cache
  from jaxllm import generate
  from jaxllm.cache import cache_bytes
  path = tiny_models["llama"]
  one = cache_bytes(GGUFFile(path).config, 1, 64, np.float32)       # a row in f32 (bf16: half)
  monkeypatch.setattr(jaxllm.cache, "memory_available", lambda: int(1.5 * one))
  with pytest.raises(SystemExit) as e:
    generate.main([path, "-p", "a", "-p", "b", "-p", "c", "-p", "d", "-n", "2", "--max-context", "64", "--quiet"])
  assert str(e.value.code).startswith("error: a KV cache of 64 tokens x batch 4 needs ")


def _serving(tiny_models, monkeypatch, reset_fails: bool):
  """A scheduler of 2 slots whose first turn runs out of device memory (and, with reset_fails, so does making its
  state anew); one request submitted before it starts. Returns (scheduler, that request's events, its Done)."""
  import threading
  from jaxllm.serve.scheduler import Done, Request, Scheduler
  from jaxllm.serve.slots import SlotPrograms
  gf = GGUFFile(tiny_models["qwen2"])
  engine = Engine(gf.config, load_weights(gf, progress=False), Tokenizer(gf.metadata), max_context=64,
                  prefill_chunk=16)
  real_turn, turns = Scheduler._turn, []

  def turn(self):
    turns.append(1)
    if len(turns) == 1:
      raise jax.errors.JaxRuntimeError(BFC)
    real_turn(self)
  monkeypatch.setattr(Scheduler, "_turn", turn)
  if reset_fails:
    def reset(self):
      raise jax.errors.JaxRuntimeError(MODULE)
    monkeypatch.setattr(SlotPrograms, "reset", reset)
  scheduler = Scheduler(engine, slots=2, admit_group=1)
  events, done = [], threading.Event()

  def emit(event):
    events.append(event)
    if isinstance(event, Done):
      done.set()
  scheduler.submit(Request([3, 4, 5, 6], 3, emit, ignore_eos=True))
  scheduler.start()
  assert done.wait(120), "the request in the failed turn did not end"
  return scheduler, events, done


def test_the_server_ends_the_turns_requests_in_one_line_and_goes_on(tiny_models, monkeypatch, capsys):
  import threading
  from jaxllm.serve.scheduler import Delta, Done, Request
  scheduler, events, _ = _serving(tiny_models, monkeypatch, reset_fails=False)
  try:
    end = events[-1]
    assert end.finish_reason == "error" and end.error.startswith("DeviceMemoryError: the ")
    assert "ran out of memory (RESOURCE_EXHAUSTED" in end.error and "\n" not in end.error
    err = capsys.readouterr().err
    assert "[jaxllm] error: the " in err and "Traceback" not in err
    again, finished = [], threading.Event()

    def emit(event):
      again.append(event)
      if isinstance(event, Done):
        finished.set()
    scheduler.submit(Request([3, 4, 5, 6], 3, emit, ignore_eos=True))          # the next request is served
    assert finished.wait(120) and again[-1].finish_reason == "length"
    assert sum(len(e.ids) for e in again if isinstance(e, Delta)) == 3
  finally:
    scheduler.stop()


def test_a_server_that_cannot_make_its_state_anew_says_so_instead_of_hanging(tiny_models, monkeypatch, capsys):
  from jaxllm.serve.scheduler import Request
  scheduler, events, _ = _serving(tiny_models, monkeypatch, reset_fails=True)
  try:
    assert events[-1].finish_reason == "error" and "ran out of memory" in events[-1].error
    scheduler._thread.join(30)
    assert not scheduler._thread.is_alive()
    with pytest.raises(RuntimeError, match="the server's engine stopped: DeviceMemoryError: the .* ran out of memory"):
      scheduler.submit(Request([3, 4], 2, lambda event: None))
    assert "Traceback" not in capsys.readouterr().err
  finally:
    scheduler.stop()


def test_an_oom_in_a_chat_turn_loses_the_turn_not_the_chat(tiny_models, monkeypatch, capsys):
  """Interactive chat: the device out of memory in a turn's decode call, with the state already donated (its
  buffers gone, as XLA leaves them), prints one line and the chat goes on; the next turn, the same question,
  answers what a chat of that question alone answers (the history kept no trace of the failed turn)."""
  import io
  import json
  from jaxllm import generate
  real, calls = Engine.advance_fn, []

  def advance_fn(self, *args, **kwargs):
    fn = real(self, *args, **kwargs)

    def advance(state, block):
      calls.append(1)
      if len(calls) == 1:
        for a in jax.tree.leaves(state):
          a.delete()
        raise jax.errors.JaxRuntimeError(BFC)
      return fn(state, block)
    return advance
  real_generate = generate._Run._generate

  def turn(self, *args, **kwargs):        # the chat's turns (after the warmup)
    monkeypatch.setattr(Engine, "advance_fn", advance_fn)
    return real_generate(self, *args, **kwargs)
  monkeypatch.setattr(generate._Run, "_generate", turn)
  argv = [tiny_models["qwen2"], "-n", "4", "--ignore-eos", "--json", "--quiet", "--max-context", "64"]
  monkeypatch.setattr("sys.stdin", io.StringIO("the cat\nthe cat\n/exit\n"))
  assert generate.main(argv + ["-i"]) == 0
  out, err = capsys.readouterr()
  answers = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
  (line,) = [x for x in err.splitlines() if "error:" in x]
  assert "ran out of memory (RESOURCE_EXHAUSTED" in line and "the chat goes on" in line, err
  assert len(answers) == 1 and len(calls) > 1
  monkeypatch.setattr(Engine, "advance_fn", real)
  monkeypatch.setattr(generate._Run, "_generate", real_generate)
  assert generate.main(argv + ["--chat", "-p", "the cat"]) == 0
  (alone,) = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
  assert answers[0]["prompt_ids"] == alone["prompt_ids"] and answers[0]["ids"] == alone["ids"]
