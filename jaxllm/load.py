"""load(): a model path or demo name -> (config, weights, tokenizer)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.config import Config
from jaxllm.gguf import GGUFError, GGUFFile
from jaxllm.model import Weights
from jaxllm.models import resolve_model
from jaxllm.tokenizer import Tokenizer
from jaxllm.weights import load_weights


def default_dtype():
  """bf16 activations on GPU; f32 on CPU, where XLA's bf16 matmuls are slow."""
  return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32


def load(model: str, quant: str = "w8a16", dtype=None, progress: bool = True) -> tuple[Config, Weights, Tokenizer]:
  """Loads a GGUF model.

  Args:
    model: a .gguf path or a demo-model name (jaxllm.DEMO_MODELS).
    quant: "w8a16" or "none" (float weights, for reference runs).
    dtype: activation dtype (default_dtype() if None); float weights are stored in it.
  Returns:
    (config, weights, tokenizer).
  """
  gf, tokenizer = read_model(resolve_model(model))
  weights = load_weights(gf, quant=quant, dtype=dtype or default_dtype(), progress=progress)
  return gf.config, weights, tokenizer


def read_model(path) -> tuple[GGUFFile, Tokenizer]:
  """Opens and validates a GGUF model file and builds its tokenizer; every defect is a GGUFError."""
  gf = GGUFFile(path)
  try:
    tokenizer = Tokenizer(gf.metadata)
  except ValueError as e:
    raise GGUFError(f"{gf.path!r}: {e}") from None
  if tokenizer.vocab_size != gf.config.vocab_size:
    raise GGUFError(f"{gf.path!r}: the tokenizer has {tokenizer.vocab_size} tokens, but the model's embedding "
                    f"has {gf.config.vocab_size} rows")
  return gf, tokenizer
