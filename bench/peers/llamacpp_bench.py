"""llama.cpp baseline through llama-cpp-python, on the same GGUF files, same JSONL schema as jaxllm.bench.

  python bench/peers/llamacpp_bench.py smollm2-135m --prompt-len 128 --decode-len 128 --out results.jsonl

Greedy decoding of a random prompt, one warm-up request, then --repeat timed ones; TTFT and the time of
every later token are taken on the host from the token stream, as jaxllm.bench does.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from jaxllm.bench import SCHEMA_VERSION, _peak_rss, check_length, environment, timing_stats, write_records
from jaxllm.models import resolve_model

NOT_INSTALLED = ("llama-cpp-python is not installed. Build it for this CPU (the generic build leaves AVX-512 off and "
                 "reads ~1.8x slower here): CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON "
                 "-DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON\" "
                 "pip install llama-cpp-python==0.3.36 (docs/benchmarks.md)")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("model")
  p.add_argument("--prompt-len", type=int, default=128)
  p.add_argument("--decode-len", type=int, default=128)
  p.add_argument("--repeat", type=int, default=3)
  p.add_argument("--max-context", type=int, default=None, help="n_ctx (default: prompt + decode + 8)")
  p.add_argument("--prompt-file", help="use this text (UTF-8) as the prompt, tokenized by llama.cpp, instead of "
                                       "--prompt-len random tokens")
  p.add_argument("--threads", type=int, default=os.cpu_count())
  p.add_argument("--n-gpu-layers", type=int, default=0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out")
  args = p.parse_args(argv)
  check_length(args.decode_len, 1, pipelined=False)                 # one token a call, each read
  try:
    import llama_cpp
  except ImportError:
    raise SystemExit(NOT_INSTALLED)
  path = str(resolve_model(args.model))
  n_ctx = args.max_context or args.prompt_len + args.decode_len + 8   # (with --prompt-file, give --max-context)
  llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=args.threads,
                        n_gpu_layers=args.n_gpu_layers, verbose=False, seed=args.seed)
  rng = np.random.default_rng(args.seed)
  if args.prompt_file:
    with open(args.prompt_file, encoding="utf-8") as f:
      prompt = llm.tokenize(f.read().encode("utf-8"), add_bos=False, special=False)
  else:
    prompt = [int(t) for t in rng.integers(0, llm.n_vocab(), args.prompt_len)]
  requests = []
  for i in range(1 + args.repeat):
    llm.reset()
    t0 = time.perf_counter()
    times = []
    for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
      times.append(time.perf_counter() - t0)
      if len(times) >= args.decode_len:
        break
    if i > 0:                                          # the first request warms up
      requests.append(times)
  rec = {"schema_version": SCHEMA_VERSION, "label": "llama.cpp", "model": args.model, "synthetic": False,
         "engine": f"llama-cpp-python {llama_cpp.__version__}", "threads": args.threads,
         "n_gpu_layers": args.n_gpu_layers, "quant": os.path.basename(path), "loop": "streaming", "batch": 1,
         "prompt_len": len(prompt), "decode_len": args.decode_len, "max_context": n_ctx, "repeat": args.repeat,
         **timing_stats(requests), "peak_rss_bytes": _peak_rss(), "env": environment()}
  write_records([rec], args.out)
  print(f"[llama.cpp] {args.model}: TTFT {rec['ttft_ms']:.1f} ms, TPOT {rec['tpot_ms_mean']:.2f} ms, "
        f"{rec['decode_tok_s']:.1f} tok/s ({args.threads} threads), peak RSS {rec['peak_rss_bytes'] / 1e9:.2f} GB",
        file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
