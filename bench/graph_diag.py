"""Diagnoses command-buffer behaviour for FFI calls: run with TF_CPP_VMODULE set, e.g.

  TF_CPP_VMODULE=command_buffer_thunk=3,command_buffer_cmd=3 TF_CPP_MIN_LOG_LEVEL=0 \
      python bench/graph_diag.py 2> diag.log

It executes one program of 64 W8A16 calls (donated outputs, so addresses are stable) 10 times after
warm-up, printing a marker line before each execution so the log shows what XLA does per execution.
"""
import sys
import time

import jax
import jax.numpy as jnp

from jaxllm.kernels import ffi
from jaxllm.quant import GROUP, Linear

copies, n, k = 64, 1152, 896
w8 = jax.random.randint(jax.random.PRNGKey(0), (copies, n, k), -127, 128, jnp.int32).astype(jnp.int8)
scale = jnp.full((copies, n, k // GROUP), 0.01, jnp.float32)
x = jax.random.normal(jax.random.PRNGKey(1), (1, k), jnp.bfloat16)


def body(x, w8, scale, outs):
  return [ffi.w8a16_matmul(x, Linear(w8, scale), i) for i in range(copies)]


for graphs in (True, False):
  fn = jax.jit(body, donate_argnums=(3,),
               compiler_options=None if graphs else {"xla_gpu_enable_command_buffer": ""})
  outs = [jnp.zeros((1, n), jnp.bfloat16) for _ in range(copies)]
  for i in range(12):
    print(f"=== graphs={graphs} execution {i}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    outs = fn(x, w8, scale, outs)
    jax.block_until_ready(outs)
    print(f"=== graphs={graphs} execution {i}: {(time.perf_counter() - t0) * 1e6 / copies:.2f} us per call",
          file=sys.stderr, flush=True)
