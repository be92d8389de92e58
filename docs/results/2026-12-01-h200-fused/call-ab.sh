#!/usr/bin/env bash
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1
pack() { tar czf $OUT/g.tgz -C $OUT r && rm -rf $R; }
trap pack EXIT
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/stamps.txt; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
export CUDACXX=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
timeout 300 python3 -m pip install --no-build-isolation --no-deps -e . -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90-real \
  > $R/build.log 2>&1 || { stamp "build failed"; tail -30 $R/build.log; exit 1; }
stamp built
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 python3 -m pytest -q -rfE -n 4 --maxfail=20 \
  -p no:cacheprovider tests/test_fused.py > $R/gpu_tests.log 2>&1
stamp "tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | head -30; grep -E "^E " $R/gpu_tests.log | head -10
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --loop both --graph-state --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3"
timeout 60 $B --kernels ffi --label "layers-call pdl" > $R/bench1.log 2>&1; stamp "b1 $?"
JAXLLM_PDL=0 timeout 60 $B --kernels ffi --label "layers-call no-pdl" > $R/bench2.log 2>&1; stamp "b2 $?"
JAXLLM_LAYERS_CALL=0 timeout 60 $B --kernels ffi,ffi-unfused --label "per-op" > $R/bench3.log 2>&1; stamp "b3 $?"
grep -h "\[bench\]" $R/bench*.log | cut -c1-200
python3 - <<'PY' $R/bench.jsonl
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l); g = r["graph_state"]
  print(r["label"], r["kernels"], r["loop"], round(r["tpot_ms_mean"], 3), r["step_ms_burst"], g.get("work_thunks"), g.get("coverage"), g.get("work_kinds"))
PY
tail -3 $R/bench1.log
