"""The CUDA Graphs switch: XLA command buffers on by default, off by JAXLLM_CUDA_GRAPHS=0 or --no-graphs.

The switch is applied per executable through compiler options, so graphs-on and graphs-off executables
can live in one process. If the user put `--xla_gpu_enable_command_buffer` in XLA_FLAGS themselves, that
setting wins and is reported.

What XLA actually did is read from its dump: graph_state compiles an engine's decode step once more with
`xla_dump_to` and reads the thunk sequence (read_dump, parse_thunk_sequence).
"""
from __future__ import annotations

import glob
import os
import re
import tempfile

import jax

from jaxllm import switches
from jaxllm.executables import jax_cache_off

ENV_VAR = "JAXLLM_CUDA_GRAPHS"
_FLAG = "xla_gpu_enable_command_buffer"


def graphs_requested(no_graphs: bool = False) -> bool:
  """Whether command buffers are wanted: on unless JAXLLM_CUDA_GRAPHS=0 or no_graphs."""
  if no_graphs:
    return False
  return switches.on(ENV_VAR)


def user_xla_flag() -> str | None:
  """The command-buffer setting from the user's XLA_FLAGS, verbatim, or None."""
  m = re.search(rf"--{_FLAG}=(\S*)", os.environ.get("XLA_FLAGS", ""))
  return m.group(1) if m else None


def compiler_options(enabled: bool) -> dict[str, str]:
  """Per-executable XLA options for the wanted graph setting (empty where XLA_FLAGS decides)."""
  if user_xla_flag() is not None or enabled:
    return {}
  return {_FLAG: ""}


_THUNK = re.compile(r"\bk([A-Z][A-Za-z0-9]+)")
_CONTAINERS = {"CommandBuffer", "Sequential", "WaitForStreams", "While", "Conditional"}


def parse_thunk_sequence(text: str) -> dict:
  """Reads XLA's thunk-sequence dump: how many command buffers and what share of the work they hold.

  A line naming a thunk kind (kKernel, kGemm, kCustomCall, kCommandBuffer, ...) is one thunk, nested (by
  indentation) in the thunks above it with less indentation: a while loop's condition and body, a command
  buffer's commands. A work thunk (not a container: CommandBuffer, Sequential, While, Conditional, ...) is
  captured when any thunk it is nested in is a command buffer; coverage = captured / all work thunks.
  command_buffers counts the outermost ones.
  """
  entries = []
  for line in text.splitlines():
    m = _THUNK.search(line)
    if m:
      entries.append((len(line) - len(line.lstrip()), m.group(1)))
  if not entries:
    return {"command_buffers": 0, "work_thunks": 0, "captured": 0, "coverage": 0.0, "kinds_outside": {}}
  command_buffers, captured, outside, kinds = 0, 0, {}, {}
  stack: list[tuple[int, str]] = []   # (indent, kind) of the thunks the current one is nested in
  for indent, kind in entries:
    while stack and stack[-1][0] >= indent:
      stack.pop()
    inside = any(k == "CommandBuffer" for _, k in stack)
    if kind == "CommandBuffer" and not inside:
      command_buffers += 1
    if kind not in _CONTAINERS:
      kinds[kind] = kinds.get(kind, 0) + 1
      if inside:
        captured += 1
      else:
        outside[kind] = outside.get(kind, 0) + 1
    stack.append((indent, kind))
  work = captured + sum(outside.values())
  return {"command_buffers": command_buffers, "work_thunks": work, "captured": captured,
          "coverage": captured / work if work else 0.0, "kinds_outside": outside, "work_kinds": kinds}


def read_dump(dump_dir: str) -> dict:
  """Graph state from an XLA dump directory (the largest module's thunk sequence)."""
  files = sorted(glob.glob(os.path.join(dump_dir, "*thunk_sequence*.txt")), key=os.path.getsize)
  if not files:
    return {"state": "unknown", "reason": f"XLA wrote no thunk-sequence dump into {dump_dir}"}
  with open(files[-1]) as f:
    info = parse_thunk_sequence(f.read())
  info["state"] = "on" if info["command_buffers"] else "off"
  info["dump_file"] = os.path.basename(files[-1])
  return info


def count_log_segments(log: str, marker: str) -> dict:
  """Command-buffer updates per segment of an XLA log taken with TF_CPP_VMODULE=command_buffer_thunk=3.

  A line `<marker><name> <executions>` opens a segment (the program's own count of the executions that
  follow). XLA logs "[Create/]Update command buffer ... updated_allocs=N" whenever a buffer address the
  graph was recorded with has changed and the graph is re-recorded, and (in some versions) "Execute
  command buffer" for every replay.

  Returns {name: {"executions": n, "updates": n, "updated_allocs": [N, ...], "logged_executions": n}}.
  """
  out, current = {}, None
  for line in log.splitlines():
    if line.startswith(marker):
      name, _, count = line[len(marker):].strip().partition(" ")
      current = out[name] = {"executions": int(count) if count.strip().isdigit() else None, "updates": 0,
                             "updated_allocs": [], "logged_executions": 0}
    elif current is None:
      continue
    elif "Execute command buffer" in line:
      current["logged_executions"] += 1
    elif re.search(r"\bUpdate command buffer", line):
      current["updates"] += 1
      m = re.search(r"updated_allocs=(\d+)", line)
      current["updated_allocs"].append(int(m.group(1)) if m else None)
  return out


def graph_state(engine, greedy: bool | str = True, dump_dir: str | None = None) -> dict:
  """What XLA actually did with an Engine's decode step: compiles it once more with a dump and reads it.

  Returns a dict with "state" ("on" | "off" | "unknown"), "requested", the command-buffer count and
  the share of the step's work thunks they hold ("coverage"), and the user's XLA_FLAGS setting if any.
  What it compiles is the executable a batch-1 request runs: "tokens_per_call" steps, whose thunks are
  "work_thunks" in all and "work_thunks_per_step" per step.
  `dump_dir` keeps XLA's dump there (default: a temporary directory).
  """
  info = {"requested": engine.graphs_requested, "fallback": engine.graphs_fallback,
          "xla_flags_setting": user_xla_flag(),
          "backend": jax.default_backend(), "kernels": engine.kernels}
  if jax.default_backend() != "gpu":
    info.update(state="off", reason="XLA command buffers (CUDA graphs) exist only on the GPU backend")
    return info
  k = engine.tokens_per_call_for(1)
  info["tokens_per_call"] = k
  fn, donate, args = engine.decode_program(1, greedy, k)
  donate = (donate,) if isinstance(donate, int) else donate
  with tempfile.TemporaryDirectory(prefix="jaxllm-dump-") as tmp:
    target = dump_dir or tmp
    options = dict(engine.compiler_options, xla_dump_to=target)
    with jax_cache_off():               # a cached executable comes with no dump
      jax.jit(fn, donate_argnums=donate, compiler_options=options).lower(*args).compile()
    info.update(read_dump(target))
  if "work_thunks" in info:
    info["work_thunks_per_step"] = info["work_thunks"] / k
  return info
