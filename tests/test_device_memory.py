"""The device out of memory (jaxllm.device_memory): told apart from other runtime errors, raised by the engine as
such instead of turning command buffers off, and one line from the CLI. The errors are XLA's texts as the H100
gave them (docs/results/2026-12-07-h100-scaling-14b.md), raised where the device would raise them."""
import jax
import pytest

from jaxllm import Engine, GGUFFile, Tokenizer
from jaxllm.device_memory import DeviceMemoryError, explain, out_of_memory
from jaxllm.weights import load_weights

BFC = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes.\n"
       "=== Source Location Trace: ===\nexternal/xla+/xla/stream_executor/cuda/cuda_status.cc:45")
MODULE = ("RESOURCE_EXHAUSTED: [0] Failed to get module function fusion_1875: CUDA_ERROR_OUT_OF_MEMORY: out of "
          "memory [executable_name='jit_decode_steps']")


def test_out_of_memory_is_told_apart():
  assert out_of_memory(jax.errors.JaxRuntimeError(BFC))
  assert out_of_memory(jax.errors.JaxRuntimeError(MODULE))
  assert not out_of_memory(jax.errors.JaxRuntimeError("INTERNAL: simulated command buffer failure"))
  assert not out_of_memory(ValueError("the prompt is out of memory's reach"))     # not a runtime error


def test_explain_is_one_line_with_xlas_first():
  e = explain(jax.errors.JaxRuntimeError(BFC))
  assert isinstance(e, DeviceMemoryError) and isinstance(e, RuntimeError)
  text = str(e)
  assert "\n" not in text and "Source Location" not in text
  assert text.startswith(f"the {jax.devices()[0].device_kind} ran out of memory (RESOURCE_EXHAUSTED: Out of memory "
                         "while trying to allocate 17179869184 bytes)")
  assert "XLA_PYTHON_CLIENT_PREALLOCATE=false" in text
  assert explain(e) is e


def _failing_trials(monkeypatch, message):
  """Programs built with command buffers on (as on a GPU) whose trial run raises `message`."""
  import jaxllm.programs as programs_mod
  real = programs_mod._trial_args

  def trial(args):
    raise jax.errors.JaxRuntimeError(message)
  monkeypatch.setattr(programs_mod, "_graphs_possible", lambda: True)
  monkeypatch.setattr(programs_mod, "_trial_args", trial)
  return real


def test_the_engine_raises_an_oom_instead_of_dropping_command_buffers(tiny_models, monkeypatch):
  gf = GGUFFile(tiny_models["qwen2"])
  weights, tok = load_weights(gf, progress=False), Tokenizer(gf.metadata)
  _failing_trials(monkeypatch, MODULE)
  engine = Engine(gf.config, weights, tok, max_context=64, graphs_on=True)
  with pytest.raises(DeviceMemoryError, match="ran out of memory .*CUDA_ERROR_OUT_OF_MEMORY"):
    engine.extend_fn(1, 16)
  assert engine.graphs_active and engine.graphs_fallback is None      # not taken for a command-buffer failure
  with pytest.raises(DeviceMemoryError):                               # the server's warmup: compile_programs
    engine.compile_programs([lambda: engine.extend_fn(1, 16)])
  assert engine.graphs_active
  other = Engine(gf.config, weights, tok, max_context=64, graphs_on=True)
  _failing_trials(monkeypatch, "INTERNAL: simulated command buffer failure")
  with pytest.warns(RuntimeWarning, match="running without them"):     # other failures still fall back
    other.extend_fn(1, 16)
  assert not other.graphs_active


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
