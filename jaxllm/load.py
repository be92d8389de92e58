"""load(): a model path or demo name -> (config, weights, tokenizer), through the cache of converted models.

First run of a file: parse and validate the GGUF, convert it layer by layer to W8A16 (each finished array
written to the cache and moved to the device), build the tokenizer. Later runs: the cached arrays are
mapped from disk and copied to the device, the config and tokenizer read back; the GGUF is not parsed.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm import store
from jaxllm.config import Config
from jaxllm.gguf import GGUFError, GGUFFile
from jaxllm.model import Weights
from jaxllm.models import resolve_model
from jaxllm.progress import Stages
from jaxllm.quant import LOWBIT_BITS
from jaxllm.tokenizer import Tokenizer
from jaxllm.weights import assemble, convert, progress_total, resolve_quant


def default_dtype():
  """bf16 activations on GPU; f32 on CPU, where XLA's bf16 matmuls are slow."""
  return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32


def read_model(path) -> tuple[GGUFFile, Tokenizer]:
  """Opens and validates a GGUF model file and builds its tokenizer; every defect is a GGUFError."""
  gf = GGUFFile(path)
  try:
    tokenizer = Tokenizer(gf.metadata, source=gf.path)
  except ValueError as e:
    raise GGUFError(f"{gf.path!r}: {e}") from None
  if tokenizer.vocab_size != gf.config.vocab_size:
    raise GGUFError(f"{gf.path!r}: the tokenizer has {tokenizer.vocab_size} tokens, but the model's embedding "
                    f"has {gf.config.vocab_size} rows")
  return gf, tokenizer


def conversion_line(gf: GGUFFile, quant: str, dtype) -> str:
  """What converting the file's layer matrices does, in words: e.g. "convert Q4_1 blocks for the CPU kernels"."""
  types = sorted({gf.tensor_type(n) for n in gf.tensor_names()
                  if n.startswith("blk.") and len(gf.tensor_shape(n)) == 2})
  kept = [t for t in types if t in LOWBIT_BITS or t == "Q6_K"]
  rest = [t for t in types if t not in kept]
  kernels = f"the {jax.default_backend().upper()} kernels"
  if quant == "none":
    return f"dequantize {'/'.join(types)} weights to {jnp.dtype(dtype).name}"
  if quant == "gguf" and kept:
    return f"convert {'/'.join(kept)} blocks for {kernels}" + (f" ({'/'.join(rest)} as W8A16)" if rest else "")
  return f"re-quantize {'/'.join(types)} weights to W8A16 for {kernels}"


class _UnitBytes:
  """convert()'s progress units (jaxllm.weights.progress_total: layers of each stacked array, then rows of the
  embedding and of the head) as bytes of the file's tensors, so a bar's time left follows the bytes left:
  the layer units share the layers' bytes, the rows their tensor's."""

  def __init__(self, gf: GGUFFile, units: int):
    c, names = gf.config, gf.tensor_names()
    heads = ["token_embd.weight"] + ([] if c.tied_embeddings else ["output.weight"])
    layers = sum(gf.tensor_nbytes(n) for n in names if n.startswith("blk."))
    self.segments = [[units - c.vocab_size * len(heads), layers]]
    self.segments += [[c.vocab_size, gf.tensor_nbytes(n)] for n in heads]
    self.total = sum(b for _, b in self.segments)

  def take(self, n: int) -> float:
    """The bytes of the next n units."""
    got = 0.0
    for seg in self.segments:
      k = min(n, seg[0])
      if k:
        share = seg[1] * k / seg[0]
        got, seg[0], seg[1], n = got + share, seg[0] - k, seg[1] - share, n - k
    return got


def load(model: str, quant: str = "auto", dtype=None, progress: bool | Stages = True,
         cache: bool = True) -> tuple[Config, Weights, Tokenizer]:
  """Loads a GGUF model.

  Args:
    model: a .gguf path or a demo-model name (jaxllm.DEMO_MODELS).
    quant: "auto" (the default: "gguf" on the CPU, "w8a16" on the GPU), "w8a16" (int8 weights re-quantized
      from the file), "gguf" (the file's own Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q6_K blocks kept, layer by layer,
      W8A16 for other types) or "none" (float weights, for reference runs); jaxllm.weights says more.
    dtype: activation dtype (default_dtype() if None); float weights are stored in it.
    progress: True prints a line per stage (and a bar on a terminal), False nothing; or a Stages.
    cache: use and fill the cache of converted models (jaxllm.store).
  Returns:
    (config, weights, tokenizer). With a Stages for `progress`, its `times` hold each stage's seconds.
  """
  stages = progress if isinstance(progress, Stages) else Stages(quiet=not progress)
  dtype = dtype or default_dtype()
  quant = resolve_quant(quant)
  path = resolve_model(model, stages)
  stages.line(f"model: {path}")
  key = store.model_key(path, quant, jnp.dtype(dtype).name) if cache else None
  hit = store.load(key) if cache else None
  if hit is not None:
    with stages.stage("load cached conversion"):
      config, tokenizer_state, arrays = hit
      tokenizer = Tokenizer.from_state(tokenizer_state, source=path)
      weights = assemble(arrays)
      jax.block_until_ready(weights)
    return config, weights, tokenizer
  with stages.stage("read model"):
    gf, tokenizer = read_model(path)
  entry = store.Entry(key) if cache else None
  c = gf.config
  try:
    what = conversion_line(gf, quant, dtype)
    units = _UnitBytes(gf, progress_total(c))
    with stages.stage("convert") as info, stages.bar(units.total, what) as bar:
      info["line"] = f"{what}: {{s:.2f}} s" + (" (saved for the next run)" if cache else "")
      def sink(name, array):
        if entry is not None:
          entry.add(name, array)
        return jax.device_put(array)
      weights = assemble(convert(gf, quant, dtype, lambda n: bar.update(units.take(n)), sink))
      jax.block_until_ready(weights)
    if entry is not None:
      entry.commit(c, tokenizer.to_state())
  except BaseException:
    if entry is not None:
      entry.abort()
    raise
  return c, weights, tokenizer
