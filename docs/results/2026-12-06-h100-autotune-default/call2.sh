#!/usr/bin/env bash
# Session 2026-12-06 pm, call 2: the whole suite (bench/gpu_check.sh), then while time is left the split-K candidate
# and the new 64-row configurations in the sweep, then the autotune against the rule at 7B batch 64 (paired
# processes, a fresh tuning cache: the first autotune process's child times the shapes).
set -u
T0=$(date +%s)
DEADLINE=${DEADLINE:-580}
R=$OUT/r; mkdir -p $R
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/stamps.txt; }
room() { [ $(( $(date +%s) - T0 + $1 )) -lt $DEADLINE ] || { stamp "skipped: $2"; return 1; }; }
bash bench/build_gemv_sweep.sh 90 /tmp/gs > $R/gs_build.log 2>&1 &
JAXLLM_TEST_OFFLINE=1 TESTS=all T_TESTS=${T_TESTS:-360} OUT=$OUT bash bench/gpu_check.sh > $R/gpu_check.log 2>&1
stamp "gpu_check rc $?"
tail -8 $R/gpu_check.log
wait; stamp "sweep build done"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 JAXLLM_GIT_COMMIT=$(cat .carry/commit)
if room 80 sweep; then
  GEMV_MS=64,16 timeout 70 /tmp/gs $R/sweep.jsonl down_7b,o_7b,qkv_7b,gate_up_7b > $R/sweep.log 2>&1
  stamp "sweep rc $?"; grep -c WRONG $R/sweep.log
fi
export JAXLLM_CACHE=/tmp/autotune-cache
B="python3 -m jaxllm.bench --loop pipelined --repeat 3 --prompt-len 128 --decode-len 128 --kernels auto --out $R/ab.jsonl"
for v in 1 0 1 0; do
  room 35 "7b b64 tune$v" || break
  JAXLLM_AUTOTUNE=$v timeout 60 $B synthetic:qwen2.5-7b --batch 64 --label "tune$v" >> $R/ab.log 2>&1
  stamp "7b b64 tune$v rc $?"
done
cp -r $JAXLLM_CACHE/tuning $R/ 2>/dev/null
python3 - $R/ab.jsonl <<'PY' 2>/dev/null | tee $R/ab_summary.txt
import json, sys
for line in open(sys.argv[1]):
  r = json.loads(line)
  print(f"{r['model']:24s} b{r['batch']:<3d} {r['label']}: TPOT {r['tpot_ms_mean']:.3f} ms, {r['decode_tok_s_total']:.0f} "
        f"tok/s, choices {r.get('mma_choices')}, compile {r['compile_s']:.1f} s")
PY
python3 - $R/sweep.jsonl <<'PY' 2>/dev/null | tee $R/sweep_summary.txt
import json, sys
best = {}
for line in open(sys.argv[1]):
  r = json.loads(line)
  if r.get("matmul") and r["config"].startswith("mma"):
    best.setdefault((r["shape"], r["m"]), []).append((r["us"], r["config"], r["ok"]))
for key, v in sorted(best.items()):
  v.sort()
  print(key, " ".join(f"{c}={u:.1f}{'' if ok else '!'}" for u, c, ok in v[:7]))
PY
tar czf $OUT/r.tgz -C $OUT r && rm -rf $R
