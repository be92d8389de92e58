#!/usr/bin/env bash
# On a lent GPU (carrying .whl/ and .carry/commit): bench/mma_coal.cu with the persistent ring (bench/w8a16_mma_coal.cuh
# Persistent) beside the first call's best ring configurations and ffi/w8a16_mma.cuh's, the 7B matmuls and LM head
# and the 0.5B gate/up and down at 16 and 64 rows, odd_n at 13 and 50 (part-filled tiles, rows past N).
set -u
INC="-I ffi -I bench -I $(python3 -c 'import jax; print(jax.ffi.include_dir())')"
mkdir -p $OUT/r
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/r/env.txt
nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a $INC bench/mma_coal.cu -o /tmp/mma_coal > $OUT/r/build_coal.log 2>&1 || { tail $OUT/r/build_coal.log; exit 1; }
timeout 240 /tmp/mma_coal $OUT/r/coal.jsonl gate_up_7b,down_7b,qkv_7b,o_7b,lm_head_7b,gate_up_0.5b,down_0.5b 16,64 > $OUT/r/coal.log 2>&1
echo "coal rc $?"
timeout 60 /tmp/mma_coal $OUT/r/coal_odd.jsonl odd_n 13,50 > $OUT/r/coal_odd.log 2>&1
echo "odd rc $?"
grep -c WRONG $OUT/r/coal.log $OUT/r/coal_odd.log
grep -v "^$" $OUT/r/coal.log | grep -v "x[3-9]\.[0-9]* read\|x1[0-9]\." | head -90
