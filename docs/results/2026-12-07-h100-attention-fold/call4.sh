#!/usr/bin/env bash
# Lab build: the attention's fold (one cluster walks 9-16 visible tiles, two a block; uncommitted) on and off
# (JAXLLM_ATTN_FOLD): the kernel tests (defaults = release), then the step interleaved A B B A at the 7B shape
# (batch 1 and 8, 128-256 keys) and 0.5B (batch 1, 320-448 keys).
set -u
[ -d .whl ] || { mkdir -p .whl && cp .carry/whl_c/*.whl .whl/; }
export DEADLINE=${DEADLINE:-470} LAB=1
source bench/device_call.sh
echo "tree: the commit above + the fold in ffi/attention_cuda.cuh, tests (uncommitted)" >> $R/env.txt
[ -n "${TESTS:-}" ] && XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_CLIENT_MEM_FRACTION=0.1 JAXLLM_TEST_OFFLINE=1 timeout 120 python3 -m pytest -q \
  -rfEs -n 8 -p no:cacheprovider tests/test_fused.py tests/test_launches.py \
  -k "merged_attention or layers_call or launches" \
  > $R/tests.log 2>&1; stamp "tests rc $?"
tail -6 $R/tests.log
run() {  # model batch prompt fold round
  room 35 "$*" || return 1
  JAXLLM_ATTN_FOLD=$4 timeout $(( $(left) )) python3 -m jaxllm.bench synthetic:$1 --loop pipelined --batch $2 \
    --kernels ffi --label "$1 b$2 p$3 fold$4 r$5" --prompt-len $3 --decode-len 128 --repeat 2 \
    --out $R/fold.jsonl >> $R/fold.log 2>&1; stamp "$1 b$2 p$3 fold$4 r$5 rc $?"
}
run qwen2.5-7b 1 128 1 1; run qwen2.5-7b 1 128 0 1; run qwen2.5-7b 1 128 0 2; run qwen2.5-7b 1 128 1 2
run qwen2.5-0.5b 1 320 1 1; run qwen2.5-0.5b 1 320 0 1
run qwen2.5-7b 8 128 1 1; run qwen2.5-7b 8 128 0 1
python3 - $R/fold.jsonl <<'PY'
import json, sys
for line in open(sys.argv[1]):
  r = json.loads(line)
  print(r.get("label"), "tpot_ms_mean %.4f" % r.get("tpot_ms_mean"), "burst %.4f" % r.get("step_ms_burst"))
PY
cp $R/fold.jsonl $R/tests.log $OUT/
