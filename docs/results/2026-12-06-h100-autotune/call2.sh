#!/usr/bin/env bash
# Call 2: the sweep with the per-warp ring and the bulk-copy candidates (bench/w8a16_mma_ring.cuh, bench/w8a16_mma_bulk.cuh at e928aa5) beside the dispatched kernel.
set -u
R=$OUT/r; mkdir -p $R
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/stamps.txt; }
trap 'tar czf $OUT/call2.tgz -C $OUT r' EXIT
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv > $R/env.txt
echo "working tree: $(cat .carry/commit 2>/dev/null) + uncommitted ring and bulk candidates" >> $R/env.txt
bash bench/build_gemv_sweep.sh 90 /tmp/gs > $R/build.log 2>&1 || { stamp "build failed"; tail -20 $R/build.log; exit 1; }
stamp built
run() {  # name MS shapes limit
  GEMV_MS=$2 timeout $4 /tmp/gs $R/$1.jsonl $3 > $R/$1.txt 2>&1; stamp "$1 rc=$?"
}
L7=qkv_7b,o_7b,gate_up_7b,down_7b
run edges 13,50 odd_n 30
run m16_7b 16 $L7,lm_head_7b 120
run m64_7b 64 $L7,lm_head_7b 110
run m8_32_7b 8,32 $L7 80
run m16_small 16 qkv,o,gate_up,down,gate_up_1b,down_1b,gate_up_8b,down_8b 80
run m64_small 64 qkv,o,gate_up,down,gate_up_8b,down_8b 60
grep -h WRONG $R/*.txt | head -40 > $R/wrong.txt; stamp "wrong lines: $(wc -l < $R/wrong.txt)"
python3 .carry/best.py $R > $R/best.txt 2>&1; cat $R/best.txt
