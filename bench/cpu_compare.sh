#!/usr/bin/env bash
# CPU comparison on the real demo models: jaxllm W8A16 (FFI and XLA paths) and float, beside llama.cpp
# (llama-cpp-python) on the same GGUF files. Writes JSONL and a report into ${DIR:-docs/results/cpu}.
set -eu
DIR=${DIR:-docs/results/cpu}
mkdir -p "$DIR"
OUT="$DIR/cpu.jsonl"
COMMON="--prompt-len 64 --loop pipelined --repeat 2"
for m in smollm2-135m qwen2.5-coder-0.5b; do
  python -m jaxllm.bench $m $COMMON --decode-len 64 --kernels ffi --quant w8a16 --label "$m w8a16 ffi" --out "$OUT"
  python -m jaxllm.bench $m $COMMON --decode-len 26 --kernels xla --quant w8a16 --label "$m w8a16 xla" --out "$OUT"
  python -m jaxllm.bench $m $COMMON --decode-len 64 --kernels ffi --quant none --label "$m float (ffi attention)" --out "$OUT"
  python bench/peers/llamacpp_bench.py $m --prompt-len 64 --decode-len 64 --repeat 2 --out "$OUT"
done
