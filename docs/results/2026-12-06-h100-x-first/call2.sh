#!/usr/bin/env bash
# Issue 36: O and down (N >= 1536, K >= 2048, not gate/up or q/k/v) issuing their first weight loads before the wait
# and staging x after it (JAXLLM_X_FIRST=0), against x staged first (=1, main), interleaved; 7B and 1B at batch 1.
export LAB=1
export DEADLINE=${DEADLINE:-260}
source bench/device_call.sh
B="python3 -m jaxllm.bench --loop pipelined --repeat 3 --prompt-len 128 --decode-len 128 --out $OUT/bench.jsonl"
for r in 1 2; do
  for v in 1 0; do
    room 20 "7b x_first=$v r$r" && { JAXLLM_X_FIRST=$v timeout 60 $B synthetic:qwen2.5-7b --label "7b x_first=$v r$r" >> $R/bench.log 2>&1; stamp "7b x_first=$v r$r rc $?"; }
  done
done
for r in 1 2; do
  for v in 1 0; do
    room 15 "1b x_first=$v r$r" && { JAXLLM_X_FIRST=$v timeout 40 $B synthetic:llama-3.2-1b --label "1b x_first=$v r$r" >> $R/bench.log 2>&1; stamp "1b x_first=$v r$r rc $?"; }
  done
done
room 25 "7b b16 peak" && { timeout 60 $B synthetic:qwen2.5-7b --batch 16 --label "7b b16 peak (x_first default)" >> $R/bench.log 2>&1; stamp "7b b16 rc $?"; }
room 20 "profile" && { JAXLLM_X_FIRST=0 timeout 40 python3 bench/step_profile.py --model synthetic:qwen2.5-7b --batch 1 \
    --out $OUT/profile_xfirst0.json > $R/profile.log 2>&1; stamp "profile x_first=0 rc $?"; }
python3 - $OUT/bench.jsonl <<'PY'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l)
  print(r.get("label"), "TPOT ms", round(r["tpot_ms_mean"], 4), "step p50", round(r["tpot_step_ms_p50"], 4),
        "floor ms", round(r.get("byte_floor_ms") or 0, 4), "peak GB", r.get("peak_memory_bytes", 0) / 1e9, r["env"]["device"])
PY
