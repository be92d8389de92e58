#!/usr/bin/env bash
# CPU, qwen2.5-coder-0.5b (Q4_K_M: the file's own 4/5/6-bit blocks): TTFT of a 32-token prompt (one prefill
# chunk of 32 rows, the low-bit kernels' several-rows path) and batch-4 decode, with the register-tiled
# several-rows path (this commit) and the loop before it (ffi/lowbit_cpu.cc of HEAD~, REF below), rebuilt in
# place between rows; llama.cpp (llama-cpp-python 0.3.36, AVX-512 build, 2 threads) on the same file. Run from
# the repository root in the venv; writes $D/prefill.jsonl.
set -u
D=${D:-docs/results/2026-12-02-cpu-prefill}
REF=${REF:-HEAD~}
OUT=$D/prefill.jsonl
build() { pip install -q -e . -Ccmake.define.JAXLLM_CUDA=OFF > /dev/null 2>&1; }
cp ffi/lowbit_cpu.cc /tmp/lowbit_tiled.cc
B="python -m jaxllm.bench qwen2.5-coder-0.5b --decode-len 16 --repeat 3 --loop pipelined --kernels ffi --quant gguf --out $OUT"
for round in 1 2; do
  cp /tmp/lowbit_tiled.cc ffi/lowbit_cpu.cc; build
  JAXLLM_COMPILE_CACHE=0 $B --prompt-len 32 --label "tiled, p32, round $round"
  JAXLLM_COMPILE_CACHE=0 $B --prompt-len 32 --batch 4 --label "tiled, p32 batch 4, round $round"
  python bench/peers/llamacpp_bench.py qwen2.5-coder-0.5b --prompt-len 32 --decode-len 16 --repeat 3 --out $OUT
  git show $REF:ffi/lowbit_cpu.cc > ffi/lowbit_cpu.cc; build
  JAXLLM_COMPILE_CACHE=0 $B --prompt-len 32 --label "before, p32, round $round"
  JAXLLM_COMPILE_CACHE=0 $B --prompt-len 32 --batch 4 --label "before, p32 batch 4, round $round"
done
cp /tmp/lowbit_tiled.cc ffi/lowbit_cpu.cc; build
