#!/usr/bin/env bash
# The CPU decode on the GGUF file's own 4/5-bit blocks (--quant gguf) with jaxllm's spinning workers (the
# default), the same with XLA's pool (JAXLLM_CPU_WORKERS=0), W8A16, and llama.cpp (llama-cpp-python 0.3.36
# built with AVX-512, 2 threads) on the same files: one process a row, alternating, ROUNDS rounds.
# PAIRS_ONLY=1 runs just jaxllm's default and llama.cpp.
set -u
D=${D:-docs/results/2026-12-02-cpu-lowbit}
OUT=${OUT:-$D/decode.jsonl}
C="--decode-len 64 --repeat 2 --loop pipelined --kernels ffi"
for round in $(seq 1 ${ROUNDS:-2}); do
  for spec in ${SPECS:-"smollm2-135m:64" "qwen2.5-coder-0.5b:64" "smollm2-135m:1024"}; do
    m=${spec%%:*}; p=${spec##*:}
    python -m jaxllm.bench $m --prompt-len $p $C --quant gguf --label "$m p$p gguf, round $round" --out $OUT
    python bench/peers/llamacpp_bench.py $m --prompt-len $p --decode-len 64 --repeat 2 --out $OUT
    [ "${PAIRS_ONLY:-0}" = 1 ] && continue
    JAXLLM_CPU_WORKERS=0 python -m jaxllm.bench $m --prompt-len $p $C --quant gguf --label "$m p$p gguf, XLA pool, round $round" --out $OUT
    python -m jaxllm.bench $m --prompt-len $p $C --quant w8a16 --label "$m p$p w8a16, round $round" --out $OUT
  done
done
