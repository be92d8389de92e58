#!/usr/bin/env bash
# On a lent GPU (carrying .whl, .carry/whlfull with the suite's wheels, .carry/commit): the whole test suite
# (bench/gpu_check.sh), then, in the time left before 585 s, bench/mma_coal.cu (built beside the extension while the
# suite's build runs): the persistent ring against the kernel in use, 7B gate/up and LM head first.
set -u
T0=$(date +%s)
INC="-I ffi -I bench -I $(python3 -c 'import jax; print(jax.ffi.include_dir())')"
mkdir -p $OUT/coal
nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a $INC bench/mma_coal.cu -o /tmp/mma_coal > $OUT/coal/build.log 2>&1 &
rm -rf .whl && mv .carry/whlfull .whl
JAXLLM_TEST_OFFLINE=1 TESTS=all WORKERS=16 T_TESTS=450 OUT=$OUT bash bench/gpu_check.sh > $OUT/suite.log 2>&1
echo "suite rc $? at $(( $(date +%s) - T0 )) s"; tail -15 $OUT/suite.log
wait
left=$(( 585 - $(date +%s) + T0 ))
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/coal/env.txt
[ $left -gt 15 ] && timeout $left /tmp/mma_coal $OUT/coal/coal.jsonl gate_up_7b,lm_head_7b,down_7b,qkv_7b,o_7b,odd_n 16,64 \
  > $OUT/coal/coal.log 2>&1
echo "coal rc $? with $left s"
grep -v "^$" $OUT/coal/coal.log | grep -E "read |pers|mma_mt2_rt2_ks2_u4|mma_mt2_rt1_ks8_u8|mma_mt8_rt2_ks4|WRONG" | head -60
