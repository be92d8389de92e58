#!/usr/bin/env bash
# Issue 36's scaling beside llama.cpp (bench/scaling.py, Q8_0 peers; auto and ffi-unfused; batch 1, 16, 64).
# On an H200: its acceptance shapes (7B, 0.5B, 1B). On an H100 (whose 0.5B/1B/7B rows are in
# docs/results/2026-12-07-h100-vmap-alias.md): the 8B and 14B shapes, not yet run beside llama.cpp.
set -u
ROOT=$PWD
[ -s .carry/vocab.gguf ] || xz -dc .carry/vocab.gguf.xz > .carry/vocab.gguf
export DEADLINE=${DEADLINE:-560}
source bench/device_call.sh
use_llamacpp $ROOT/.carry/llamacpp-cuda-sm90.tar.xz || exit 1
B=/tmp/llamacpp-bin
if grep -q H200 $R/env.txt; then P=qwen2.5-7b,qwen2.5-0.5b,llama-3.2-1b; else P=llama-3.1-8b,qwen2.5-14b; fi
stamp "presets $P"
timeout $(( $(left) )) python3 bench/scaling.py --dir $R/scaling --presets ${PRESETS:-$P} \
  --batches 1,16,64 --kernels auto,ffi-unfused --llama-bench $B/llama-bench --llama-batched-bench $B/llama-batched-bench \
  --vocab $ROOT/.carry/vocab.gguf --peer-types ${PEERS:-Q8_0} --gguf-dir /tmp/gguf \
  --time-limit $(( $(left) - 10 )) --check > $R/scaling.log 2>&1; stamp "scaling rc $?"
cp $R/scaling/*.jsonl $R/scaling.md $R/scaling/*.png $OUT/ 2>/dev/null
rm -rf /tmp/gguf
cat $R/scaling.md 2>/dev/null | head -40
