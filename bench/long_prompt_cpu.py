"""A long prompt on the CPU, jaxllm beside llama.cpp on the same GGUF in the same run.

  python bench/long_prompt_cpu.py smollm2-135m --tokens 2600 --context 8192 --pairs 2 --json out.json

Needs llama-cpp-python (built for this CPU: see docs/benchmarks.md). The prompt is text (random token ids
of the model decoded, cut to --tokens of jaxllm's tokenizer), written to a file that both engines read and
tokenize themselves. jaxllm runs as a user runs it, `python -m jaxllm.generate MODEL -f FILE -c CONTEXT`
in a new process (one untimed run first fills its caches); its TTFT and peak RSS come from its --json
record. llama.cpp runs through bench/peers/llamacpp_bench.py (one warm-up request, then one timed) in a
new process. The two alternate, --pairs times; the ratio is per pair.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def make_prompt(model: str, tokens: int, path: str) -> int:
  import numpy as np
  from jaxllm.load import read_model
  from jaxllm.models import resolve_model
  _, tok = read_model(resolve_model(model))
  rng = np.random.default_rng(0)
  ids = tok.encode(tok.decode([int(t) for t in rng.integers(300, tok.vocab_size - 300, tokens + 200)]))[:tokens]
  text = tok.decode(ids)
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)
  return len(tok.encode(text))


def _run(cmd: list[str]) -> str:
  """A child's stdout; a child that fails ends this script with what it said on stderr (its last lines)."""
  proc = subprocess.run(cmd, capture_output=True, text=True)
  if proc.returncode:
    said = "\n".join(proc.stderr.strip().splitlines()[-3:]) or f"status {proc.returncode}"
    raise SystemExit(f"{os.path.basename(cmd[1]) if cmd[1] != '-m' else cmd[2]} failed: {said}")
  return proc.stdout


def ours(model: str, path: str, context: int) -> dict:
  out = _run([sys.executable, "-m", "jaxllm.generate", model, "-f", path, "-c", str(context), "-n", "8",
              "--ignore-eos", "--json", "-q"])
  r = json.loads(out.strip().splitlines()[-1])
  return {"ttft_ms": r["ttft_ms"], "peak_rss_bytes": r["peak_rss_bytes"], "prompt_tokens": len(r["prompt_ids"]),
          "tpot_ms": r["tpot_ms"]}


def llama(model: str, path: str, context: int) -> dict:
  with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
    out = f.name
  try:
    _run([sys.executable, os.path.join(HERE, "peers", "llamacpp_bench.py"), model, "--prompt-file", path,
          "--max-context", str(context), "--decode-len", "8", "--repeat", "1", "--out", out])
    with open(out) as f:
      r = json.loads(f.readline())
  finally:
    os.unlink(out)
  return {"ttft_ms": r["ttft_ms"], "peak_rss_bytes": r["peak_rss_bytes"], "prompt_tokens": r["prompt_len"],
          "tpot_ms": r["tpot_ms_mean"], "engine": r["engine"]}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("model")
  p.add_argument("--tokens", type=int, default=2600)
  p.add_argument("--context", type=int, default=8192)
  p.add_argument("--pairs", type=int, default=2)
  p.add_argument("--json")
  args = p.parse_args(argv)
  try:
    import llama_cpp  # noqa: F401  (the peer; asked before jaxllm's runs take their minutes)
  except ImportError:
    sys.path.insert(0, os.path.join(HERE, "peers"))
    from llamacpp_bench import NOT_INSTALLED
    raise SystemExit(NOT_INSTALLED) from None
  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "prompt.txt")
    n = make_prompt(args.model, args.tokens, path)
    ours(args.model, path, args.context)                       # fills the conversion and executable caches
    pairs = [{"llama.cpp": llama(args.model, path, args.context), "jaxllm": ours(args.model, path, args.context)}
             for _ in range(args.pairs)]
  for pr in pairs:
    pr["ttft_ratio"] = pr["jaxllm"]["ttft_ms"] / pr["llama.cpp"]["ttft_ms"]
  result = {"model": args.model, "prompt_tokens": n, "context": args.context, "pairs": pairs,
            "ttft_ratio_median": statistics.median(pr["ttft_ratio"] for pr in pairs)}
  for pr in pairs:
    print(f"[long prompt] {args.model} {n} tokens, context {args.context}: jaxllm TTFT "
          f"{pr['jaxllm']['ttft_ms'] / 1e3:.2f} s, peak RSS {pr['jaxllm']['peak_rss_bytes'] / 1e9:.2f} GB | llama.cpp "
          f"TTFT {pr['llama.cpp']['ttft_ms'] / 1e3:.2f} s, peak RSS {pr['llama.cpp']['peak_rss_bytes'] / 1e9:.2f} GB | "
          f"ratio {pr['ttft_ratio']:.2f}", file=sys.stderr)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
