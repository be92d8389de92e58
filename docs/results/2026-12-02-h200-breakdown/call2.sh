#!/usr/bin/env bash
# Ninth session, call 4: the layers call's attention copying its first cache tile into shared memory before
# its wait (call2-preload.patch on top of this folder's call 1, the default there) against
# JAXLLM_ATTN_PRELOAD=0 (the tile loaded after the wait), alternating, three rounds; the attention, layers and
# graphs tests first.
DEADLINE=${DEADLINE:-550}
source bench/device_call.sh   # environment, build, stamp/room helpers, logs packed at exit
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_fused.py \
  -k "layers_call_equals or merged or match_unfused" > $R/gpu_tests_fused.log 2>&1
stamp "fused tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_fused.log | tail -5
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_graphs.py \
  -k "parity_qwen or replay or graph_state_gpu" > $R/gpu_tests_graphs.log 2>&1
stamp "graphs tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_graphs.log | tail -5
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi --loop pipelined"
for round in 1 2 3; do
  room 25 "pre $round" && { timeout 40 $B --label "tile copied before the wait, round $round" >> $R/bench.log 2>&1; stamp "pre rc=$?"; }
  room 25 "post $round" && { JAXLLM_ATTN_PRELOAD=0 timeout 40 $B --label "tile loaded after the wait, round $round" >> $R/bench.log 2>&1; stamp "post rc=$?"; }
done
python3 - $R/bench.jsonl <<'P'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l); print(f"{r['label']:44s} TPOT {r['tpot_ms_mean']:.3f} burst {r['step_ms_burst']:.3f}")
P
stamp end
