#!/usr/bin/env bash
# Eleventh session, call 1: the QKV fold (the norm and QKV projection inside the attention kernel at batch 1).
# The fused GPU tests (with the new fold test), the step timed alternately against JAXLLM_QKV_FOLD=0, a trace
# by role, then the graphs tests if time is left.
DEADLINE=${DEADLINE:-540}
source bench/device_call.sh   # environment, build, stamp/room helpers, logs packed at exit
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 170 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_fused.py \
  -k "norm_linear or linear_residual or layers_call or merged or match_unfused or step_runs" > $R/gpu_tests_fused.log 2>&1
stamp "fused tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_fused.log | tail -8
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi --loop pipelined"
ab() {
  room 22 "default $1" && { timeout 40 $B --label "default, round $1" >> $R/bench.log 2>&1; stamp "default rc=$?"; }
  room 22 "fold0 $1" && { JAXLLM_QKV_FOLD=0 timeout 40 $B --label "JAXLLM_QKV_FOLD=0, round $1" >> $R/bench.log 2>&1; stamp "fold0 rc=$?"; }
}
ab 1; ab 2
P="timeout 50 python3 bench/step_profile.py --tokens 64"
room 20 "profile" && { $P --out $R/profile_default.json > $R/profile_default.log 2>&1; stamp "profile default rc=$?"; sed -n '/^role/,/^0 /p' $R/profile_default.log; grep "^span" $R/profile_default.log; }
room 130 "graphs tests" && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 130 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_graphs.py \
  -k "parity_qwen or replay or graph_state_gpu" > $R/gpu_tests_graphs.log 2>&1
stamp "graphs tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_graphs.log | tail -5; }
ab 3
python3 - $R/bench.jsonl <<'P'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l); print(f"{r['label']:28s} TPOT {r['tpot_ms_mean']:.3f} burst {r['step_ms_burst']:.3f} floor {r['byte_floor_ms']:.3f} "
                         f"peak {r['peak_memory_bytes']/1e9:.2f} GB rss {r['peak_rss_bytes']/1e9:.2f} GB {r['env']['device']}")
P
stamp end
