#!/usr/bin/env bash
# One call on the GPU machine: build the FFI extension, run suite stages (bench/suite.py) and the GPU
# tests. Everything lands in $OUT/suite (the suite's files) and $OUT/*.log, then is packed into $OUT/gpu.tgz
# (the only file left under $OUT: the device tool brings back at most 8 files).
#   STAGES="parity replay kernels" TESTS="tests/test_kernels.py tests/test_graphs.py" bash bench/gpu_check.sh
# Knobs: GEMV_SWEEP (non-empty: run bench/gemv_sweep.cu), GEMV_SHAPES (its shapes, e.g. gate_up,lm_head), STAGES (suite stages; empty: none), TESTS (empty: none), T_TESTS (s), PAIRS, JAXLLM_GIT_COMMIT.
set -u
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "bench/gpu_check.sh builds and runs the CUDA handlers: it needs an NVIDIA GPU, and nvidia-smi finds none here"
  exit 0
fi
OUT=${OUT:-gpu-out}
mkdir -p "$OUT/suite"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export CUDACXX=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
pack() { tar czf /tmp/gpu.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/gpu.tgz "$OUT/"; }
trap pack EXIT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/env.txt"
t0=$(date +%s)
timeout 300 python3 -m pip install --no-build-isolation --no-deps -e . \
  -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90-real > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
python3 -c "import jax, jaxllm.kernels.ffi as f; print(jax.devices(), 'ffi:', f.unavailable_reason() or 'ok')" | tee -a "$OUT/env.txt"
if [ -n "${GEMV_SWEEP-}" ]; then
  # The W8A16 kernel's configurations on the model shapes (bench/gemv_sweep.cu), cuBLAS beside them when
  # its headers are found (the nvidia-cublas wheel).
  cb=$(python3 -c "import nvidia.cublas as c, os; print(os.path.dirname(c.__file__))" 2>/dev/null || true)
  src="-O3 -std=c++17 -arch=sm_90 -I ffi bench/gemv_sweep.cu -o /tmp/gemv_sweep"
  nvcc $src -DWITH_CUBLAS -I"$cb/include" -L"$cb/lib" -l:libcublas.so.13 -Xlinker -rpath="$cb/lib" \
    > "$OUT/gemv_build.log" 2>&1 || nvcc $src >> "$OUT/gemv_build.log" 2>&1 || { tail -20 "$OUT/gemv_build.log"; exit 1; }
  /tmp/gemv_sweep "$OUT/suite/gemv_sweep.jsonl" ${GEMV_SHAPES-} > "$OUT/gemv_sweep.log" 2>&1; echo "gemv sweep: exit $?"
fi
if [ -n "${STAGES-}" ]; then
  python3 bench/suite.py gpu --dir "$OUT/suite" --pairs "${PAIRS:-5}" --stages $STAGES
fi
if [ -n "${TESTS-}" ]; then
  # Several test processes share the GPU: no preallocation, so each takes only what it uses.
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${T_TESTS:-280}" python3 -m pytest -q -rA -n "${WORKERS:-4}" \
    $TESTS > "$OUT/gpu_tests.log" 2>&1
  echo "tests: exit $?"; tail -8 "$OUT/gpu_tests.log"
fi
