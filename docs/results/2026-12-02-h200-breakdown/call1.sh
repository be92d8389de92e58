#!/usr/bin/env bash
# Ninth session, call 3: the default step (five kernels a layer, PDL, one call for all layers) with each
# layer stage left out (JAXLLM_LAYERS_SKIP; wrong results, the device time without that stage), two rounds;
# the layers tests first.
DEADLINE=${DEADLINE:-550}
source bench/device_call.sh   # environment, build, stamp/room helpers, logs packed at exit
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_fused.py \
  -k "layers_call_equals or merged" > $R/gpu_tests_layers.log 2>&1
stamp "layers tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_layers.log | tail -5
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi --loop pipelined"
for round in 1 2; do
  for skip in none qkv attention o gate_up down qkv,attention,o,gate_up,down; do
    room 25 "skip $skip $round" && { JAXLLM_LAYERS_SKIP=$skip timeout 40 $B --label "without $skip, round $round" >> $R/bench.log 2>&1; stamp "skip $skip rc=$?"; }
  done
done
python3 - $R/bench.jsonl <<'P'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l); print(f"{r['label']:52s} TPOT {r['tpot_ms_mean']:.3f} burst {r['step_ms_burst']:.3f}")
P
stamp end
