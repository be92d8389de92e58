"""PyTorch baselines on the same shapes, same JSONL schema as jaxllm.bench:

  eager     HF transformers decode with a StaticCache
  graph     the recipe of shared/seeds/001: StaticCache + a manually captured torch.cuda.CUDAGraph of the decode step
  compile   the one-token step under torch.compile(mode="reduce-overhead") (CUDA graphs through
            torch.compile; the prompt runs eagerly, as in gpt-fast)

  python bench/peers/hf_torch.py synthetic:qwen2.5-0.5b --mode graph --out results.jsonl

A synthetic preset builds the HF model from its config with random weights (bf16 on CUDA), so no file is
needed on the GPU machine; a .gguf path or demo name loads the real weights. TTFT and every later token's
time are taken on the host after a device sync, as jaxllm.bench does.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from jaxllm.bench import SCHEMA_VERSION, check_length, environment, timing_stats, write_records


def _hf_config(cfg):
  from transformers import LlamaConfig, Qwen2Config, Qwen3Config
  common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                num_key_value_heads=cfg.n_kv_heads, rms_norm_eps=cfg.rms_eps, rope_theta=cfg.rope_base,
                max_position_embeddings=cfg.context_length, tie_word_embeddings=cfg.tied_embeddings)
  if cfg.arch == "qwen2":
    return Qwen2Config(**common)
  if cfg.arch == "qwen3":
    return Qwen3Config(head_dim=cfg.head_dim, **common)
  return LlamaConfig(head_dim=cfg.head_dim, **common)


def load(model: str, device: str, dtype):
  import torch
  from transformers import AutoModelForCausalLM
  if model.startswith("synthetic:"):
    from jaxllm.presets import preset
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_hf_config(preset(model)), dtype=dtype).to(device).eval()
  from jaxllm.models import resolve_model
  path = resolve_model(model)
  return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).to(device).eval()


def run(args) -> dict:
  import torch
  from transformers import StaticCache
  device = args.device
  dtype = torch.bfloat16 if device == "cuda" else torch.float32
  model = load(args.model, device, dtype)
  rng = np.random.default_rng(args.seed)
  prompt = torch.tensor(rng.integers(0, model.config.vocab_size, (1, args.prompt_len)), device=device)
  cache = StaticCache(config=model.config, max_cache_len=args.prompt_len + args.decode_len + 16)

  def sync():
    if device == "cuda":
      torch.cuda.synchronize()

  def step(ids, pos):
    return model(input_ids=ids, past_key_values=cache, cache_position=pos, use_cache=True).logits[:, -1:]

  decode = step
  if args.mode == "compile":
    # As gpt-fast does: the prompt runs eagerly (it also allocates the cache's tensors, which a compiled
    # first call would allocate inside the graph), the one-token step is compiled with CUDA graphs. The
    # cache tensors are marked as static addresses, else inductor sees mutated inputs and skips graphs.
    decode = torch.compile(step, mode="reduce-overhead")

  def mark_cache_static():
    for layer in getattr(cache, "layers", []):
      for name in ("keys", "values", "cumulative_length"):
        t = getattr(layer, name, None)
        if torch.is_tensor(t):
          torch._dynamo.mark_static_address(t)

  def prefill():
    """Resets the cache and runs the prompt: (first token, next position, t0, [TTFT in s])."""
    cache.reset()
    t0 = time.perf_counter()
    pos = torch.arange(args.prompt_len, device=device)
    nxt = step(prompt, pos).argmax(-1)
    sync()
    return nxt, pos[-1:] + 1, t0, [time.perf_counter() - t0]

  embed = model.get_input_embeddings().weight
  weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed or
                     model.config.tie_word_embeddings)   # the embedding is read one row a token, unless it is the head
  requests = []
  graph = static_ids = static_pos = static_logits = None
  with torch.no_grad():
    for i in range(1 + args.repeat):
      nxt, pos, t0, times = prefill()
      if args.mode == "compile" and i == 0:
        mark_cache_static()
      if args.mode == "graph" and graph is None:      # capture once, after the first prefill (seed 001)
        static_ids, static_pos = nxt.clone(), pos.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
          for _ in range(3):
            step(static_ids, static_pos)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
          static_logits = step(static_ids, static_pos)
        nxt, pos, t0, times = prefill()               # cache.reset keeps the buffers: the graph stays valid
      for _ in range(args.decode_len - 1):
        if graph is not None:
          static_ids.copy_(nxt)
          static_pos.copy_(pos)
          graph.replay()
          nxt = static_logits.argmax(-1)
        else:
          nxt = decode(nxt, pos).argmax(-1)
        pos = pos + 1
        int(nxt[0, 0])                                 # the host reads every token, as a streaming loop does
        times.append(time.perf_counter() - t0)
      if i > 0:                                        # the first request warms up
        requests.append(times)
  return {"schema_version": SCHEMA_VERSION, "label": f"torch-{args.mode}", "model": args.model,
          "synthetic": args.model.startswith("synthetic:"), "engine": f"torch {torch.__version__}",
          "kernels": f"torch-{args.mode}", "loop": "streaming", "batch": 1, "prompt_len": args.prompt_len,
          "decode_len": args.decode_len, "repeat": args.repeat, **timing_stats(requests),
          "weight_bytes_per_token": weight_bytes, "env": environment()}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("model")
  p.add_argument("--mode", choices=("eager", "graph", "compile"), default="graph")
  p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
  p.add_argument("--prompt-len", type=int, default=128)
  p.add_argument("--decode-len", type=int, default=128)
  p.add_argument("--repeat", type=int, default=3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out")
  args = p.parse_args(argv)
  check_length(args.decode_len, 1, pipelined=False)                 # one token a call, each read
  if args.mode == "graph" and args.device != "cuda":
    raise SystemExit("--mode graph captures a CUDA graph: it needs --device cuda")
  rec = run(args)
  write_records([rec], args.out)
  print(f"[torch-{args.mode}] {args.model}: TTFT {rec['ttft_ms']:.2f} ms, TPOT {rec['tpot_ms_mean']:.3f} ms, "
        f"{rec['decode_tok_s']:.1f} tok/s", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
