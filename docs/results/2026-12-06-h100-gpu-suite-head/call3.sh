#!/usr/bin/env bash
# Session 2026-12-06b call 3 (fresh machine): the whole suite at HEAD alone (calls 1-2 left pytest running past
# their timeouts, so they overlapped), then the tensor-core sweep at 16 and 64 rows on the 7B matmuls with the new
# KS=1/2/12/16 configurations, then Nsight Compute on the 16- and 64-row gate/up rules. One archive comes back.
# Carry [".whl", ".carry/commit", ".carry/call10.sh"].
set -u
T0=$(date +%s); st() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
R=$OUT/r; mkdir -p $R/suite $R/ncu
setsid bash -c "JAXLLM_TEST_OFFLINE=1 TESTS=all OUT=$R/suite bash bench/gpu_check.sh > $R/suite/run.log 2>&1" &
SP=$!; for i in $(seq 420); do kill -0 $SP 2>/dev/null || break; sleep 1; done
kill -0 $SP 2>/dev/null && { kill -9 -- -$SP; st "suite KILLED at limit"; }
pkill -9 -f pytest; pkill -9 -f xdist; sleep 1
st "suite ended"; tail -4 $R/suite/run.log
timeout 120 bash bench/build_gemv_sweep.sh 90 /tmp/gemv_sweep > $R/sweep_build.log 2>&1; st "sweep built rc $?"
GEMV_MS=16,64 timeout 150 /tmp/gemv_sweep $R/sweep_7b.jsonl gate_up_7b,down_7b,qkv_7b,o_7b > $R/sweep_7b.log 2>&1
st "sweep rc $?"
python3 - $R/sweep_7b.jsonl <<'PY'
import json, sys, collections
by = collections.defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l)
    if r["config"].startswith(("mma_", "mmastaged", "wgmma")): by[(r["shape"], r["m"])].append(r)
for k in sorted(by):
    rs = sorted(by[k], key=lambda r: r["us"])
    print(k, " ".join(f"{r['config']}={r['us']:.2f}" for r in rs[:6]))
PY
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
for spec in "gate_up_7b:16:2, \(int\)1, \(int\)4, \(int\)4" "gate_up_7b:64:8, \(int\)2, \(int\)4, \(int\)2"; do
  shape=${spec%%:*}; rest=${spec#*:}; ms=${rest%%:*}; cfg=${rest#*:}; tag=${shape}_$ms
  GEMV_MS=$ms timeout 60 $NCU --kernel-name-base demangled --kernel-name "regex:mma::Kernel<\(int\)$cfg>" \
    --launch-skip 0 --launch-count 1 --set full --import-source no \
    -o $R/ncu/$tag /tmp/gemv_sweep /tmp/x.jsonl $shape > $R/ncu/$tag.log 2>&1; st "ncu $tag rc $?"
  $NCU --import $R/ncu/$tag.ncu-rep --page details > $R/ncu/$tag.txt 2>&1
  $NCU --import $R/ncu/$tag.ncu-rep --page raw --csv > $R/ncu/${tag}_raw.csv 2>&1
  $NCU --import $R/ncu/$tag.ncu-rep --page source --csv --print-source sass > $R/ncu/${tag}_sass.csv 2>&1
  grep -E "Duration|Throughput|Issue Slots|Registers Per|Theoretical Occ|Achieved Occ|L1/TEX Hit|L2 Hit" $R/ncu/$tag.txt | head -14
done
tar czf $OUT/call10.tgz -C $R . ; st done
