#!/usr/bin/env bash
# Call 1: build; the layers-call GPU test; A/B of the 5-kernel layers call (prefetch on/off, per-op), host
# timings; step breakdown; graph_diag; then the GPU tests of fused/kernels. Logs in $OUT/r, packed at exit.
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1
pack() { tar czf $OUT/g.tgz -C $OUT r && rm -rf $R; }
trap pack EXIT
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/stamps.txt; }
DEADLINE=${DEADLINE:-550}
room() { [ $(( $(date +%s) - T0 + $1 )) -lt $DEADLINE ] || { stamp "skipped: $2"; return 1; }; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/env.txt
export CUDACXX=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
timeout 300 python3 -m pip install --no-build-isolation --no-deps -e . -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90-real \
  > $R/build.log 2>&1 || { stamp "build failed"; tail -30 $R/build.log; exit 1; }
stamp built
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 90 python3 -m pytest -q -rfE -p no:cacheprovider \
  tests/test_fused.py -k "layers_call" > $R/gpu_tests_layers.log 2>&1
stamp "layers test rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_layers.log | head; grep -E "^E " $R/gpu_tests_layers.log | head -8
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3"
room 90 b1 && { timeout 100 $B --kernels ffi,ffi-unfused --loop both --graph-state --host-timings --label "5-kernel layers call, prefetch" > $R/bench1.log 2>&1; stamp "b1 $?"; }
room 45 b2 && { JAXLLM_L2_PREFETCH=0 timeout 50 $B --kernels ffi --loop pipelined --label "no prefetch" > $R/bench2.log 2>&1; stamp "b2 $?"; }
room 45 b3 && { JAXLLM_LAYERS_CALL=0 timeout 50 $B --kernels ffi --loop pipelined --label "per-op (6 kernels)" > $R/bench3.log 2>&1; stamp "b3 $?"; }
grep -h "\[bench\]" $R/bench*.log | cut -c1-230
room 70 breakdown && { timeout 80 python3 bench/step_breakdown.py --length 256 --out $R/breakdown_256.json > $R/breakdown.log 2>&1; stamp "breakdown $?"; tail -14 $R/breakdown.log; }
room 60 graph_diag && { timeout 70 python3 bench/graph_diag.py --steps 64 --json $R/graph_diag.json --log $R/graph_diag_child.log > $R/graph_diag.log 2>&1; stamp "graph_diag $?"; tail -8 $R/graph_diag.log; }
room 60 tests && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout $(( DEADLINE - $(date +%s) + T0 - 5 )) python3 -m pytest -q -rfE -n 4 --maxfail=20 \
  -p no:cacheprovider tests/test_fused.py tests/test_kernels.py > $R/gpu_tests.log 2>&1; stamp "tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests.log | head -20; }
