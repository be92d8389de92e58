#!/usr/bin/env bash
# Lab build, the 7B shape, 128-256 keys: (1) the attention's fold (JAXLLM_ATTN_FOLD, on by default since fb554ae) on
# and off at batch 1, a second pair; (2) where the attention's 10.5 us a layer go: JAXLLM_ATTN_STOP=wait|prologue|tiles
# (wrong results, timing only); (3) the fold on and off at batch 8.
set -u
export DEADLINE=${DEADLINE:-280} LAB=1
source bench/device_call.sh
run() {  # model batch prompt fold stop round
  room 32 "$*" || return 1
  JAXLLM_ATTN_FOLD=$4 JAXLLM_ATTN_STOP=$5 timeout $(( $(left) )) python3 -m jaxllm.bench synthetic:$1 --loop pipelined \
    --batch $2 --kernels ffi --label "$1 b$2 p$3 fold$4 stop${5:-none} r$6" --prompt-len $3 --decode-len 128 --repeat 2 \
    --out $R/fold.jsonl >> $R/fold.log 2>&1; stamp "$1 b$2 p$3 fold$4 stop${5:-none} r$6 rc $?"
}
run qwen2.5-7b 1 128 1 "" 3; run qwen2.5-7b 1 128 0 "" 3
run qwen2.5-7b 1 128 1 wait 1; run qwen2.5-7b 1 128 1 prologue 1; run qwen2.5-7b 1 128 1 tiles 1
run qwen2.5-7b 8 128 0 "" 1; run qwen2.5-7b 8 128 1 "" 1
python3 - $R/fold.jsonl <<'PY'
import json, sys
for line in open(sys.argv[1]):
  r = json.loads(line)
  print(r.get("label"), "tpot_ms_mean %.4f" % r.get("tpot_ms_mean"), "burst %.4f" % r.get("step_ms_burst"))
PY
cp $R/fold.jsonl $OUT/
