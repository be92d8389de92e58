"""Synthetic models: the real shapes of known models with random weights, for benchmarks (no file needed)."""
from __future__ import annotations

import jax

from jaxllm.config import Config
from jaxllm.model import Weights

PRESETS = {
    "qwen2.5-0.5b": Config(arch="qwen2", n_layers=24, d_model=896, n_heads=14, n_kv_heads=2, head_dim=64,
                           d_ff=4864, vocab_size=151936, rms_eps=1e-6, rope_base=1e6, rope_style="neox",
                           context_length=32768, tied_embeddings=False, qkv_bias=True),
    "qwen3-0.6b": Config(arch="qwen3", n_layers=28, d_model=1024, n_heads=16, n_kv_heads=8, head_dim=128,
                         d_ff=3072, vocab_size=151936, rms_eps=1e-6, rope_base=1e6, rope_style="neox",
                         context_length=40960, tied_embeddings=True, qk_norm=True),
    "smollm2-135m": Config(arch="llama", n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, head_dim=64,
                           d_ff=1536, vocab_size=49152, rms_eps=1e-5, rope_base=1e5, rope_style="normal",
                           context_length=8192, tied_embeddings=True),
    "llama-3.2-1b": Config(arch="llama", n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8, head_dim=64,
                           d_ff=8192, vocab_size=128256, rms_eps=1e-5, rope_base=5e5, rope_style="normal",
                           context_length=131072, tied_embeddings=True),
    # The sizes people rent an H200 for (W8A16: 14B fits one H200), with their real shapes.
    "qwen2.5-1.5b": Config(arch="qwen2", n_layers=28, d_model=1536, n_heads=12, n_kv_heads=2, head_dim=128,
                           d_ff=8960, vocab_size=151936, rms_eps=1e-6, rope_base=1e6, rope_style="neox",
                           context_length=32768, tied_embeddings=True, qkv_bias=True),
    "qwen2.5-3b": Config(arch="qwen2", n_layers=36, d_model=2048, n_heads=16, n_kv_heads=2, head_dim=128,
                         d_ff=11008, vocab_size=151936, rms_eps=1e-6, rope_base=1e6, rope_style="neox",
                         context_length=32768, tied_embeddings=True, qkv_bias=True),
    "qwen2.5-7b": Config(arch="qwen2", n_layers=28, d_model=3584, n_heads=28, n_kv_heads=4, head_dim=128,
                         d_ff=18944, vocab_size=152064, rms_eps=1e-6, rope_base=1e6, rope_style="neox",
                         context_length=32768, tied_embeddings=False, qkv_bias=True),
    "llama-3.1-8b": Config(arch="llama", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128,
                           d_ff=14336, vocab_size=128256, rms_eps=1e-5, rope_base=5e5, rope_style="normal",
                           rope_scaling="llama3", context_length=131072, tied_embeddings=False),
    "qwen3-8b": Config(arch="qwen3", n_layers=36, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128,
                       d_ff=12288, vocab_size=151936, rms_eps=1e-6, rope_base=1e6, rope_style="neox",
                       context_length=40960, tied_embeddings=False, qk_norm=True),
    "qwen2.5-14b": Config(arch="qwen2", n_layers=48, d_model=5120, n_heads=40, n_kv_heads=8, head_dim=128,
                          d_ff=13824, vocab_size=152064, rms_eps=1e-5, rope_base=1e6, rope_style="neox",
                          context_length=32768, tied_embeddings=False, qkv_bias=True),
    # For tensor parallel over several GPUs (jaxllm.parallel): W8A16 is 33 GB, a step reads it all.
    "qwen2.5-32b": Config(arch="qwen2", n_layers=64, d_model=5120, n_heads=40, n_kv_heads=8, head_dim=128,
                          d_ff=27648, vocab_size=152064, rms_eps=1e-5, rope_base=1e6, rope_style="neox",
                          context_length=32768, tied_embeddings=False, qkv_bias=True),
}
# A two-layer model for smoke runs of the bench and its multi-process modes (seconds, not minutes).
PRESETS["tiny"] = PRESETS["smollm2-135m"].replace(n_layers=2, vocab_size=512)


def preset(name: str) -> Config:
  """The Config of a synthetic preset ("qwen2.5-0.5b" or "synthetic:qwen2.5-0.5b")."""
  key = name.removeprefix("synthetic:")
  if key not in PRESETS:
    raise ValueError(f"unknown synthetic preset {name!r}: choose one of "
                     f"{['synthetic:' + k for k in sorted(PRESETS)]}")
  return PRESETS[key]


def weight_bytes_per_token(weights: Weights) -> int:
  """Bytes of weights one decode step reads: every matrix and its scales except the embedding (one row)."""
  lins = (weights.wqkv, weights.wo, weights.w_gate_up, weights.w_down, weights.head)
  return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(lins))
