#!/usr/bin/env bash
# Issue 36: the O projection's blocks asking L2 for their weights during the attention (JAXLLM_L2_AHEAD=1)
# against main's step (=0), interleaved, at the 7B and 0.5B shapes, batch 1; then the 7B step's profile with it.
export LAB=1
export DEADLINE=${DEADLINE:-560}
source bench/device_call.sh
export JAXLLM_GIT_COMMIT=$(cat .carry/commit 2>/dev/null || echo unknown)
B="python3 -m jaxllm.bench --loop pipelined --repeat 3 --prompt-len 128 --decode-len 128 --out $OUT/bench.jsonl"
for r in 1 2; do
  for v in 0 1; do
    room 80 "7b l2=$v r$r" && { JAXLLM_L2_AHEAD=$v timeout 120 $B synthetic:qwen2.5-7b --label "7b l2=$v r$r" >> $R/bench.log 2>&1; stamp "7b l2=$v r$r rc $?"; }
  done
done
for r in 1 2; do
  for v in 0 1; do
    room 35 "0.5b l2=$v r$r" && { JAXLLM_L2_AHEAD=$v timeout 60 $B synthetic:qwen2.5-0.5b --label "0.5b l2=$v r$r" >> $R/bench.log 2>&1; stamp "0.5b l2=$v r$r rc $?"; }
  done
done
for v in 1 0; do
  room 70 "profile l2=$v" && { JAXLLM_L2_AHEAD=$v timeout 100 python3 bench/step_profile.py --model synthetic:qwen2.5-7b --batch 1 \
    --out $OUT/profile_l2_$v.json > $R/profile_$v.log 2>&1; stamp "profile l2=$v rc $?"; }
done
python3 - $OUT/bench.jsonl <<'PY'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l)
  print(r.get("label"), "TPOT ms", round(r["tpot_ms_mean"], 4), "step p50", round(r["tpot_step_ms_p50"], 4), "burst step", round(r.get("step_ms_burst") or 0, 4),
        "floor ms", round(r.get("byte_floor_ms") or 0, 4), r["env"]["device"])
PY
