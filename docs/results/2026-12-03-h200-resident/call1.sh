#!/usr/bin/env bash
# Thirteenth session, call 1: the fused step's M = 1 matmuls with their weights copied into shared memory
# before the wait (w8a16::ResidentKernel) against the register kernels (JAXLLM_RESIDENT=0), with every kernel
# preferring the largest shared-memory carveout (JAXLLM_CARVEOUT=100) and at two blocks a SM; the kernel
# tests first (the per-op ops at M = 1 against float64, the layers call at batch 1 and 3 against per-op calls).
DEADLINE=${DEADLINE:-560}
source bench/device_call.sh
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_fused.py \
  -k "norm_linear or linear_residual or layers_call" > $R/gpu_tests_fused.log 2>&1
stamp "fused tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_fused.log | tail -8
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi --loop pipelined"
row() { local label=$1; shift; room 22 "$label" && { env "$@" timeout 40 $B --label "$label" >> $R/bench.log 2>&1; stamp "$label rc=$?"; }; }
for round in 1 2; do
  row "resident, round $round" JAXLLM_RESIDENT=1
  row "register, round $round" JAXLLM_RESIDENT=0
  row "resident carveout100, round $round" JAXLLM_RESIDENT=1 JAXLLM_CARVEOUT=100
  row "resident bps2, round $round" JAXLLM_RESIDENT=1 JAXLLM_RESIDENT_BPS=2
done
P="timeout 50 python3 bench/step_profile.py --tokens 64"
room 20 "profile" && { $P --out $R/profile_resident.json > $R/profile_resident.log 2>&1; stamp "profile rc=$?"; sed -n '/^role/,/^0 /p' $R/profile_resident.log; grep "^span" $R/profile_resident.log; }
room 130 "graphs tests" && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 130 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_graphs.py \
  -k "parity_qwen or replay or graph_state_gpu" > $R/gpu_tests_graphs.log 2>&1
stamp "graphs tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_graphs.log | tail -5; }
python3 - $R/bench.jsonl <<'P'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l); b = r['step_ms_burst']
  print(f"{r['label']:36s} TPOT {r['tpot_ms_mean']:.3f} burst {b if b is None else round(b, 3)} floor {r['byte_floor_ms']:.3f} "
        f"peak {r['peak_memory_bytes']/1e9:.2f} GB rss {r['peak_rss_bytes']/1e9:.2f} GB {r['env']['device']}")
P
stamp end
