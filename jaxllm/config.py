"""Model configuration: a frozen dataclass read from GGUF metadata.

The config is static: it is hashed into every compiled function, so two models with the same shapes share
compiled code and a change of shape recompiles.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

ARCHITECTURES = ("llama", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class Config:
  arch: str               # "llama" | "qwen2" | "qwen3"
  n_layers: int
  d_model: int            # D
  n_heads: int            # H  (query heads)
  n_kv_heads: int         # G  (key/value heads; H % G == 0)
  head_dim: int           # Dh
  d_ff: int               # F
  vocab_size: int         # V
  rms_eps: float
  rope_base: float
  rope_style: str         # "normal" (adjacent pairs, llama) | "neox" (two halves, qwen)
  rope_scaling: str = "none"       # "none" | "linear" | "llama3" (factors from rope_freqs.weight)
  rope_scale: float = 1.0          # linear scaling factor
  context_length: int = 4096
  tied_embeddings: bool = False    # no output.weight: the head reuses token_embd
  qkv_bias: bool = False           # qwen2
  qk_norm: bool = False            # qwen3
  bos_id: int | None = None
  eos_id: int | None = None

  def __post_init__(self):
    if self.arch not in ARCHITECTURES:
      raise ValueError(f"unsupported architecture {self.arch!r}: expected one of {ARCHITECTURES}")
    for name, lo, hi in _INT_RANGES:
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
    for name, lo, hi in _FLOAT_RANGES:
      value = getattr(self, name)
      if not isinstance(value, (int, float)) or not math.isfinite(value) or not lo < value <= hi:
        raise ValueError(f"{name} must be a finite number in ({lo}, {hi}], got {value!r}")
    if self.rope_style not in ("normal", "neox"):
      raise ValueError(f"rope_style must be 'normal' or 'neox', got {self.rope_style!r}")
    if self.rope_scaling not in ("none", "linear", "llama3"):
      raise ValueError(f"rope_scaling must be 'none', 'linear' or 'llama3', got {self.rope_scaling!r}")
    for name in ("bos_id", "eos_id"):
      value = getattr(self, name)
      if value is not None and not (isinstance(value, int) and 0 <= value < self.vocab_size):
        raise ValueError(f"{name} must be a token id in [0, {self.vocab_size}), got {value!r}")

  @property
  def q_dim(self) -> int:
    return self.n_heads * self.head_dim

  @property
  def kv_dim(self) -> int:
    return self.n_kv_heads * self.head_dim

  def replace(self, **kw) -> "Config":
    return dataclasses.replace(self, **kw)

  @classmethod
  def from_metadata(cls, meta: Mapping[str, Any]) -> "Config":
    """Builds a Config from GGUF key/value metadata (already decoded to Python values).

    Raises ValueError naming the key for a missing, mistyped or out-of-range value.
    """
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
      raise ValueError(f"unsupported architecture {arch!r}: jaxllm runs {', '.join(ARCHITECTURES)}")

    def get(key, kind, default=None):
      full = f"{arch}.{key}" if not key.startswith("tokenizer.") else key
      if full not in meta:
        if default is None:
          raise ValueError(f"GGUF metadata lacks {full!r}, which a {arch} model needs")
        return default
      value = meta[full]
      ok = (isinstance(value, int) and not isinstance(value, bool)) if kind is int else \
          isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else isinstance(value, kind)
      if not ok:
        raise ValueError(f"GGUF metadata {full!r} must be {kind.__name__}, got {value!r}")
      return kind(value)

    n_heads = get("attention.head_count", int)
    d_model = get("embedding_length", int)
    if n_heads < 1:
      raise ValueError(f"GGUF metadata {arch + '.attention.head_count'!r} must be >= 1, got {n_heads}")
    head_dim = get("attention.key_length", int, d_model // n_heads)
    scaling = get("rope.scaling.type", str, "none")
    if scaling not in ("none", "linear"):
      raise ValueError(f"unsupported RoPE scaling {scaling!r}: jaxllm handles 'none', 'linear' and llama3 factors")
    tokens = meta.get("tokenizer.ggml.tokens")
    # The token list's length (a list of strings; GGUFFile gives a numeric array as numpy, which the tokenizer
    # then refuses by name).
    vocab = get("vocab_size", int, len(tokens) if isinstance(tokens, list) or hasattr(tokens, "ndim") else -1)
    if vocab == -1:
      raise ValueError("GGUF metadata gives no vocabulary size (neither vocab_size nor tokenizer.ggml.tokens)")
    return cls(
        arch=arch,
        n_layers=get("block_count", int),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=get("attention.head_count_kv", int, n_heads),
        head_dim=head_dim,
        d_ff=get("feed_forward_length", int),
        vocab_size=vocab,
        rms_eps=get("attention.layer_norm_rms_epsilon", float),
        rope_base=get("rope.freq_base", float, 10000.0),
        rope_style="normal" if arch == "llama" else "neox",
        rope_scaling=scaling,
        rope_scale=get("rope.scaling.factor", float, 1.0),
        context_length=get("context_length", int, 4096),
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        bos_id=get("tokenizer.ggml.bos_token_id", int, -1) if "tokenizer.ggml.bos_token_id" in meta else None,
        eos_id=get("tokenizer.ggml.eos_token_id", int, -1) if "tokenizer.ggml.eos_token_id" in meta else None,
    )


# Bounds that every real model sits well inside; a file outside them is corrupt or hostile, and the bounds
# keep sizes computed from them (caches, weights) finite before any tensor is read.
_INT_RANGES = (("n_layers", 1, 1024), ("d_model", 1, 1 << 16), ("n_heads", 1, 1024), ("n_kv_heads", 1, 1024),
               ("head_dim", 2, 1024), ("d_ff", 1, 1 << 18), ("vocab_size", 1, 1 << 22),
               ("context_length", 1, 1 << 24))
_FLOAT_RANGES = (("rms_eps", 0.0, 1.0), ("rope_base", 0.0, 1e12), ("rope_scale", 0.0, 1e6))
