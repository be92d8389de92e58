"""The CUDA Graphs switch: XLA command buffers on by default, off by JAXLLM_CUDA_GRAPHS=0 or --no-graphs.

The switch is applied per executable through compiler options, so graphs-on and graphs-off executables
can live in one process. If the user put `--xla_gpu_enable_command_buffer` in XLA_FLAGS themselves, that
setting wins and is reported.
"""
from __future__ import annotations

import os
import re

ENV_VAR = "JAXLLM_CUDA_GRAPHS"
_FLAG = "xla_gpu_enable_command_buffer"


def graphs_requested(no_graphs: bool = False) -> bool:
  """Whether command buffers are wanted: on unless JAXLLM_CUDA_GRAPHS=0 or no_graphs."""
  if no_graphs:
    return False
  value = os.environ.get(ENV_VAR, "1").strip().lower()
  if value not in ("0", "1", "false", "true", "off", "on", ""):
    raise ValueError(f"{ENV_VAR} must be 0 or 1, got {os.environ[ENV_VAR]!r}")
  return value not in ("0", "false", "off")


def user_xla_flag() -> str | None:
  """The command-buffer setting from the user's XLA_FLAGS, verbatim, or None."""
  m = re.search(rf"--{_FLAG}=(\S*)", os.environ.get("XLA_FLAGS", ""))
  return m.group(1) if m else None


def compiler_options(enabled: bool) -> dict[str, str]:
  """Per-executable XLA options for the wanted graph setting (empty where XLA_FLAGS decides)."""
  if user_xla_flag() is not None or enabled:
    return {}
  return {_FLAG: ""}
