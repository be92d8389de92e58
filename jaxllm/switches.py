"""The product's on/off environment switches (JAXLLM_CUDA_GRAPHS, JAXLLM_AUTOTUNE), read one way."""
from __future__ import annotations

import os

_ON, _OFF = ("1", "true", "on", ""), ("0", "false", "off")


def on(name: str) -> bool:
  """Whether the switch `name` is on: on unless set to 0, false or off (any case, spaces around); 1, true, on or
  empty keep it on; any other value is a ValueError that names the switch and the value."""
  value = os.environ.get(name, "1").strip().lower()
  if value not in _ON + _OFF:
    raise ValueError(f"{name} must be 0 or 1, got {os.environ[name]!r}")
  return value not in _OFF
