#!/usr/bin/env bash
# On a lent GPU (a device call from the repository root, carrying .whl/ and .carry/commit): the autotune against the
# kernel's rule through the engine. tests/test_tuning.py first (one test times a shape in the child process), then
# `python -m jaxllm.bench` with JAXLLM_AUTOTUNE=1, 0, 1, 0, each its own process, 1 first on an empty tuning cache
# (so the first process of each model is the one whose child times its shapes): 7B and 0.5B at batch 16, then at
# 64, each process started only while it fits before DEADLINE (default 570 s). Writes $OUT/tests.log; the
# records (r/ab.jsonl), the tuning file and the logs in $OUT/g.tgz. docs/results/2026-12-06-h100-autotune-default.md
# ran its first half.
set -u
export DEADLINE=${DEADLINE:-570}
source bench/device_call.sh
export JAXLLM_TEST_OFFLINE=1
XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_tuning.py -rfEs \
  > $OUT/tests.log 2>&1
stamp "tests/test_tuning.py rc $?"
export JAXLLM_CACHE=/tmp/autotune-cache     # empty: the first autotune process of a model times, in its child
B="python3 -m jaxllm.bench --loop pipelined --repeat 3 --prompt-len 128 --decode-len 128 --kernels auto --out $R/ab.jsonl"
pair() {  # preset batch: JAXLLM_AUTOTUNE=1, 0, 1, 0, each its own process
  for v in 1 0 1 0; do
    room 40 "$1 b$2 tune$v" || return 0
    JAXLLM_AUTOTUNE=$v timeout 100 $B synthetic:$1 --batch $2 --label "tune$v" >> $R/ab.log 2>&1
    stamp "$1 b$2 tune$v rc $?"
  done
}
pair qwen2.5-7b 16
pair qwen2.5-0.5b 16
pair qwen2.5-7b 64
pair qwen2.5-0.5b 64
cp -r $JAXLLM_CACHE/tuning $R/ 2>/dev/null
python3 - $R/ab.jsonl <<'PY' | tee $R/ab_summary.txt
import json, sys
for line in open(sys.argv[1]):
  r = json.loads(line)
  print(f"{r['model']:28s} b{r['batch']:<3d} {r['label']}: TPOT {r['tpot_ms_mean']:.3f} ms, choices {r['mma_choices']}, "
        f"compile {r['compile_s']:.1f} s")
PY
