#!/usr/bin/env bash
# Sixth session, call 1 of the sampling work: the candidates kernel with the row's logsumexp and warps
# without live keys skipping the radix rounds; the sampled step without penalties when no row has one.
# GPU tests of the sampler first, then the kernel by stage, the sampling parts, and the engine's steps
# (greedy, sampled, sampled on the jnp candidates, sampled with a penalty), one process a row, alternating.
source bench/device_call.sh   # environment, build, stamp/room helpers, logs packed at exit
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_sampling.py \
  > $R/gpu_tests_sampling.log 2>&1
stamp "sampling tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_sampling.log | head
I=$(python3 -c "import jax.ffi; print(jax.ffi.include_dir())")
nvcc -O3 -std=c++17 -arch=sm_90 -I ffi -I $I bench/candidates_sweep.cu -o /tmp/candidates_sweep > $R/candidates_build.log 2>&1 \
  && timeout 40 /tmp/candidates_sweep > $R/candidates_sweep.jsonl 2>&1; stamp "candidates_sweep rc=$?"; cat $R/candidates_sweep.jsonl
room 60 sample && { timeout 70 python3 bench/sample_cost.py --out $R/sample_cost.json > $R/sample_cost.log 2>&1; stamp "sample_cost $?"; tail -9 $R/sample_cost.log; }
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi --loop pipelined"
S="--temperature 0.7 --top-p 0.9"
for round in 1 2; do
  room 40 greedy$round && { timeout 45 $B --label "greedy, round $round" >> $R/bench.log 2>&1; stamp "greedy rc=$?"; }
  room 40 sampled$round && { timeout 45 $B $S --label "sampled t0.7 p0.9, round $round" >> $R/bench.log 2>&1; stamp "sampled rc=$?"; }
  room 40 jnp$round && { JAXLLM_CANDIDATES_KERNEL=0 timeout 45 $B $S --label "sampled, jnp candidates, round $round" >> $R/bench.log 2>&1; stamp "jnp rc=$?"; }
  room 40 pen$round && { timeout 45 $B $S --repeat-penalty 1.1 --label "sampled + repeat penalty 1.1, round $round" >> $R/bench.log 2>&1; stamp "pen rc=$?"; }
done
grep "\[bench\]" $R/bench.log | cut -c1-200
stamp end
