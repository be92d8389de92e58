#!/usr/bin/env bash
# Call 3: the tuning tests and the kernels' W8A16 test on the GPU, then the autotune A/B (paired processes).
source bench/device_call.sh
export JAXLLM_TEST_OFFLINE=1
timeout 170 python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_tuning.py \
  "tests/test_kernels.py::test_w8a16_matches_reference" -rfEs > $R/tests.log 2>&1; stamp "tests rc=$?"
tail -4 $R/tests.log
ab() {  # preset batch pairs: JAXLLM_AUTOTUNE=0 then 1, each its own process
  for p in $(seq $3); do for t in 0 1; do
    room 75 "ab $1 b$2 pair $p tune=$t" || return 0
    JAXLLM_AUTOTUNE=$t timeout 110 python3 -m jaxllm.bench synthetic:$1 --batch $2 --kernels auto --loop pipelined \
      --repeat 3 --label "tune$t" --out $R/ab.jsonl > $R/ab_$1_b$2_p${p}_t$t.log 2>&1
    stamp "ab $1 b$2 pair $p tune=$t rc=$?"
  done; done
}
ab qwen2.5-7b 16 2
ab qwen2.5-0.5b 16 2
ab qwen2.5-7b 64 1
ab llama-3.1-8b 16 1
cp ~/.cache/jaxllm/tuning/*.json $R/ 2>/dev/null
python3 - $R/ab.jsonl <<'PY' | tee $R/ab_summary.txt
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for r in rows:
  print(f"{r['model']:28s} b{r['batch']:<3d} {r['label']}: TPOT {r['tpot_ms_mean']:.3f} ms  step p50 "
        f"{r['tpot_step_ms_p50']:.3f}  compile {r['compile_s']:.1f} s  load {r['load_s']:.1f} s")
PY
