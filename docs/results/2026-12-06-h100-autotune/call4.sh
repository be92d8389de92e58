#!/usr/bin/env bash
# Call 4: the whole suite on the GPU, then a probe of the autotune A/B's first-process effect (0.5B, batch 16):
# tune=1 on an empty tuning cache (times), tune=1 (reads), tune=0, tune=1 (reads).
set -u
T0=$(date +%s)
JAXLLM_TEST_OFFLINE=1 TESTS=all T_TESTS=380 OUT=$OUT bash bench/gpu_check.sh > $OUT/suite_output.txt 2>&1
echo "suite rc=$? at $(( $(date +%s) - T0 )) s"
tail -6 $OUT/suite_output.txt
P=$OUT/probe; mkdir -p $P
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site JAXLLM_CACHE=/tmp/probe-cache
for t in 1 1 0 1 0 1; do
  [ $(( $(date +%s) - T0 )) -lt 560 ] || { echo "probe stopped at the time limit"; break; }
  JAXLLM_AUTOTUNE=$t timeout 60 python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --batch 16 --kernels auto \
    --loop pipelined --repeat 3 --label "tune$t" --out $P/probe.jsonl > $P/log_$(date +%s)_$t.txt 2>&1
  echo "probe tune=$t rc=$? at $(( $(date +%s) - T0 )) s"
done
python3 -c "
import json
for l in open('$P/probe.jsonl'):
    r = json.loads(l); print(r['label'], round(r['tpot_ms_mean'], 4), round(r['tpot_step_ms_p50'], 4), round(r['compile_s'], 1))
" | tee $P/summary.txt
tar czf $OUT/probe.tgz -C $OUT probe && rm -rf $P
