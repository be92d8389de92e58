#!/usr/bin/env bash
# Lab build (reused when warm): the 7B step at batch 1 with the attention's splits capped, at longer contexts.
set -u
[ -d .whl ] || { mkdir -p .whl && cp .carry/whl_c/*.whl .whl/; }
export DEADLINE=${DEADLINE:-400} LAB=1
source bench/device_call.sh
run() {  # model prompt cap round
  room 40 "$*" || return 1
  JAXLLM_ATTN_MAX_SPLITS=$3 timeout $(( $(left) )) python3 -m jaxllm.bench synthetic:$1 --loop pipelined --batch 1 \
    --kernels ffi --label "$1 p$2 cap$3 r$4" --prompt-len $2 --decode-len 128 --repeat 2 \
    --out $R/ctx.jsonl >> $R/ctx.log 2>&1; stamp "$1 p$2 cap$3 r$4 rc $?"
}
for p in 2048 512; do run qwen2.5-7b $p 256 1; run qwen2.5-7b $p 8 1; run qwen2.5-7b $p 16 1; run qwen2.5-7b $p 256 2; done
run qwen2.5-0.5b 512 256 1; run qwen2.5-0.5b 512 8 1; run qwen2.5-0.5b 512 256 2; run qwen2.5-0.5b 512 8 2
python3 - $R/ctx.jsonl <<'PY'
import json, sys
for line in open(sys.argv[1]):
  r = json.loads(line)
  print(r.get("label"), "tpot_ms_mean %.4f" % r.get("tpot_ms_mean"), "burst %.4f" % r.get("step_ms_burst"))
PY
cp $R/ctx.jsonl $OUT/
