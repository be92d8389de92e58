#!/usr/bin/env bash
# CPU decode with 8 steps a call in a while loop (the CPU's default now), llama.cpp (llama-cpp-python 0.3.36
# built with AVX-512, 2 threads) on the same files, and one step a call (the previous default): one process a
# row, alternating, ROUNDS rounds. PAIRS_ONLY=1 runs just jaxllm's default and llama.cpp.
set -u
D=${D:-docs/results/2026-12-02-cpu-calls}
OUT=${OUT:-$D/decode.jsonl}
C="--decode-len 64 --repeat 2 --loop pipelined --kernels ffi --quant gguf"
for round in $(seq 1 ${ROUNDS:-3}); do
  for spec in ${SPECS:-"smollm2-135m:64" "qwen2.5-coder-0.5b:64" "smollm2-135m:1024"}; do
    m=${spec%%:*}; p=${spec##*:}
    python -m jaxllm.bench $m --prompt-len $p $C --label "$m p$p default (8 a call, while), round $round" --out $OUT
    python bench/peers/llamacpp_bench.py $m --prompt-len $p --decode-len 64 --repeat 2 --out $OUT
    [ "${PAIRS_ONLY:-0}" = 1 ] && continue
    python -m jaxllm.bench $m --prompt-len $p $C --tokens-per-call 1 --label "$m p$p one a call, round $round" --out $OUT
  done
done
