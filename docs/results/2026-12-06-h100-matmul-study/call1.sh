#!/usr/bin/env bash
# On a lent GPU (a device call from the repository root, carrying .whl/ and .carry/commit): where the batched
# step's W8A16 time goes, most telling first, each started only while it fits before DEADLINE (default 565 s):
#   1. bench/mma_layout.cu: the tensor-core kernel on row-major against 1 KB-tiled weights, with x's loads a
#      chunk ahead, loads only in either pattern, a contiguous read (the 7B matmuls at 16 and 64 rows);
#   1b. bench/mma_ring.cu: the same kernel with its weights streamed through a per-warp cp.async ring in shared
#      memory (S chunks in flight, x through L1 or the ring), bit for bit against the kernel;
#   2. bench/matmul_chain.cu: the 7B and 0.5B steps' matmuls chained as the step runs them against each shape
#      alone, two layers' weights, a read-only chain, and at 16 and 64 rows each a programmatic dependent (PDL);
#   3. bench/step_profile.py at 7B batch 16 with kernels ffi and ffi-unfused: the attention block's kernels
#      either way (the fused block took 1.2% more time there, docs/results/2026-12-06-h100-attention-block.md).
# The benches are built on the machine (nvcc, sm_90a, about 15 s each). Records under $OUT/g.tgz: layout.jsonl,
# ring.jsonl, chain.jsonl, profile_ffi.json, profile_unfused.json and the logs.
set -u
export DEADLINE=${DEADLINE:-565}
source bench/device_call.sh
INC="-I ffi -I $(python3 -c 'import jax; print(jax.ffi.include_dir())')"
for b in mma_layout mma_ring matmul_chain; do
  nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a $INC bench/$b.cu -o /tmp/$b > $R/build_$b.log 2>&1
  stamp "built $b rc $?"
done
room 60 "layout" && { timeout 90 /tmp/mma_layout $R/layout.jsonl > $R/layout.log 2>&1; stamp "layout rc $?"; }
room 60 "ring" && { timeout 120 /tmp/mma_ring $R/ring.jsonl > $R/ring.log 2>&1; stamp "ring rc $?"; }
room 60 "chain" && { timeout 120 /tmp/matmul_chain $R/chain.jsonl 7b,0.5b 16,64,1 > $R/chain.log 2>&1; stamp "chain rc $?"; }
export JAXLLM_TEST_OFFLINE=1
for k in ffi ffi-unfused; do
  room 100 "profile $k" && { timeout 120 python3 bench/step_profile.py --model synthetic:qwen2.5-7b --batch 16 --kernels $k \
    --out $R/profile_${k#ffi-}.json > $R/profile_$k.log 2>&1; stamp "profile $k rc $?"; }
done
grep -E "M=16 |M=64 " $R/chain.log | head -20
grep -E "gate_up_7b|down_7b" $R/ring.log | head -70; grep -E "M=16 .*(row-major|tiled)( xpf)? " $R/layout.log | head -30
