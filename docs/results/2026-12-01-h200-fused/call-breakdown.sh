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
which nsys ncu > $R/tools.txt 2>&1; ls /usr/local/cuda/bin >> $R/tools.txt 2>&1
timeout 300 python3 -m pip install --no-build-isolation --no-deps -e . -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90-real \
  > $R/build.log 2>&1 || { stamp "build failed"; tail -30 $R/build.log; exit 1; }
stamp built
timeout 150 python3 bench/attention_chain.py --out $R/attention_chain.json 2>&1 | tail -20
stamp "attn rc=$?"
timeout 100 python3 bench/step_breakdown.py --length 256 --out $R/breakdown_256.json 2>&1 | tail -12
stamp "breakdown rc=$?"

XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${T_TESTS:-100} python3 -m pytest -q -rfE -n 4 --maxfail=20 \
  -p no:cacheprovider ${TESTS:-tests/test_fused.py} > $R/gpu_tests.log 2>&1
stamp "tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" $R/gpu_tests.log | head -30
