"""CUDA graphs (XLA command buffers): the switch, the state in effect, and token parity on vs off.

Parity runs everywhere: on the CPU both settings fall back to the same path; on a GPU (marked tests)
it runs the Qwen2.5-0.5B shape with synthetic weights and checks the graph state from XLA's dump.
"""
import os

import jax
import pytest

from jaxllm import Engine, GGUFFile, Tokenizer, graphs
from jaxllm.presets import preset
from jaxllm.weights import load_weights, random_weights

ON_GPU = jax.default_backend() == "gpu"


def test_switch_reads_env(monkeypatch):
  monkeypatch.delenv(graphs.ENV_VAR, raising=False)
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  assert graphs.graphs_requested() and graphs.compiler_options(True) == {}
  monkeypatch.setenv(graphs.ENV_VAR, "0")
  assert not graphs.graphs_requested()
  assert graphs.compiler_options(False) == {"xla_gpu_enable_command_buffer": ""}
  assert not graphs.graphs_requested(no_graphs=True)
  monkeypatch.setenv(graphs.ENV_VAR, "maybe")
  with pytest.raises(ValueError, match="JAXLLM_CUDA_GRAPHS must be 0 or 1, got 'maybe'"):
    graphs.graphs_requested()


def test_user_xla_flags_win(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION --foo=1")
  assert graphs.user_xla_flag() == "FUSION"
  assert graphs.compiler_options(False) == {}


def _tokens(engine, n):
  return engine.generate(list(range(3, 19)), n, ignore_eos=True).ids


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_parity_tiny_gpu(tiny_models, arch):
  gf = GGUFFile(tiny_models[arch])
  weights = load_weights(gf, progress=False)
  tok = Tokenizer(gf.metadata)
  on = Engine(gf.config, weights, tok, max_context=160, graphs_on=True)
  off = Engine(gf.config, weights, tok, max_context=160, graphs_on=False)
  assert on.compiler_options == {} and off.compiler_options == {"xla_gpu_enable_command_buffer": ""}
  assert on.graphs_active and not off.graphs_active
  a, b = _tokens(on, 128), _tokens(off, 128)
  assert len(a) == 128 and a == b


def test_graphs_are_reported_active_only_on_the_gpu(tiny_models):
  gf = GGUFFile(tiny_models["qwen2"])
  weights = load_weights(gf, progress=False)
  on = Engine(gf.config, weights, None, max_context=32, graphs_on=True)
  off = Engine(gf.config, weights, None, max_context=32, graphs_on=False)
  assert on.graphs_requested and on.graphs_active == ON_GPU
  assert not off.graphs_requested and not off.graphs_active


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["ffi", "xla"])
def test_parity_qwen_shape_gpu(kernels):
  config = preset("qwen2.5-0.5b")
  weights = random_weights(config, seed=0)
  on = Engine(config, weights, None, max_context=256, kernels=kernels, graphs_on=True)
  off = Engine(config, weights, None, max_context=256, kernels=kernels, graphs_on=False)
  a, b = _tokens(on, 128), _tokens(off, 128)
  assert len(a) == 128 and a == b


@pytest.mark.gpu
def test_parity_batched_gpu():
  """A batch of 16 (the tensor-core matmuls and, with kernels ffi, the fused attention block): the same tokens with
  graphs on and off, every row."""
  config = preset("qwen2.5-0.5b")
  weights = random_weights(config, seed=0)
  prompts = [list(range(3 + i, 9 + 2 * i)) for i in range(16)]
  runs = [[r.ids for r in Engine(config, weights, None, max_context=128, kernels="ffi", graphs_on=g)
           .generate_batch(prompts, 48, ignore_eos=True)] for g in (True, False)]
  assert all(len(ids) == 48 for ids in runs[0]) and runs[0] == runs[1]


@pytest.mark.gpu
def test_while_device_loop_gpu():
  """Eight steps a call in a while loop: the unrolled program's tokens, graphs on and off (Qwen shape, the
  default fused path, 64 tokens)."""
  config = preset("qwen2.5-0.5b")
  weights = random_weights(config, seed=0)
  unrolled = Engine(config, weights, None, max_context=256, tokens_per_call=8, graphs_on=True)
  looped = [Engine(config, weights, None, max_context=256, tokens_per_call=8, device_loop="while", graphs_on=g)
            for g in (True, False)]
  want = _tokens(unrolled, 64)
  assert len(want) == 64 and all(_tokens(e, 64) == want for e in looped)


