#!/usr/bin/env bash
# CPU decode of the demo files with Mixed stacks (Q4_K layers as 4-bit LowBit, a layer's qkv split where its
# v is Q8_0) against llama.cpp (llama-cpp-python 0.3.36 built with AVX-512, 2 threads) on the same files:
# one process a row, alternating, ROUNDS rounds (run from the repository root).
set -u
D=${D:-docs/results/2026-12-02-cpu-mixed}
OUT=${OUT:-$D/decode.jsonl}
C="--decode-len 64 --repeat 2 --loop pipelined --kernels ffi --quant gguf"
for round in $(seq 1 ${ROUNDS:-4}); do
  for spec in ${SPECS:-"qwen2.5-coder-0.5b:64" "smollm2-135m:64"}; do
    m=${spec%%:*}; p=${spec##*:}
    python -m jaxllm.bench $m --prompt-len $p $C --label "$m p$p ${LABEL:-mixed}, round $round" --out $OUT
    python bench/peers/llamacpp_bench.py $m --prompt-len $p --decode-len 64 --repeat 2 --out $OUT
  done
done
