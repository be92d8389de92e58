"""jaxllm: a JAX/XLA compiled LLM decode engine for GGUF models (W8A16, CUDA Graphs, XLA FFI kernels).

Public API:
  load(model, quant, dtype) -> (Config, Weights, Tokenizer); quant "auto" keeps a file's 4/5/6-bit blocks on the CPU
  Engine: compiled prefill/decode with a generate loop
  create_cache, prefill, extend, decode_step, sequence_logits, continuation_logprobs: pure functions for
    your own jit/vmap/scan; Engine.generate_batch for several prompts; score() for batched log-likelihoods
  SamplingParams (a request's settings), Sampler (the same as per-sequence device arrays), eog_table
  DecodeState, KVCache, Weights, Config, Tokenizer, GGUFFile, GGUFError, ChatTemplateError, DeviceMemoryError
  DEMO_MODELS, fetch_demo_model, random_weights
  make_mesh(N): the mesh for Engine(..., mesh=) to run tensor parallel over N devices (jaxllm.parallel)
"""
from jaxllm import graphs
from jaxllm.cache import KVCache, create_cache
from jaxllm.chat_template import ChatTemplateError
from jaxllm.config import Config
from jaxllm.decode import DecodeState, decode_step, eog_table, extend, prefill, sequence_logits
from jaxllm.device_memory import DeviceMemoryError
from jaxllm.engine import Engine, GenerationResult
from jaxllm.gguf import GGUFError, GGUFFile
from jaxllm.load import default_dtype, load
from jaxllm.model import Weights
from jaxllm.models import DEFAULT_MODEL, DEMO_MODELS, fetch_demo_model
from jaxllm.parallel import make_mesh
from jaxllm.sampling import Sampler, SamplingParams
from jaxllm.scoring import continuation_logprobs, score
from jaxllm.tokenizer import StreamDecoder, Tokenizer
from jaxllm.weights import random_weights

__version__ = "0.1.0"

__all__ = [
    "ChatTemplateError", "Config", "DEFAULT_MODEL", "DEMO_MODELS", "DecodeState", "DeviceMemoryError", "Engine",
    "GGUFError", "GGUFFile", "GenerationResult", "KVCache", "Sampler", "SamplingParams", "StreamDecoder", "Tokenizer",
    "Weights",
    "continuation_logprobs", "create_cache", "decode_step", "default_dtype", "eog_table", "extend",
    "fetch_demo_model", "load", "make_mesh", "prefill", "random_weights", "score", "sequence_logits",
]
