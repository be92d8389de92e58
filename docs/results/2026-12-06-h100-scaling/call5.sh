#!/usr/bin/env bash
# Issue 36, requirement 5 / acceptance 3 on this card: 0.5B and 7B at batch 1, 16, 64, jaxllm auto and ffi-unfused
# beside llama-bench (batch 1) and llama-batched-bench (16, 64) on Q8_0 GGUFs of the same shapes, in one call.
set -u
ROOT=$PWD
[ -s .carry/vocab.gguf ] || xz -dc .carry/vocab.gguf.xz > .carry/vocab.gguf
export DEADLINE=${DEADLINE:-540}
source bench/device_call.sh
use_llamacpp $ROOT/.carry/llamacpp-cuda-sm90.tar.xz || exit 1
timeout $(left) python3 bench/scaling.py --dir $R/scaling --presets qwen2.5-0.5b,qwen2.5-7b --batches 1,16,64 \
  --kernels auto,ffi-unfused --llama-bench /tmp/llamacpp-bin/llama-bench \
  --llama-batched-bench /tmp/llamacpp-bin/llama-batched-bench --vocab $ROOT/.carry/vocab.gguf --peer-types Q8_0 \
  --gguf-dir /tmp/gguf --time-limit $(( $(left) - 15 )) > $R/scaling.log 2>&1; stamp "scaling rc $?"
cp $R/scaling/*.jsonl $R/scaling.md $R/scaling/*.png $OUT/ 2>/dev/null
cat $R/scaling.md 2>/dev/null | head -60
