#!/usr/bin/env bash
# Session 2026-12-06 pm, call 1: the tuning's child process on the GPU, the 64-row occupancy candidates
# (bench/w8a16_mma_occ.cuh) swept beside the kernel, then the autotune and head-rule A/Bs in paired processes.
set -u
export LAB=1 DEADLINE=${DEADLINE:-575}
bash bench/build_gemv_sweep.sh 90 /tmp/gs > /tmp/gs_build.log 2>&1 &
SWEEP_BUILD=$!
source bench/device_call.sh
export JAXLLM_TEST_OFFLINE=1
XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_tuning.py -rfEs \
  > $R/tests.log 2>&1
stamp "tests/test_tuning.py rc $?"
tail -3 $R/tests.log
wait $SWEEP_BUILD; stamp "sweep build rc $?"; cp /tmp/gs_build.log $R/
GEMV_MS=64,16 timeout 130 /tmp/gs $R/sweep.jsonl gate_up_7b,down_7b,qkv_7b,o_7b,gate_up,gate_up_14b > $R/sweep.log 2>&1
stamp "sweep rc $?"
GEMV_MS=13,50,64 timeout 40 /tmp/gs $R/sweep_edges.jsonl odd_n > $R/sweep_edges.log 2>&1
stamp "sweep edges rc $?"
grep -c WRONG $R/sweep_edges.log
grep -c WRONG $R/sweep.log
export JAXLLM_CACHE=/tmp/autotune-cache
B="python3 -m jaxllm.bench --loop pipelined --repeat 3 --prompt-len 128 --decode-len 128 --kernels auto --out $R/ab.jsonl"
pair() {  # preset batch label-prefix variable [NAME=VALUE]: VARIABLE=1, 0, 1, 0, each its own process
  for v in 1 0 1 0; do
    room 40 "$1 b$2 $3$v" || return 0
    env "$4=$v" ${5:-} timeout 100 $B synthetic:$1 --batch $2 --label "$3$v" >> $R/ab.log 2>&1
    stamp "$1 b$2 $3$v rc $?"
  done
}
pair qwen2.5-7b 16 tune JAXLLM_AUTOTUNE
pair qwen2.5-0.5b 16 tune JAXLLM_AUTOTUNE
pair qwen2.5-7b 16 head JAXLLM_MMA_HEAD JAXLLM_AUTOTUNE=0
cp -r $JAXLLM_CACHE/tuning $R/ 2>/dev/null
python3 - $R/ab.jsonl <<'PY' | tee $R/ab_summary.txt
import json, sys
for line in open(sys.argv[1]):
  r = json.loads(line)
  print(f"{r['model']:28s} b{r['batch']:<3d} {r['label']}: TPOT {r['tpot_ms_mean']:.3f} ms, compile {r['compile_s']:.1f} s")
PY
python3 - $R/sweep.jsonl <<'PY' | tee $R/sweep_summary.txt
import json, sys
best = {}
for line in open(sys.argv[1]):
  r = json.loads(line)
  if r.get("matmul") and (r["config"].startswith("mma_") or r["config"].startswith("occ_")):
    best.setdefault((r["shape"], r["m"]), []).append((r["us"], r["config"], r["ok"]))
for key, v in sorted(best.items()):
  v.sort()
  print(key, " ".join(f"{c}={u:.1f}{'' if ok else '!'}" for u, c, ok in v[:6]))
PY
