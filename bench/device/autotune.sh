#!/usr/bin/env bash
# On a lent GPU (a device call from the repository root, carrying .whl/ and .carry/commit): the open measurements
# of docs/results/2026-12-06-h100-autotune.md, most telling first, each started only while it fits before DEADLINE
# (default 570 s):
#   1. tests/test_tuning.py on the GPU: the tuning's child process (python -m jaxllm.tuning) on a GPU;
#   2. the autotune through the engine, JAXLLM_AUTOTUNE=1 / 0 in paired processes (1 first, on an empty tuning
#      cache, so the first process of each model is the one whose child times): 7B and 0.5B at batch 16;
#   3. the LM heads' 9-16-row rule against the rule before it (lab switch JAXLLM_MMA_HEAD=0), autotune off;
#   4. the autotune at batch 64 (7B).
# Builds the lab extension (LAB=1). Writes $OUT/tests.log and $OUT/ab.jsonl; logs and stamps in $OUT/g.tgz.
set -u
export LAB=1 DEADLINE=${DEADLINE:-570}
source bench/device_call.sh
export JAXLLM_TEST_OFFLINE=1
XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_tuning.py -rfEs \
  > $OUT/tests.log 2>&1
stamp "tests/test_tuning.py rc $?"
export JAXLLM_CACHE=/tmp/autotune-cache     # empty: the first autotune process of a model times, in its child
B="python3 -m jaxllm.bench --loop pipelined --repeat 3 --prompt-len 128 --decode-len 128 --kernels auto --out $OUT/ab.jsonl"
pair() {  # preset batch label-prefix variable [NAME=VALUE]: VARIABLE=1, 0, 1, 0, each its own process
  for v in 1 0 1 0; do
    room 60 "$1 b$2 $3$v" || return 0
    env "$4=$v" ${5:-} timeout 120 $B synthetic:$1 --batch $2 --label "$3$v" >> $R/ab.log 2>&1
    stamp "$1 b$2 $3$v rc $?"
  done
}
pair qwen2.5-7b 16 tune JAXLLM_AUTOTUNE
pair qwen2.5-0.5b 16 tune JAXLLM_AUTOTUNE
pair qwen2.5-7b 16 head JAXLLM_MMA_HEAD JAXLLM_AUTOTUNE=0
pair qwen2.5-0.5b 16 head JAXLLM_MMA_HEAD JAXLLM_AUTOTUNE=0
pair qwen2.5-7b 64 tune JAXLLM_AUTOTUNE
cp -r $JAXLLM_CACHE/tuning $R/ 2>/dev/null
python3 - $OUT/ab.jsonl <<'EOF' | tee $R/ab_summary.txt
import json, sys
for line in open(sys.argv[1]):
  r = json.loads(line)
  print(f"{r['model']:28s} b{r['batch']:<3d} {r['label']}: TPOT {r['tpot_ms_mean']:.3f} ms, compile {r['compile_s']:.1f} s")
EOF
