#!/usr/bin/env bash
# Twelfth session, call 3: the greedy LM head on resident blocks (w8a16::ArgmaxHeadKernel) against the grid
# of a block per 32 rows (JAXLLM_HEAD_GRID=1), and the int16 staging's NaN probe: the fused tests (with the
# vocabulary-size head test), the step timed alternately, a trace by role, the graphs tests.
DEADLINE=${DEADLINE:-560}
source bench/device_call.sh
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_fused.py \
  -k "argmax or norm_linear or linear_residual or layers_call or merged or match_unfused or step_runs" > $R/gpu_tests_fused.log 2>&1
stamp "fused tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_fused.log | tail -8
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi --loop pipelined"
row() { local label=$1; shift; room 22 "$label" && { env "$@" timeout 40 $B --label "$label" >> $R/bench.log 2>&1; stamp "$label rc=$?"; }; }
for round in 1 2; do
  row "head resident, round $round" JAXLLM_HEAD_GRID=0
  row "head grid, round $round" JAXLLM_HEAD_GRID=1
done
P="timeout 50 python3 bench/step_profile.py --tokens 64"
room 20 "profile" && { $P --out $R/profile_resident.json > $R/profile_resident.log 2>&1; stamp "profile rc=$?"; sed -n '/^role/,/^0 /p' $R/profile_resident.log; grep "^span" $R/profile_resident.log; }
room 20 "profile grid" && { JAXLLM_HEAD_GRID=1 $P --out $R/profile_grid.json > $R/profile_grid.log 2>&1; stamp "profile grid rc=$?"; sed -n '/^role/,/^0 /p' $R/profile_grid.log; grep "^span" $R/profile_grid.log; }
room 130 "graphs tests" && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 130 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_graphs.py \
  -k "parity_qwen or replay or graph_state_gpu" > $R/gpu_tests_graphs.log 2>&1
stamp "graphs tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_graphs.log | tail -5; }
row "head resident, round 3" JAXLLM_HEAD_GRID=0
row "head grid, round 3" JAXLLM_HEAD_GRID=1
python3 - $R/bench.jsonl <<'P'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l); print(f"{r['label']:28s} TPOT {r['tpot_ms_mean']:.3f} burst {r['step_ms_burst']:.3f} floor {r['byte_floor_ms']:.3f} "
                         f"peak {r['peak_memory_bytes']/1e9:.2f} GB rss {r['peak_rss_bytes']/1e9:.2f} GB {r['env']['device']}")
P
stamp end
