#!/usr/bin/env bash
# Sixth session, call 3 (final): the candidates kernel reading the kept blocks with 16-byte loads and the
# blocks' sums with their keys; the sampler's GPU tests, the kernel by stage, then greedy and sampled steps
# alternating (four pairs), and the jnp candidates once for comparison.
DEADLINE=${DEADLINE:-420}
source bench/device_call.sh   # environment, build, stamp/room helpers, logs packed at exit
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 110 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_sampling.py \
  > $R/gpu_tests_sampling.log 2>&1
stamp "sampling tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_sampling.log | head
I=$(python3 -c "import jax.ffi; print(jax.ffi.include_dir())")
nvcc -O3 -std=c++17 -arch=sm_90 -I ffi -I $I bench/candidates_sweep.cu -o /tmp/candidates_sweep > $R/candidates_build.log 2>&1 \
  && timeout 40 /tmp/candidates_sweep > $R/candidates_sweep.jsonl 2>&1; stamp "candidates_sweep rc=$?"; cat $R/candidates_sweep.jsonl
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi --loop pipelined"
S="--temperature 0.7 --top-p 0.9"
for round in 1 2 3 4; do
  room 30 greedy$round && { timeout 35 $B --label "greedy, round $round" >> $R/bench.log 2>&1; stamp "greedy rc=$?"; }
  room 30 sampled$round && { timeout 35 $B $S --label "sampled t0.7 p0.9, round $round" >> $R/bench.log 2>&1; stamp "sampled rc=$?"; }
done
room 30 jnp && { JAXLLM_CANDIDATES_KERNEL=0 timeout 35 $B $S --label "sampled, jnp candidates" >> $R/bench.log 2>&1; stamp "jnp rc=$?"; }
grep "\[bench\]" $R/bench.log | cut -c1-200
stamp end
