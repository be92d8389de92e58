#!/usr/bin/env bash
# The whole suite (release build), then jaxllm's batch-1 step at 0.5B, 1B, 7B (auto) in what time is left.
set -u
T0=$(date +%s)
JAXLLM_TEST_OFFLINE=1 TESTS=all WORKERS=16 T_TESTS=400 OUT=$OUT bash bench/gpu_check.sh > $OUT/check.log 2>&1
echo "gpu_check rc $? at $(( $(date +%s) - T0 )) s" | tee -a $OUT/stamps.txt
tail -5 $OUT/check.log
export PYTHONPATH=/tmp/site JAXLLM_GIT_COMMIT=$(cat .carry/commit) PYTHONUNBUFFERED=1
for m in qwen2.5-7b llama-3.2-1b qwen2.5-0.5b; do
  [ $(( $(date +%s) - T0 )) -lt 520 ] || { echo "skip $m" >> $OUT/stamps.txt; continue; }
  timeout $(( 575 - $(date +%s) + T0 )) python3 -m jaxllm.bench synthetic:$m --loop pipelined --batch 1 --kernels auto \
    --label "$m b1 auto" --decode-len 128 --repeat 2 --out $OUT/b1.jsonl >> $OUT/b1.log 2>&1
  echo "$m rc $? at $(( $(date +%s) - T0 )) s" | tee -a $OUT/stamps.txt
done
python3 -c "
import json
for l in open('$OUT/b1.jsonl'):
  r = json.loads(l); print({k: v for k, v in r.items() if any(w in k for w in ('label', 'device', 'gpu', 'tpot', 'floor', 'burst'))})
" 2>&1 | tail -5
