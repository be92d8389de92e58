#!/usr/bin/env bash
# Seventh session, call 1: the one-kernel MLP in the layers call (ffi/mlp_cuda.cuh). Its GPU tests and the
# layers tests, then the default step (the one-kernel MLP) against JAXLLM_MLP_FUSED=0 (gate/up and down as
# two kernels), alternating, one process a row.
DEADLINE=${DEADLINE:-540}
source bench/device_call.sh   # environment, build, stamp/room helpers, logs packed at exit
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest -q -rfE -s -p no:cacheprovider tests/test_fused.py \
  -k "mlp_kernel or layers_call_equals or match_unfused" > $R/gpu_tests_fused.log 2>&1
stamp "fused tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed|worst" $R/gpu_tests_fused.log | head -20
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi --loop pipelined"
for round in 1 2 3; do
  room 30 mlp$round && { timeout 40 $B --label "one-kernel MLP, round $round" >> $R/bench.log 2>&1; stamp "mlp rc=$?"; }
  room 30 two$round && { JAXLLM_MLP_FUSED=0 timeout 40 $B --label "gate/up and down as two kernels, round $round" >> $R/bench.log 2>&1; stamp "two rc=$?"; }
done
grep "\[bench\]" $R/bench.log | cut -c1-220
stamp end
