#!/usr/bin/env bash
# Session 2026-12-06 pm, call 3 (the session's last device seconds): the final tree's 7B batch 64 with the autotune
# on (an empty tuning cache: its child times, the XT configurations with their __launch_bounds__ minimums among
# the candidates) and off, alternating while time is left.
set -u
export DEADLINE=${DEADLINE:-130}
source bench/device_call.sh
export JAXLLM_CACHE=/tmp/autotune-cache
for v in 1 0 1 0; do
  room 25 "7b b64 tune$v" || break
  JAXLLM_AUTOTUNE=$v timeout 40 python3 -m jaxllm.bench synthetic:qwen2.5-7b --batch 64 --loop pipelined --repeat 2 \
    --prompt-len 128 --decode-len 128 --kernels auto --label "tune$v" --out $R/ab.jsonl >> $R/ab.log 2>&1
  stamp "7b b64 tune$v rc $?"
done
cp -r $JAXLLM_CACHE/tuning $R/ 2>/dev/null
python3 - $R/ab.jsonl <<'PY' 2>/dev/null
import json, sys
for line in open(sys.argv[1]):
  r = json.loads(line)
  print(f"b{r['batch']} {r['label']}: TPOT {r['tpot_ms_mean']:.3f} ms, choices {r.get('mma_choices')}, compile {r['compile_s']:.1f} s")
PY
