#!/usr/bin/env bash
# Call 3: build; the layers-call GPU test (coherent loads for the new key's tile only); the XLA flag sweep
# over the fused and the unfused step (one token per call); FFI-vs-XLA path parity (fused greedy).
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1
pack() { tar czf $OUT/g.tgz -C $OUT r && rm -rf $R; }
trap pack EXIT
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/stamps.txt; }
DEADLINE=${DEADLINE:-420}
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
room 200 sweep && { timeout 230 python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --kernels ffi,ffi-unfused --loop pipelined \
  --prompt-len 128 --decode-len 128 --repeat 2 --tokens-per-call 1 --graph-state \
  --sweep bench/sweeps/command-buffers.txt --out $R/sweep.jsonl --report $R/sweep.md > $R/sweep.log 2>&1; stamp "sweep $?"; cat $R/sweep.md; }
room 60 parity && { timeout 90 python3 bench/path_parity.py --json $R/parity.json > $R/parity.log 2>&1; stamp "parity $?"; head -30 $R/parity.log; }
