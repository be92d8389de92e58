#!/usr/bin/env bash
# Eighth session, call 1: the W8A16 block shapes of the fused step's GEMVs at M = 1, two rounds alternating.
# Long K (down, K 4864: 896 blocks of 256 threads, one row each, by default) through JAXLLM_W8A16_LONG_K
# 1: 2 rows a 256-thread team (448 blocks), 2: 128-thread teams of 2 rows (224), 3: 4 rows a 256-thread team
# (224), 4: 128-thread teams of 1 row (448). Short K, few rows (QKV, O: 64-thread teams of 1 row, 288 / 224
# blocks) through JAXLLM_W8A16_SHORT_K 1: warps of 2 rows (72 / 56 blocks), 2: warps of 1 row (144 / 112).
DEADLINE=${DEADLINE:-540}
source bench/device_call.sh   # environment, build, stamp/room helpers, logs packed at exit
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi --loop pipelined"
for round in 1 2; do
  for cfg in "0 0" "1 0" "2 0" "3 0" "4 0" "0 1" "0 2"; do
    set -- $cfg
    room 25 "long $1 short $2 round $round" && { JAXLLM_W8A16_LONG_K=$1 JAXLLM_W8A16_SHORT_K=$2 timeout 40 $B \
      --label "long_k $1, short_k $2, round $round" >> $R/bench.log 2>&1; stamp "long $1 short $2 rc=$?"; }
  done
done
python3 - $R/bench.jsonl <<'P'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l); print(f"{r['label']:32s} TPOT {r['tpot_ms_mean']:.3f} burst {r['step_ms_burst']:.3f}")
P
stamp end
