#!/usr/bin/env bash
# Thirteenth session, call 3: the LM head as the layers call's last kernel (a programmatic dependent of the last
# down projection; the greedy head's output zeroed by the call's first kernel, no memset node) against the head
# in its own FFI call (JAXLLM_LAYERS_HEAD=0): the layers call's bit-identity test (now with both heads), greedy
# and sampled steps alternating, the graphs tests. Cut to fit the session's last device minutes.
DEADLINE=${DEADLINE:-330}
source bench/device_call.sh
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_fused.py \
  -k "layers_call" > $R/gpu_tests_fused.log 2>&1
stamp "fused tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_fused.log | tail -8
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi --loop pipelined"
S="--temperature 0.7 --top-p 0.9 --seed 1"
row() { local label=$1 extra=$2; shift 2; room 22 "$label" && { env "$@" timeout 40 $B $extra --label "$label" >> $R/bench.log 2>&1; stamp "$label rc=$?"; }; }
row "greedy, head in call, round 1" "" JAXLLM_LAYERS_HEAD=1
row "greedy, head apart, round 1" "" JAXLLM_LAYERS_HEAD=0
row "sampled, head in call, round 1" "$S" JAXLLM_LAYERS_HEAD=1
row "sampled, head apart, round 1" "$S" JAXLLM_LAYERS_HEAD=0
room 85 "graphs tests" && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 85 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_graphs.py \
  -k "(parity_qwen and ffi) or replay" > $R/gpu_tests_graphs.log 2>&1
stamp "graphs tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_graphs.log | tail -5; }
row "greedy, head in call, round 2" "" JAXLLM_LAYERS_HEAD=1
row "greedy, head apart, round 2" "" JAXLLM_LAYERS_HEAD=0
python3 - $R/bench.jsonl <<'P'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l); b = r['step_ms_burst']
  print(f"{r['label']:36s} TPOT {r['tpot_ms_mean']:.3f} burst {b if b is None else round(b, 3)} floor {r['byte_floor_ms']:.3f} "
        f"peak {r['peak_memory_bytes']/1e9:.2f} GB rss {r['peak_rss_bytes']/1e9:.2f} GB {r['env']['device']}")
P
stamp end
