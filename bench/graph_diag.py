"""Does a command-buffer replay need a graph update? Counts XLA's own log lines per execution.

  python bench/graph_diag.py [--model synthetic:qwen2.5-0.5b] [--steps 64] [--json out.json] [--log out.log]

Runs itself again as a child with TF_CPP_VMODULE=command_buffer_thunk=3, where XLA logs
"[Create/]Update command buffer ... updated_allocs=N" whenever a buffer address the graph was recorded
with has changed (the graph is then re-recorded: host work that the donated, address-stable design exists
to avoid). The child runs, each after a warm-up and between
marker lines:

  decode-step    the engine's compiled decode step, state donated, `--steps` times back to back;
  decode-steps-8 the engine's 8-steps-a-call executable (decode_steps, the GPU's default for the fused
                 step), state and token block donated, `--steps` / 8 calls;
  engine-loop    the engine's real pipelined loop (prefill, then steps interleaved with token reads);
  streaming-loop the same request in the engine's streaming loop (each call's tokens read before the next);
  aliased-64     64 W8A16 calls whose outputs are written into donated inputs (keep_unused=True);
  alternating-input  the same program fed two input arrays in turn: a changed address every execution,
                 the control that shows the log reports updates when they happen.
Warm-ups (compile, the first record, a first request) run in segments of their own, left out.

The parent prints, per segment, executions and updates, and exits 1 if the decode step needed any, 2 if
the control logged none (then the log shows nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from jaxllm.graphs import count_log_segments

MARK = "=== jaxllm-graph-diag segment "


def child(model: str, steps: int) -> None:
  import jax
  import jax.numpy as jnp

  from jaxllm.bench import load_model
  from jaxllm.engine import Engine
  from jaxllm.kernels import ffi
  from jaxllm.quant import GROUP, Linear
  from jaxllm.timing import burst_step_ms
  from jaxllm.cache import create_cache
  from jaxllm.decode import prefill
  from jaxllm.sampling import Sampler, SamplingParams

  def mark(name, executions=0):
    print(f"{MARK}{name} {executions}", file=sys.stderr, flush=True)

  config, weights, _, _ = load_model(model, "w8a16", 0)
  engine = Engine(config, weights, None, max_context=64 + 2 * steps, kernels="ffi", graphs_on=True)
  prompt = list(range(1, 33))
  mark("warmup")                                      # compile, record, first replays
  burst_step_ms(engine, prompt, 4)
  cache = create_cache(config, 1, engine.max_context, engine.dtype, engine.cache_dtype)
  state = prefill(config, weights, cache, jnp.asarray([prompt], jnp.int32), jnp.asarray([len(prompt)], jnp.int32),
                  Sampler.create(SamplingParams(), 1), kernels=engine.kernels)
  step = engine.step_fn(1, greedy=True)
  state = step(engine.weights, state)
  jax.block_until_ready(state)
  mark("decode-step", steps)
  for _ in range(steps):
    state = step(engine.weights, state)
  jax.block_until_ready(state)
  steps8 = engine.steps_fn(1, True, 8)
  block = jnp.zeros((8, 1), jnp.int32)
  state, block = steps8(engine.weights, state, block)
  jax.block_until_ready(block)
  mark("decode-steps-8", steps // 8)
  for _ in range(steps // 8):
    state, block = steps8(engine.weights, state, block)
  jax.block_until_ready(block)
  mark("warmup-loop")
  list(engine.stream_tokens([prompt], steps, SamplingParams(), 0, True, ignore_eos=True))
  mark("engine-loop", steps)                          # a whole request: prefill + steps - 1 decode steps
  list(engine.stream_tokens([prompt], steps, SamplingParams(), 0, True, ignore_eos=True))
  mark("streaming-loop", steps)                       # the same request read token by token (not pipelined)
  list(engine.stream_tokens([prompt], steps, SamplingParams(), 0, False, ignore_eos=True))

  copies, n, k = 64, 1152, 896
  w8 = jax.random.randint(jax.random.PRNGKey(0), (copies, n, k), -127, 128, jnp.int8)
  scale = jnp.full((copies, n, k // GROUP), 0.01, jnp.float32)
  xs = [jax.random.normal(jax.random.PRNGKey(i), (1, k), jnp.bfloat16) for i in (1, 2)]

  def body(x, w8, scale, outs):
    return [ffi.w8a16_matmul(x, Linear(w8, scale), i) for i in range(copies)]

  fn = jax.jit(body, donate_argnums=(3,), keep_unused=True)
  outs = [jnp.zeros((1, n), jnp.bfloat16) for _ in range(copies)]
  mark("warmup-64")
  for _ in range(3):
    outs = fn(xs[0], w8, scale, outs)
  jax.block_until_ready(outs)
  mark("aliased-64", 10)                              # same input, outputs donated back: no update expected
  for _ in range(10):
    outs = fn(xs[0], w8, scale, outs)
  jax.block_until_ready(outs)
  mark("alternating-input", 10)                       # the control: the input's address changes every time
  for i in range(10):
    outs = fn(xs[(i + 1) % 2], w8, scale, outs)
  jax.block_until_ready(outs)
  mark("end")


def _has_gpu() -> bool:
  import jax
  return any(d.platform == "gpu" for d in jax.devices())


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="synthetic:qwen2.5-0.5b")
  p.add_argument("--steps", type=int, default=64)
  p.add_argument("--json", help="write the counts here")
  p.add_argument("--log", help="keep the child's full log here")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child:
    child(args.model, args.steps)
    return 0
  if not _has_gpu():
    print("bench/graph_diag.py reads XLA's command-buffer log, which only a GPU writes: no GPU here, nothing "
          "to do", file=sys.stderr)
    return 0
  env = dict(os.environ, TF_CPP_VMODULE="command_buffer_thunk=3", TF_CPP_MIN_LOG_LEVEL="0")
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--model", args.model,
                         "--steps", str(args.steps)], env=env, capture_output=True, text=True)
  if args.log:
    with open(args.log, "w") as f:
      f.write(proc.stderr)
  if proc.returncode != 0:
    sys.stderr.write(proc.stderr[-4000:])
    raise SystemExit(f"graph_diag child failed with exit code {proc.returncode}")
  counts = count_log_segments(proc.stderr, MARK)
  counts = {name: c for name, c in counts.items() if name != "end" and not name.startswith("warmup")}
  result = {"model": args.model, "steps": args.steps, "segments": counts}
  print(json.dumps(result, indent=1))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  if not counts.get("alternating-input", {}).get("updates"):
    print("XLA logged no command-buffer updates even for the control (no GPU, graphs off, or the log "
          "format changed): nothing is shown", file=sys.stderr)
    return 2
  return 1 if counts["decode-step"]["updates"] or counts["decode-steps-8"]["updates"] else 0


if __name__ == "__main__":
  sys.exit(main())
