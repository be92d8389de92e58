#!/usr/bin/env bash
# Call 5: on call 4's machine, still warm (jaxllm built, llama-bench built, /tmp/q8.gguf written) and now
# idle: the two headline runs and llama-bench again, nothing in the background.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 JAXLLM_GIT_COMMIT=af0393b; R=$OUT/r; mkdir -p $R
python3 -c "import jaxllm._ffi" || exit 1
LB=/tmp/lc/llama.cpp/build/bin/llama-bench; ls -la $LB /tmp/q8.gguf > $R/present.txt 2>&1
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3"
timeout 45 $B --kernels ffi --loop both --label "idle: fused, K=8 (default)" > $R/bench.log 2>&1
timeout 35 $B --kernels ffi-unfused --loop pipelined --tokens-per-call 1 --label "idle: unfused, K=1" >> $R/bench.log 2>&1
timeout 35 $LB -m /tmp/q8.gguf -ngl 99 -fa 1 -p 128 -n 128 -r 3 -o jsonl > $R/llama.jsonl 2> $R/llama.err