def test_graph_state_reports_the_platform_truthfully(monkeypatch):
  """The default engine's graph state: on the GPU "on", with command buffers in XLA's dump; on the CPU off,
  saying why."""
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  monkeypatch.delenv(graphs.ENV_VAR, raising=False)
  config = preset("smollm2-135m").replace(n_layers=1, vocab_size=256)
  engine = Engine(config, random_weights(config, seed=0), None, max_context=32)
  state = graphs.graph_state(engine)
  if ON_GPU:
    assert state["state"] == "on" and state["command_buffers"] >= 1, state
  else:
    assert state["state"] == "off" and "only on the GPU" in state["reason"], state


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["ffi", "xla"])
def test_graph_state_gpu(kernels, monkeypatch):
  """With graphs on, the whole decode step is one command buffer; off, there is none."""
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  config = preset("qwen2.5-0.5b")
  weights = random_weights(config, seed=0)
  on = graphs.graph_state(Engine(config, weights, None, max_context=256, kernels=kernels, graphs_on=True))
  print("graphs on:", on)
  assert on["state"] == "on" and on["command_buffers"] >= 1
  if kernels == "ffi":
    assert on["command_buffers"] == 1 and on["coverage"] == 1.0, on
  monkeypatch.setenv(graphs.ENV_VAR, "0")
  off = graphs.graph_state(Engine(config, weights, None, max_context=256, kernels=kernels))
  print("graphs off:", off)
  assert off["state"] == "off" and off["command_buffers"] == 0 and not off["requested"]


def test_parse_thunk_sequence_nesting():
  """Work thunks count as captured only under a command buffer, at any depth (a while loop's body included)."""
  flat = "\n".join(["000: kCommandBuffer", "  000: kKernel fusion", "  001: kCustomCall jaxllm", "001: kCopy"])
  got = graphs.parse_thunk_sequence(flat)
  assert (got["command_buffers"], got["work_thunks"], got["captured"]) == (1, 3, 2)
  assert got["kinds_outside"] == {"Copy": 1}
  # A while loop run from the host: its body's command buffer holds the body, the condition stays outside.
  host_loop = "\n".join(["000: kKernel fusion", "001: kWhile", "  condition:", "    000: kKernel cond",
                          "  body:", "    000: kCommandBuffer", "      000: kCustomCall jaxllm",
                          "      001: kKernel fusion.2"])
  got = graphs.parse_thunk_sequence(host_loop)
  assert (got["command_buffers"], got["work_thunks"], got["captured"]) == (1, 4, 2), got
  assert got["kinds_outside"] == {"Kernel": 2}
  # The whole loop in one command buffer (WHILE command type): everything under it is captured.
  in_graph = "\n".join(["000: kCommandBuffer", "  000: kWhile", "    000: kKernel cond", "    001: kCustomCall",
                         "  001: kKernel fusion"])
  got = graphs.parse_thunk_sequence(in_graph)
  assert (got["command_buffers"], got["work_thunks"], got["captured"], got["coverage"]) == (1, 3, 3, 1.0), got


def test_count_log_segments():
  log = "\n".join([
      "I1129 command_buffer_thunk.cc:336] [0] Create/Update command buffer by recoding ...",   # before a marker
      "== seg decode 2",
      "I1129 command_buffer_thunk.cc:336] [0] Create/Update command buffer by recoding command buffer cmd "
      "sequence after 1 executions since last update; num_commands=64; updated_allocs=3; needs_update=true",
      "I1129 command_buffer_thunk.cc:362] [0] Updated command buffer in 92 us; num_commands=64",
      "I1129 command_buffer_thunk.cc:380] Execute command buffer on device #0; num_executions=1",
      "== seg other 5",
      "I1129 command_buffer_thunk.cc:330] Update command buffer on device #0 by recoding; updated_allocs=1",
  ])
  got = graphs.count_log_segments(log, "== seg ")
  assert got == {"decode": {"executions": 2, "updates": 1, "updated_allocs": [3], "logged_executions": 1},
                 "other": {"executions": 5, "updates": 1, "updated_allocs": [1], "logged_executions": 0}}


