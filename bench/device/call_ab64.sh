#!/usr/bin/env bash
# Session 2026-12-06 pm, call 2: the three XT/NW configurations in w8a16_mma.cuh's kCandidates on the GPU (their
# tests and a sweep, with the split-K candidate bench/w8a16_mma_splitk.cuh beside them), then the autotune (on by default now) against the rule in paired processes at 7B b64 and
# b16 and 0.5B b64, each pair on a fresh tuning cache's first timing.
set -u
export DEADLINE=${DEADLINE:-575}
bash bench/build_gemv_sweep.sh 90 /tmp/gs > /tmp/gs_build.log 2>&1 &
SWEEP_BUILD=$!
source bench/device_call.sh
export JAXLLM_TEST_OFFLINE=1
XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_tuning.py \
  "tests/test_kernels.py::test_w8a16_matches_reference" -rfEs > $R/tests.log 2>&1
stamp "tests rc $?"
tail -3 $R/tests.log
wait $SWEEP_BUILD; stamp "sweep build rc $?"
GEMV_MS=64,16 timeout 100 /tmp/gs $R/sweep.jsonl down_7b,o_7b,qkv_7b,gate_up_7b,down_8b,down,gate_up \
  > $R/sweep.log 2>&1
stamp "sweep rc $?"; grep -c WRONG $R/sweep.log
GEMV_MS=13,50,64 timeout 30 /tmp/gs $R/sweep_edges.jsonl odd_n > $R/sweep_edges.log 2>&1
stamp "sweep edges rc $?"; grep -c WRONG $R/sweep_edges.log
export JAXLLM_CACHE=/tmp/autotune-cache
B="python3 -m jaxllm.bench --loop pipelined --repeat 3 --prompt-len 128 --decode-len 128 --kernels auto --out $R/ab.jsonl"
pair() {  # preset batch: JAXLLM_AUTOTUNE=1, 0, 1, 0, each its own process
  for v in 1 0 1 0; do
    room 40 "$1 b$2 tune$v" || return 0
    JAXLLM_AUTOTUNE=$v timeout 100 $B synthetic:$1 --batch $2 --label "tune$v" >> $R/ab.log 2>&1
    stamp "$1 b$2 tune$v rc $?"
  done
}
pair qwen2.5-7b 64
pair qwen2.5-7b 16
pair qwen2.5-0.5b 64
cp -r $JAXLLM_CACHE/tuning $R/ 2>/dev/null
python3 - $R/ab.jsonl <<'PY' | tee $R/ab_summary.txt
import json, sys
for line in open(sys.argv[1]):
  r = json.loads(line)
  print(f"{r['model']:24s} b{r['batch']:<3d} {r['label']}: TPOT {r['tpot_ms_mean']:.3f} ms, {r['decode_tok_s_total']:.0f} "
        f"tok/s, choices {r.get('mma_choices')}, compile {r['compile_s']:.1f} s, peak {r['peak_memory_bytes']}")
PY
python3 - $R/sweep.jsonl <<'PY' | tee $R/sweep_summary.txt
import json, sys
best = {}
for line in open(sys.argv[1]):
  r = json.loads(line)
  if r.get("matmul") and r["config"].startswith("mma"):
    best.setdefault((r["shape"], r["m"]), []).append((r["us"], r["config"], r["ok"]))
for key, v in sorted(best.items()):
  v.sort()
  print(key, " ".join(f"{c}={u:.1f}{'' if ok else '!'}" for u, c, ok in v[:6]))
PY
