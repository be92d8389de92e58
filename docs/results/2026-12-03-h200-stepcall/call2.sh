#!/usr/bin/env bash
# Sixteenth session, call 2. One build; variants by environment variables:
#   JAXLLM_ATTN_MBAR=1|0   the attention's cluster merge: the partials sent by st.async and counted on block 0's
#                          transaction barrier (1), or written and then a second cluster barrier (0, as before)
#   JAXLLM_EXP_DUS=1       each step's tokens written into the call's block one at a time (before), not stacked once
#   JAXLLM_STEP_CALL=1|0   the greedy step as one FFI call (call 1), or XLA's kernels around the layers call
# Then the merged-attention and layers-call tests with and without the transaction barrier, the host loops
# (--host-timings now times the calls of K tokens too), the streaming loop at 16 tokens a call, and a trace.
source bench/device_call.sh
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi"
row() { local label=$1; shift; room 24 "$label" && { env "$@" timeout 40 $B --loop pipelined --label "$label" >> $R/bench.log 2>&1; stamp "$label rc=$?"; }; }
python3 -c "import xdist" 2>/dev/null && PAR="-n 4" || PAR=""
for mb in 1 0; do room 100 "tests mbar=$mb" && { JAXLLM_ATTN_MBAR=$mb XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 python3 -m pytest -q -rfE $PAR \
  -p no:cacheprovider tests/test_fused.py -k "merged or layers_call or (step_call and qwen2)" > $R/gpu_tests_mbar$mb.log 2>&1; stamp "tests mbar=$mb rc=$?"
  grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_mbar$mb.log | tail -6; }; done
for i in 1 2; do
  row "mbar, round $i" JAXLLM_STEP_CALL=0 JAXLLM_ATTN_MBAR=1
  row "cluster barrier, round $i" JAXLLM_STEP_CALL=0 JAXLLM_ATTN_MBAR=0
  row "cluster barrier + block writes, round $i" JAXLLM_STEP_CALL=0 JAXLLM_ATTN_MBAR=0 JAXLLM_EXP_DUS=1
  row "mbar + step call, round $i" JAXLLM_STEP_CALL=1 JAXLLM_ATTN_MBAR=1
done
room 45 loops && { JAXLLM_STEP_CALL=0 timeout 50 $B --loop both --host-timings --graph-state --label "mbar, loops" >> $R/bench.log 2>&1; stamp "loops rc=$?"; }
room 45 "loops K=16" && { JAXLLM_STEP_CALL=0 timeout 50 $B --loop both --tokens-per-call 16 --label "mbar, loops, K=16" >> $R/bench.log 2>&1; stamp "loops K=16 rc=$?"; }
room 30 profile && { JAXLLM_STEP_CALL=0 timeout 35 python3 bench/step_profile.py --tokens 64 --out $R/profile.json > $R/profile.txt 2>&1; stamp "profile rc=$?"; sed -n "/^role/,\$p" $R/profile.txt | head -14; }
grep "\[bench\] host" $R/bench.log
python3 - $R/bench.jsonl <<'P'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l); b = r['step_ms_burst']; g = r.get('graph_state', {})
  print(f"{r['label'][:40]:40s} {r['loop'][:4]} K{r.get('tokens_per_call')} TPOT {r['tpot_ms_mean']:.3f} burst {b if b is None else round(b, 3)} "
        f"floor {r['byte_floor_ms']:.3f} peak {r['peak_memory_bytes']/1e9:.2f} GB rss {r['peak_rss_bytes']/1e9:.2f} GB {g.get('work_thunks')} {g.get('state')}")
P
stamp end