@pytest.mark.gpu
def test_replay_needs_no_update_gpu(tmp_path):
  """XLA's own log: the donated decode step replays its recorded graph with no update, step after step."""
  import json
  import subprocess
  import sys
  script = os.path.join(os.path.dirname(__file__), "..", "bench", "graph_diag.py")
  out = tmp_path / "diag.json"
  proc = subprocess.run([sys.executable, script, "--steps", "32", "--json", str(out)], capture_output=True,
                        text=True, timeout=600)
  assert out.exists(), proc.stderr[-3000:]
  seg = json.loads(out.read_text())["segments"]
  print(seg)
  # The control: an input whose address changes every execution makes XLA update (and log) every time.
  # This shows the log is on and read right, so the zeros below mean no updates, not no logging.
  assert seg["alternating-input"]["updates"] >= 9, seg
  assert seg["decode-step"]["executions"] == 32 and seg["decode-step"]["updates"] == 0, seg
  assert seg["decode-steps-8"]["executions"] == 4 and seg["decode-steps-8"]["updates"] == 0, seg
  assert seg["aliased-64"]["updates"] == 0, seg
  # A new request's prefill writes fresh token/position buffers that its first decode step takes over:
  # at most one update each for prefill and step per request, none after.
  assert seg["engine-loop"]["updates"] <= 2, seg


def _recording_builds(monkeypatch, fail_finish=(), meet=0):
  """Patches jaxllm.programs' lowering and compiling to record (thread, options, matmul precision) of each
  lowering and the thread of each compile; the compiles numbered in fail_finish raise a command-buffer error;
  the first `meet` compiles wait for each other (they must run at once, on as many threads)."""
  import threading
  import jaxllm.programs as programs_mod
  real_lower, real_finish = programs_mod._lower, programs_mod._finish
  lowered, finished = [], []
  together = threading.Barrier(meet, timeout=120) if meet else None

  def lower(fn, donate, options, args, tp=None):
    lowered.append((threading.get_ident(), dict(options), jax.config.jax_default_matmul_precision))
    return real_lower(fn, donate, options, args, tp)

  def finish(low, tp=None):
    finished.append(threading.get_ident())
    if len(finished) <= meet:
      together.wait()
    if len(finished) in fail_finish:
      raise RuntimeError("INTERNAL: simulated command buffer failure")
    return real_finish(low, tp)
  monkeypatch.setattr(programs_mod, "_graphs_possible", lambda: True)    # as on a GPU: the mechanism under test
  monkeypatch.setattr(programs_mod, "_lower", lower)
  monkeypatch.setattr(programs_mod, "_finish", finish)
  return lowered, finished


def _slots(path, **engine_args):
  """An engine and a server's programs for 2 slots, admitting one prompt a call: 14 programs, whose compiles
  these tests are about (4 slots admitting 4 a call made 23, and the suite's slowest file on an H100)."""
  from jaxllm.serve.slots import SlotPrograms
  gf = GGUFFile(path)
  engine = Engine(gf.config, load_weights(gf, progress=False), Tokenizer(gf.metadata), max_context=64,
                  **{"graphs_on": True, **engine_args})
  return engine, SlotPrograms(engine, 2, admit_group=1)


ON = "xla_gpu_enable_command_buffer"      # the option that turns command buffers off (graphs.compiler_options)


def test_programs_compile_on_threads_and_try_command_buffers_after(tiny_models, monkeypatch):
  """Engine.compile_programs (a server's warmup) lowers each program on the calling thread (under its JAX
  settings: here a matmul precision), compiles them on several threads, then runs each new executable's trial
  (command buffers' first run) on the calling thread, one at a time. A trial that fails turns command buffers
  off, and every program is built again without them: none keeps its command-buffer build."""
  import threading
  import jaxllm.programs as programs_mod
  lowered, finished = _recording_builds(monkeypatch, meet=2)
  real_trial, trials = programs_mod._trial_args, []

  def trial(args):
    trials.append(threading.get_ident())
    if len(trials) == 3:
      raise RuntimeError("INTERNAL: simulated command buffer failure")
    return real_trial(args)
  monkeypatch.setattr(programs_mod, "_trial_args", trial)
  engine, slots = _slots(tiny_models["qwen2"])
  lookups, me = slots.programs(), threading.get_ident()
  with jax.default_matmul_precision("highest"), \
      pytest.warns(RuntimeWarning, match="running without them: RuntimeError: INTERNAL: simulated"):
    engine.compile_programs(lookups, threads=3)
  n = len(lookups)
  assert all(t == me and ON not in o and p == "highest" for t, o, p in lowered[:n])   # here, command buffers on
  assert len(set(finished[:2])) == 2 and me not in finished[:n]            # compiled on the pool's threads
  assert trials == [me] * 3                                                # after, here, until one failed
  assert len(lowered) == 2 * n and all(o == {ON: ""} for _, o, _ in lowered[n:])
  assert not engine.graphs_active and len(engine._exe) == n
  slots.warmup()                                                           # finds every program built
  assert len(lowered) == 2 * n


