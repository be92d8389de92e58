#!/usr/bin/env bash
# On a lent GPU (a device call from the repository root, carrying .whl/ and .carry/commit):
#   1. bench/mma_coal.cu: the tensor-core W8A16 arithmetic fed from a block-wide cp.async ring with whole-row-segment
#      reads (bench/w8a16_mma_coal.cuh) beside ffi/w8a16_mma.cuh's configurations and a contiguous read, on the 7B and
#      0.5B matmuls at 16, 64, 13 and 50 rows (weights rotated over ~1 GB);
#   2. bench/step_profile.py at 7B, batch 1 and 16, kernels auto: where the step's time goes on this card.
# The extension builds in the background while the bench runs. Records under $OUT/g.tgz.
set -u
export DEADLINE=${DEADLINE:-560}
INC="-I ffi -I bench -I $(python3 -c 'import jax; print(jax.ffi.include_dir())')"
mkdir -p /tmp/coal
nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a $INC bench/mma_coal.cu -o /tmp/coal/mma_coal \
  > /tmp/coal/build_coal.log 2>&1 &
NV=$!
source bench/device_call.sh       # builds the extension (about 70 s)
wait $NV; stamp "built mma_coal rc $?"; cp /tmp/coal/build_coal.log $R/
room 120 "coal" && { timeout 200 /tmp/coal/mma_coal $R/coal.jsonl \
  gate_up_7b,down_7b,qkv_7b,o_7b,gate_up_0.5b,down_0.5b,odd_n 16,64,13,50 > $R/coal.log 2>&1; stamp "coal rc $?"; }
export JAXLLM_TEST_OFFLINE=1
room 110 "profile 7b b1" && { timeout 150 python3 bench/step_profile.py --model synthetic:qwen2.5-7b --batch 1 \
  --kernels auto --out $R/profile_7b_b1.json > $R/profile_7b_b1.log 2>&1; stamp "profile b1 rc $?"; }
room 110 "profile 7b b16" && { timeout 150 python3 bench/step_profile.py --model synthetic:qwen2.5-7b --batch 16 \
  --kernels auto --out $R/profile_7b_b16.json > $R/profile_7b_b16.log 2>&1; stamp "profile b16 rc $?"; }
grep -v "^$" $R/coal.log | head -120
head -30 $R/profile_7b_b1.log; head -30 $R/profile_7b_b16.log
