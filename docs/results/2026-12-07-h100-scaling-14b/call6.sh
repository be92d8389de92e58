#!/usr/bin/env bash
# Call 6, on the machine of call 5 (warm, its release build and /tmp/site): the llama-3.1-8b batch-1 run that call 5's
# scaling lost to the GGUF writer's GPU client, alone.
export PYTHONPATH=/tmp/site; timeout 120 python3 -m jaxllm.bench synthetic:llama-3.1-8b --loop pipelined --batch 1 --kernels auto,ffi-unfused --decode-len 128 --repeat 2 --out $OUT/b8.jsonl > $OUT/b8.log 2>&1; echo rc $?; tail -40 $OUT/b8.log
