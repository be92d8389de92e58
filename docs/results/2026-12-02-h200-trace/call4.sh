#!/usr/bin/env bash
# Tenth session, call 4 (the final code): the fused and graphs GPU tests; the step timed alternately against
# JAXLLM_PREFETCH=0 (the loads on the path after each wait, as on main before this session); a trace by role;
# XLA's thunks of the decode executable; a third round and the trace of JAXLLM_PREFETCH=0 if time is left.
DEADLINE=${DEADLINE:-470}
source bench/device_call.sh   # environment, build, stamp/room helpers, logs packed at exit
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_fused.py \
  -k "norm_linear or linear_residual or layers_call or merged or match_unfused or step_runs" > $R/gpu_tests_fused.log 2>&1
stamp "fused tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_fused.log | tail -5
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_graphs.py \
  -k "parity_qwen or replay or graph_state_gpu" > $R/gpu_tests_graphs.log 2>&1
stamp "graphs tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_graphs.log | tail -5
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi --loop pipelined"
ab() {
  room 22 "default $1" && { timeout 40 $B --label "default, round $1" >> $R/bench.log 2>&1; stamp "default rc=$?"; }
  room 22 "prefetch0 $1" && { JAXLLM_PREFETCH=0 timeout 40 $B --label "JAXLLM_PREFETCH=0, round $1" >> $R/bench.log 2>&1; stamp "prefetch0 rc=$?"; }
}
ab 1; ab 2
P="timeout 50 python3 bench/step_profile.py --tokens 64"
room 20 "profile" && { $P --out $R/profile_default.json > $R/profile_default.log 2>&1; stamp "profile default rc=$?"; sed -n '/^role/,/^0 /p' $R/profile_default.log; grep "^span" $R/profile_default.log; }
room 30 "graph state" && { timeout 60 python3 - $R/dump <<'P' > $R/graph_state.log 2>&1
import sys
from jaxllm.bench import load_model
from jaxllm.engine import Engine
config, weights, _, _ = load_model("synthetic:qwen2.5-0.5b", "w8a16", 0)
engine = Engine(config, weights, None, max_context=300, kernels="ffi")
print(engine.graph_state(True, dump_dir=sys.argv[1]))
P
stamp "graph state rc=$?"; tail -1 $R/graph_state.log
mkdir -p $R/hlo; cp $(ls -S $R/dump/*thunk_sequence_after_thunk_passes* | head -1) $R/hlo/ 2>/dev/null; rm -rf $R/dump; }
ab 3
room 20 "profile prefetch0" && { JAXLLM_PREFETCH=0 $P --out $R/profile_prefetch0.json > $R/profile_prefetch0.log 2>&1; stamp "profile prefetch0 rc=$?"; sed -n '/^role/,/^0 /p' $R/profile_prefetch0.log; grep "^span" $R/profile_prefetch0.log; }
python3 - $R/bench.jsonl <<'P'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l); print(f"{r['label']:28s} TPOT {r['tpot_ms_mean']:.3f} burst {r['step_ms_burst']:.3f} floor {r['byte_floor_ms']:.3f} "
                         f"peak {r['peak_memory_bytes']/1e9:.2f} GB rss {r['peak_rss_bytes']/1e9:.2f} GB {r['env']['device']}")
P
stamp end
