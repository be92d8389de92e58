#!/usr/bin/env bash
# Seventh session, call 2: the one-kernel MLP with 64, 32 and 16 F rows a block (JAXLLM_MLP_FC; 76, 152 and
# 304 blocks of 512, 256 and 128 threads) against gate/up and down as two kernels, alternating, two rounds;
# the MLP test under each block size first.
DEADLINE=${DEADLINE:-540}
source bench/device_call.sh   # environment, build, stamp/room helpers, logs packed at exit
for fc in 32 16; do
  JAXLLM_MLP_FC=$fc XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 80 python3 -m pytest -q -rfE -s -p no:cacheprovider \
    tests/test_fused.py -k "mlp_kernel" > $R/gpu_tests_mlp_fc$fc.log 2>&1
  stamp "mlp test FC $fc rc=$?"; grep -E "^FAILED|^ERROR|passed|failed|worst" $R/gpu_tests_mlp_fc$fc.log | head
done
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi --loop pipelined"
for round in 1 2; do
  room 25 two$round && { JAXLLM_MLP_FUSED=0 timeout 40 $B --label "two kernels, round $round" >> $R/bench.log 2>&1; stamp "two rc=$?"; }
  for fc in 64 32 16; do
    room 25 fc$fc-$round && { JAXLLM_MLP_FC=$fc timeout 40 $B --label "one-kernel MLP, FC $fc, round $round" >> $R/bench.log 2>&1; stamp "FC $fc rc=$?"; }
  done
done
python3 - $R/bench.jsonl <<'P'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l); print(f"{r['label']:40s} TPOT {r['tpot_ms_mean']:.3f} burst {r['step_ms_burst']:.3f}")
P
stamp end
