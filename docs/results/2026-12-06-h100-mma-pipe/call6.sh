#!/usr/bin/env bash
# The pipelined tensor-core candidate (bench/w8a16_mma_pipe.cuh) beside the kernel in use, 7B shapes, 16 and 64 rows.
set -u
T0=$(date +%s); st() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
timeout 150 bash bench/build_gemv_sweep.sh 90 /tmp/gemv_sweep > $OUT/build.log 2>&1; st "built rc $?"
GEMV_MS=13,50 timeout 40 /tmp/gemv_sweep $OUT/sweep_edges.jsonl odd_n > $OUT/edges.log 2>&1; st "edges rc $?"
GEMV_MS=16,64 timeout 170 /tmp/gemv_sweep $OUT/sweep_7b.jsonl gate_up_7b,down_7b,qkv_7b,o_7b > $OUT/sweep.log 2>&1; st "sweep rc $?"
nvidia-smi --query-gpu=name --format=csv,noheader
python3 - $OUT/sweep_edges.jsonl $OUT/sweep_7b.jsonl <<'PY'
import json, sys
for f in sys.argv[1:]:
  try:
    rs = [json.loads(l) for l in open(f)]
  except OSError:
    continue
  bad = [r for r in rs if r.get("matmul") and not (r["rel_err"] < 2e-2)]
  print(f, len(rs), "records; rel_err over 2e-2:", [(r["shape"], r["m"], r["config"], r["rel_err"]) for r in bad])
  for s in sorted({r["shape"] for r in rs}):
    for m in sorted({r["m"] for r in rs if r["shape"] == s}):
      b = sorted([r for r in rs if r["shape"] == s and r["m"] == m and r["config"].startswith("mma")], key=lambda r: r["us"])
      print(s, m, [(r["config"], round(r["us"], 2)) for r in b[:6]])
PY
