#!/usr/bin/env bash
# Fifteenth session, call 3: the command given to the device tool right after call 2, on its machine while still
# warm (llama-bench built, /tmp/q8.gguf written, the call 2 build installed), nothing else running: llama-bench,
# then call 2's best combination twice and main's kernels (JAXLLM_ATTN_SWIZZLE=0 with the default configurations).
LB=/tmp/lc/llama.cpp/build/bin/llama-bench; ls $LB /tmp/q8.gguf || exit 3; mkdir -p $OUT/r; export PYTHONPATH=/tmp/site
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $OUT/r/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi --loop pipelined"
timeout 35 $LB -m /tmp/q8.gguf -ngl 99 -fa 1 -p 128 -n 128 -r 3 -o jsonl > $OUT/r/llama.jsonl 2> $OUT/r/llama.err; echo llama rc=$?
for i in 1 2; do JAXLLM_EXP_DOWN=1 JAXLLM_EXP_QKV=2 timeout 30 $B --label "final idle $i: JAXLLM_EXP_DOWN=1 JAXLLM_EXP_QKV=2" >> $OUT/r/bench.log 2>&1; echo row rc=$?; done
JAXLLM_ATTN_SWIZZLE=0 timeout 30 $B --label "main's kernels, idle" >> $OUT/r/bench.log 2>&1
grep "\[bench\]" $OUT/r/bench.log | cut -c1-220; cat $OUT/r/llama.jsonl | cut -c1-600
