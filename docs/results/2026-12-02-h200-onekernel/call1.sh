#!/usr/bin/env bash
# Ninth session, call 1: the layers call as one persistent kernel (JAXLLM_LAYERS_LAUNCH=one-kernel,
# ffi/layers_cuda.cuh) against the five-kernel chain with PDL (the default). GPU tests of both first (the
# chain now takes down at 4 rows a block), then the step, alternating, one process a row.
DEADLINE=${DEADLINE:-550}
source bench/device_call.sh   # environment, build, stamp/room helpers, logs packed at exit
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m pytest -q -rfE -x -p no:cacheprovider tests/test_fused.py \
  -k "one_kernel or layers_call_equals" > $R/gpu_tests_layers.log 2>&1
stamp "layers tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed|Error|assert" $R/gpu_tests_layers.log | head -20
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi --loop pipelined"
for round in 1 2 3; do
  room 30 chain$round && { timeout 45 $B --label "chain (pdl), round $round" >> $R/bench.log 2>&1; stamp "chain rc=$?"; }
  room 30 one$round && { JAXLLM_LAYERS_LAUNCH=one-kernel timeout 45 $B --label "one kernel, round $round" >> $R/bench.log 2>&1; stamp "one rc=$?"; }
done
python3 - $R/bench.jsonl <<'P'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l); print(f"{r['label']:32s} TPOT {r['tpot_ms_mean']:.3f} burst {r['step_ms_burst']:.3f}")
P
stamp end
