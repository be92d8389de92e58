#!/usr/bin/env bash
# Call 2: tokens per call (K = 1, 4, 8) for the fused and unfused step, host timings, the per-line L2
# prefetch experiment, the layers-call GPU test again.
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1
pack() { tar czf $OUT/g.tgz -C $OUT r && rm -rf $R; }
trap pack EXIT
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/stamps.txt; }
DEADLINE=${DEADLINE:-500}
room() { [ $(( $(date +%s) - T0 + $1 )) -lt $DEADLINE ] || { stamp "skipped: $2"; return 1; }; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
export CUDACXX=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
timeout 300 python3 -m pip install --no-build-isolation --no-deps -e . -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90-real \
  > $R/build.log 2>&1 || { stamp "build failed"; tail -30 $R/build.log; exit 1; }
stamp built
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 90 python3 -m pytest -q -rfE -p no:cacheprovider \
  tests/test_fused.py -k "layers_call" > $R/gpu_tests_layers.log 2>&1
stamp "layers test rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_layers.log | head; grep -E "^E " $R/gpu_tests_layers.log | head -8
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3"
room 60 k1 && { timeout 80 $B --kernels ffi,ffi-unfused --loop both --host-timings --label "K=1" > $R/bench_k1.log 2>&1; stamp "k1 $?"; }
room 60 k4 && { timeout 80 $B --kernels ffi,ffi-unfused --loop both --tokens-per-call 4 --label "K=4" > $R/bench_k4.log 2>&1; stamp "k4 $?"; }
room 45 k8 && { timeout 60 $B --kernels ffi --loop both --tokens-per-call 8 --graph-state --label "K=8" > $R/bench_k8.log 2>&1; stamp "k8 $?"; }
room 30 pf && { JAXLLM_L2_PREFETCH=1 timeout 40 $B --kernels ffi --loop pipelined --label "K=1 L2 prefetch per line" > $R/bench_pf.log 2>&1; stamp "pf $?"; }
room 40 k8b4 && { timeout 50 $B --kernels ffi --loop pipelined --batch 4 --tokens-per-call 8 --label "batch 4 K=8" > $R/bench_b4.log 2>&1; stamp "b4 $?"; }
grep -h "\[bench\]" $R/bench*.log | cut -c1-250
