#!/usr/bin/env bash
# Session 2026-12-06b call 2: the suite at HEAD alone (call 1's ran beside a compile and timed out at 71%, no
# failure), then Nsight Compute on the production tensor-core configurations at 16 rows (7B gate/up, down).
# Carry [".whl", ".carry/commit", ".carry/call9.sh"].
set -u
T0=$(date +%s); st() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
mkdir -p $OUT/suite $OUT/ncu
JAXLLM_TEST_OFFLINE=1 TESTS=all OUT=$OUT/suite timeout 400 bash bench/gpu_check.sh > $OUT/suite/run.log 2>&1
st "suite rc $?"; tail -4 $OUT/suite/run.log
timeout 120 bash bench/build_gemv_sweep.sh 90 /tmp/gemv_sweep > $OUT/ncu/build.log 2>&1; st "sweep built rc $?"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
for spec in "gate_up_7b:2, \(int\)1, \(int\)4, \(int\)4" "down_7b:2, \(int\)1, \(int\)8, \(int\)8"; do
  shape=${spec%%:*}; cfg=${spec#*:}
  GEMV_MS=16 timeout 60 $NCU --kernel-name-base demangled --kernel-name "regex:mma::Kernel<\(int\)$cfg>" \
    --launch-skip 0 --launch-count 2 --set full --import-source no \
    -o $OUT/ncu/ncu_$shape /tmp/gemv_sweep /tmp/x.jsonl $shape > $OUT/ncu/ncu_$shape.log 2>&1; st "ncu $shape rc $?"
  $NCU --import $OUT/ncu/ncu_$shape.ncu-rep --page details > $OUT/ncu/ncu_$shape.txt 2>&1
  $NCU --import $OUT/ncu/ncu_$shape.ncu-rep --page raw --csv > $OUT/ncu/ncu_${shape}_raw.csv 2>&1
  $NCU --import $OUT/ncu/ncu_$shape.ncu-rep --page source --csv --print-source sass > $OUT/ncu/ncu_${shape}_sass.csv 2>&1
  grep -E "Duration|Throughput|Issue|Occupancy|Registers" $OUT/ncu/ncu_$shape.txt | head -20
done
st done
