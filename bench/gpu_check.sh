#!/usr/bin/env bash
# One call on the GPU machine: build the FFI extension, run suite stages (bench/suite.py) and the GPU
# tests. Everything lands in $OUT/suite (the suite's files) and $OUT/*.log, then is packed into $OUT/gpu.tgz
# (the only file left under $OUT: the device tool brings back at most 8 files).
#   STAGES="parity replay kernels" TESTS="tests/test_kernels.py tests/test_graphs.py" bash bench/gpu_check.sh
# Knobs: STAGES (suite stages; empty: none), TESTS (empty: none), T_TESTS (s), PAIRS, JAXLLM_GIT_COMMIT.
set -u
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
if [ -n "${STAGES-}" ]; then
  python3 bench/suite.py gpu --dir "$OUT/suite" --pairs "${PAIRS:-5}" --stages $STAGES
fi
if [ -n "${TESTS-}" ]; then
  # Several test processes share the GPU: no preallocation, so each takes only what it uses.
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${T_TESTS:-280}" python3 -m pytest -q -rA -n "${WORKERS:-4}" \
    $TESTS > "$OUT/gpu_tests.log" 2>&1
  echo "tests: exit $?"; tail -8 "$OUT/gpu_tests.log"
fi