def test_compiles_stay_on_the_callers_thread_under_its_own_compile_settings(tiny_models, monkeypatch):
  """A setting JAX reads as it compiles (the optimization effort on jax 0.10, the PGLE profiling runs on 0.11), set
  for the calling thread by a context manager, is not a worker thread's: compile_programs then compiles on the
  calling thread."""
  import threading
  from jax._src import config as jax_config
  import jaxllm.programs as programs_mod
  # The first of the settings with a number for a value that this JAX has as a thread-local context manager (the
  # names move between versions: 0.10's exec_time_optimization_effort is not in 0.11.2); a value other than its
  # own, inside an effort's range [-1, 1].
  states = [getattr(jax_config, name.removeprefix("jax_"), None) for name in programs_mod._COMPILE_TIME_SETTINGS]
  states = [s for s in states if isinstance(s, jax_config.State) and isinstance(s.value, (int, float))
            and not isinstance(s.value, bool)]
  if not states:
    pytest.skip(f"this JAX ({jax.__version__}) has none of {programs_mod._COMPILE_TIME_SETTINGS} as a setting")
  lowered, finished = _recording_builds(monkeypatch)
  engine, slots = _slots(tiny_models["qwen2"], graphs_on=False)
  value = states[0].value
  other = (0.5 if value != 0.5 else -0.5) if isinstance(value, float) else value + 1
  with states[0](other):
    engine.compile_programs(slots.programs(), threads=3)
  assert finished and set(finished) == {threading.get_ident()}


def test_compiles_failing_on_several_threads_fall_back_once(tiny_models, monkeypatch, own_compiles):
  """Two compiles with command buffers failing on the pool's threads: one warning, command buffers off, every
  program built again without them; of the first builds only those whose trial ran (before the failure came
  up) reach the disk cache, none untried."""
  import jaxllm.programs as programs_mod
  lowered, finished = _recording_builds(monkeypatch, fail_finish=(2, 3))
  real_trial, trials = programs_mod._trial_args, []
  monkeypatch.setattr(programs_mod, "_trial_args", lambda args: trials.append(1) or real_trial(args))
  engine, slots = _slots(tiny_models["llama"], cache_executables=True)
  lookups = slots.programs()
  with pytest.warns(RuntimeWarning, match="running without them") as caught:
    engine.compile_programs(lookups, threads=3)
  n = len(lookups)
  assert len([w for w in caught if "CUDA graphs" in str(w.message)]) == 1
  assert not engine.graphs_active and len(engine._exe) == n
  assert len(lowered) == 2 * n and all(o == {ON: ""} for _, o, _ in lowered[n:])
  assert engine.built["saved"] == n + len(trials) and engine.built["loaded"] == 0 and len(trials) < n - 1


def test_fallback_when_graphs_fail(tiny_models, monkeypatch):
  """A failure compiling with command buffers warns once, turns them off, and gives the same tokens."""
  import jaxllm.programs as programs_mod
  real = programs_mod._lower

  class Failing:          # a program lowered with command buffers on, whose compile fails (as XLA's may)
    def compile(self):
      raise RuntimeError("INTERNAL: simulated command buffer failure")

  def failing(fn, donate, options, args, tp=None):
    lowered = real(fn, donate, options, args, tp)
    return Failing() if ON not in options else lowered

  gf = GGUFFile(tiny_models["qwen2"])
  weights = load_weights(gf, progress=False)
  tok = Tokenizer(gf.metadata)
  reference = _tokens(Engine(gf.config, weights, tok, max_context=64, graphs_on=False), 24)
  monkeypatch.setattr(programs_mod, "_graphs_possible", lambda: True)    # as on a GPU: the mechanism under test
  monkeypatch.setattr(programs_mod, "_lower", failing)
  engine = Engine(gf.config, weights, tok, max_context=64, graphs_on=True)
  with pytest.warns(RuntimeWarning, match="CUDA graphs .* failed, running without them: RuntimeError: INTERNAL"):
    got = _tokens(engine, 24)
  assert got == reference
  assert not engine.graphs_active and "simulated" in engine.graphs_fallback
  assert engine.compiler_options == {ON: ""}
  alone = Engine(gf.config, weights, tok, max_context=64, graphs_on=True)   # one program built by itself
  with pytest.warns(RuntimeWarning, match="CUDA graphs .* failed, running without them: RuntimeError: INTERNAL"):
    alone.extend_fn(1, 16)
  assert not alone.graphs_active and alone.executables() == [("extend", 1, 16)]
