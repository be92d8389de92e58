"""Model configuration: a frozen dataclass read from GGUF metadata.

The config is static: it is hashed into every compiled function, so two models with the same shapes share
compiled code and a change of shape recompiles.
"""
from __future__ import annotations

import dataclasses
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
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
    if self.rope_style not in ("normal", "neox"):
      raise ValueError(f"rope_style must be 'normal' or 'neox', got {self.rope_style!r}")

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
    """Builds a Config from GGUF key/value metadata (already decoded to Python values)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
      raise ValueError(f"unsupported architecture {arch!r}: jaxllm runs {', '.join(ARCHITECTURES)}")

    def get(key, default=None, required=True):
      full = f"{arch}.{key}"
      if full in meta:
        return meta[full]
      if required and default is None:
        raise ValueError(f"GGUF metadata lacks {full!r}, which a {arch} model needs")
      return default

    n_heads = int(get("attention.head_count"))
    d_model = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", d_model // n_heads))
    scaling = str(get("rope.scaling.type", "none", required=False))
    if scaling not in ("none", "linear"):
      raise ValueError(f"unsupported RoPE scaling {scaling!r}: jaxllm handles 'none', 'linear' and llama3 factors")
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
      vocab = len(meta["tokenizer.ggml.tokens"]) if "tokenizer.ggml.tokens" in meta else None
    if vocab is None:
      raise ValueError("GGUF metadata gives no vocabulary size")
    return cls(
        arch=arch,
        n_layers=int(get("block_count")),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        d_ff=int(get("feed_forward_length")),
        vocab_size=int(vocab),
        rms_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_base=float(get("rope.freq_base", 10000.0)),
        rope_style="normal" if arch == "llama" else "neox",
        rope_scaling=scaling,
        rope_scale=float(get("rope.scaling.factor", 1.0, required=False)),
        context_length=int(get("context_length", 4096)),
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        bos_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_id=meta.get("tokenizer.ggml.eos_token_id"),
    )
