#!/usr/bin/env bash
# Twelfth session, call 5: the fused down projection a warp per row (112 blocks, every weight loaded before
# the wait, room beside it for the QKV kernel's blocks) against a block of 256 threads per row
# (JAXLLM_DOWN_WARP=0): the fused tests, the step timed alternately, a trace by role of each, the graphs tests.
DEADLINE=${DEADLINE:-420}
source bench/device_call.sh
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_fused.py \
  -k "linear_residual or layers_call or match_unfused or step_runs" > $R/gpu_tests_fused.log 2>&1
stamp "fused tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_fused.log | tail -8
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi --loop pipelined"
row() { local label=$1; shift; room 22 "$label" && { env "$@" timeout 40 $B --label "$label" >> $R/bench.log 2>&1; stamp "$label rc=$?"; }; }
for round in 1 2; do
  row "down warp, round $round" JAXLLM_DOWN_WARP=1
  row "down block, round $round" JAXLLM_DOWN_WARP=0
done
P="timeout 50 python3 bench/step_profile.py --tokens 64"
room 20 "profile" && { $P --out $R/profile_warp.json > $R/profile_warp.log 2>&1; stamp "profile rc=$?"; sed -n '/^role/,/^0 /p' $R/profile_warp.log; grep "^span" $R/profile_warp.log; }
room 20 "profile block" && { JAXLLM_DOWN_WARP=0 $P --out $R/profile_block.json > $R/profile_block.log 2>&1; stamp "profile block rc=$?"; sed -n '/^role/,/^0 /p' $R/profile_block.log; grep "^span" $R/profile_block.log; }
row "down warp, round 3" JAXLLM_DOWN_WARP=1
row "down block, round 3" JAXLLM_DOWN_WARP=0
room 110 "graphs tests" && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 110 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_graphs.py \
  -k "parity_qwen or replay or graph_state_gpu" > $R/gpu_tests_graphs.log 2>&1
stamp "graphs tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_graphs.log | tail -5; }
python3 - $R/bench.jsonl <<'P'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l); print(f"{r['label']:28s} TPOT {r['tpot_ms_mean']:.3f} burst {r['step_ms_burst']:.3f} floor {r['byte_floor_ms']:.3f} "
                         f"peak {r['peak_memory_bytes']/1e9:.2f} GB rss {r['peak_rss_bytes']/1e9:.2f} GB {r['env']['device']}")
P
stamp end
