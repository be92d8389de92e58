"""The ops the model calls through, one module per kernel, each with its pure-jnp reference beside it.

`kernels` selects the implementation: "xla" runs the references (pure jnp, XLA fuses them), "ffi" runs
jaxllm's own kernels through the XLA FFI (see jaxllm/kernels/ffi.py), "auto" picks "ffi" where the
extension is built and loads, else "xla"; "ffi-unfused" runs the FFI kernels without the decode step's
fusions (jaxllm/kernels/fused.py), for comparison.
"""
from jaxllm.kernels.attention import (decode_attention, decode_attention_reference, prefill_attention,
                                     prefill_attention_blocked, prefill_attention_reference)
from jaxllm.kernels.linear import linear, linear_reference
from jaxllm.kernels.select import KERNEL_CHOICES, resolve_kernels, uses_ffi

__all__ = ["KERNEL_CHOICES", "decode_attention", "decode_attention_reference", "linear",
           "linear_reference", "prefill_attention", "prefill_attention_blocked", "prefill_attention_reference",
           "resolve_kernels", "uses_ffi"]
