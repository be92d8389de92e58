#!/usr/bin/env bash
# Sixteenth session, call 1: the greedy step as one FFI call (the layers call's step mode: the embedding, the
# layers, the argmax head and the state update; JAXLLM_STEP_CALL=0: XLA's kernels around the call, as before),
# the head's last block finishing the step or a kernel after it (JAXLLM_STEP_TICKET=0), and the streaming loop
# with each call's tokens copied to the host as they are ready (JAXLLM_READ_AHEAD=0: when read). One build:
# the GPU tests of the step call and the layers call, bench rows in two rounds, the host loops, a trace.
source bench/device_call.sh
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi"
row() { local label=$1; shift; room 24 "$label" && { env "$@" timeout 40 $B --loop pipelined --label "$label" >> $R/bench.log 2>&1; stamp "$label rc=$?"; }; }
python3 -c "import xdist" 2>/dev/null && PAR="-n 4" || PAR=""
room 150 tests && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest -q -rfE $PAR -p no:cacheprovider tests/test_fused.py \
  -k "step_call or layers_call" > $R/gpu_tests.log 2>&1; stamp "tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests.log | tail -12; }
for i in 1 2; do
  row "step call, round $i" X=1
  row "XLA around the call, round $i" JAXLLM_STEP_CALL=0
  row "step call, kernel after the head, round $i" JAXLLM_STEP_TICKET=0
done
for ra in 1 0; do room 45 "loops $ra" && { JAXLLM_READ_AHEAD=$ra timeout 50 $B --loop both --host-timings --graph-state \
  --label "step call, read ahead $ra" >> $R/bench.log 2>&1; stamp "loops read-ahead $ra rc=$?"; }; done
room 30 profile && { timeout 35 python3 bench/step_profile.py --tokens 64 --out $R/profile.json > $R/profile.txt 2>&1; stamp "profile rc=$?"; sed -n "/^role/,\$p" $R/profile.txt | head -30; }
python3 - $R/bench.jsonl <<'P'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l); b = r['step_ms_burst']; g = r.get('graph_state', {})
  print(f"{r['label'][:44]:44s} {r['loop'][:4]} TPOT {r['tpot_ms_mean']:.3f} burst {b if b is None else round(b, 3)} floor {r['byte_floor_ms']:.3f} "
        f"peak {r['peak_memory_bytes']/1e9:.2f} GB rss {r['peak_rss_bytes']/1e9:.2f} GB thunks {g.get('work_thunks')} {g.get('state')}")
P
stamp end
