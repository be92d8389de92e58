#!/usr/bin/env bash
# The test suite on a GPU machine in one command: build the FFI extension for this GPU, then run the tests.
#
#   JAXLLM_TEST_OFFLINE=1 TESTS=all bash bench/gpu_check.sh   # every test (the whole suite)
#   TESTS="tests/test_fused.py tests/test_graphs.py" bash bench/gpu_check.sh
#   STAGES="parity replay" TESTS= bash bench/gpu_check.sh   # bench/suite.py stages only
#
# Everything it writes goes to a folder it makes, $OUT/gpu-check (OUT defaults to ./gpu-out), packed at the
# end into $OUT/gpu-check.tgz; it deletes nothing but that folder of its own. Wheels in .whl/ (packages
# the machine lacks: gguf; for tests/test_serve*.py starlette, uvicorn, pydantic, openai; for
# tests/test_structured.py llguidance and jsonschema; and their dependencies, for the machine's Python; the
# command is in CONTRIBUTING.md) are installed into /tmp/site first. On a machine without the network, set
# JAXLLM_TEST_OFFLINE=1: the tests that download a demo model then skip and say so.
# Knobs: TESTS ("all", files, or empty), GEMV_SWEEP (non-empty: bench/gemv_sweep.cu), STAGES (bench/suite.py stages), WORKERS (test processes, default the cores up to 16),
# T_TESTS (seconds for the tests, default 420), PAIRS (suite pairs, default 5), MEM_FRACTION (each test process's
# share of the GPU's memory, default 0.9 / WORKERS; empty: no limit), ORDER (recorded test times the tests start
# in, the longest files first; default tests/gpu_test_times.jsonl; empty: file order).
set -u
# Records' commit on a lent machine whose copy of the tree has a stale .git: .carry/commit where present.
[ -s .carry/commit ] && export JAXLLM_GIT_COMMIT=${JAXLLM_GIT_COMMIT:-$(cat .carry/commit)}
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "bench/gpu_check.sh builds and runs the CUDA handlers: it needs an NVIDIA GPU, and nvidia-smi finds none here"
  exit 0
fi
OUT=${OUT:-gpu-out}
DIR="$OUT/gpu-check"
if [ -e "$DIR" ]; then
  echo "bench/gpu_check.sh: $DIR exists already; move it away first (this script deletes only what it made)"
  exit 1
fi
mkdir -p "$DIR"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export CUDACXX=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
pack() { tar czf "$OUT/gpu-check.tgz" -C "$OUT" gpu-check && rm -rf "$DIR"; }
trap pack EXIT
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv | tee "$DIR/env.txt"
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
t0=$(date +%s)
timeout 300 python3 -m pip install --no-build-isolation --no-deps -e . \
  -Ccmake.define.CMAKE_CUDA_ARCHITECTURES="${arch}-real" > "$DIR/build.log" 2>&1 || { tail -40 "$DIR/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s (sm_${arch})"
python3 -c "import jax, jaxllm.kernels.ffi as f; print(jax.__version__, jax.devices(), 'ffi:', f.unavailable_reason() or 'ok')" \
  | tee -a "$DIR/env.txt"
if [ -n "${GEMV_SWEEP-}" ]; then
  # The W8A16 kernel's configurations on the model shapes (bench/gemv_sweep.cu), cuBLAS beside them when
  # its headers are found (the nvidia-cublas wheel). GEMV_SHAPES picks shapes (e.g. gate_up,lm_head).
  mkdir -p "$DIR/suite"
  bash bench/build_gemv_sweep.sh "$arch" /tmp/gemv_sweep > "$DIR/gemv_build.log" 2>&1 \
    || { tail -20 "$DIR/gemv_build.log"; exit 1; }
  /tmp/gemv_sweep "$DIR/suite/gemv_sweep.jsonl" ${GEMV_SHAPES-} > "$DIR/gemv_sweep.log" 2>&1; echo "gemv sweep: exit $?"
fi
if [ -n "${STAGES-}" ]; then
  python3 bench/suite.py gpu --dir "$DIR/suite" --pairs "${PAIRS:-5}" --stages $STAGES
fi
TESTS=${TESTS-}
[ "$TESTS" = all ] && TESTS=tests
if [ -n "$TESTS" ]; then
  # Several test processes share the GPU: no preallocation, so each takes only what it uses, and each at most
  # MEM_FRACTION of the card (default 0.9 / WORKERS; empty: no limit): XLA's allocator keeps what a process
  # has taken, and on 2026-12-05 (H100, 16 workers) the LM-head kernel tests running at once filled the 80 GB
  # card for the rest of the run, so tests after them failed wherever they allocated. With the limit, a test
  # that needs more fails by itself, by name. And the CPUs: one BLAS thread each for the numpy references.
  # loadgroup: a module marked xdist_group (its tests share a server or a subprocess's results) runs on one
  # worker, its fixture set up once; groups start first, then the other test files longest first by the times of a
  # recorded GPU run (ORDER, default tests/gpu_test_times.jsonl: a run's test_times.jsonl; empty: file order).
  t0=$(date +%s)
  WORKERS=${WORKERS:-$(( $(nproc) < 16 ? $(nproc) : 16 ))}   # the suite is bound by the CPUs (its compiles)
  frac=${MEM_FRACTION-$(python3 -c "print(round(0.9 / $WORKERS, 3))")}
  echo "tests: $WORKERS processes${frac:+, each at most a fraction $frac of GPU memory}"
  env ${frac:+XLA_CLIENT_MEM_FRACTION=$frac} \
  JAXLLM_TEST_TIMES="$DIR/test_times.jsonl" JAXLLM_TEST_ORDER=${ORDER-tests/gpu_test_times.jsonl} \
    XLA_PYTHON_CLIENT_PREALLOCATE=false OMP_NUM_THREADS=1 \
    OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 timeout "${T_TESTS:-420}" python3 -m pytest -v -rfEs -n "$WORKERS" \
    --dist loadgroup -p no:cacheprovider --durations=40 -o faulthandler_timeout=300 $TESTS > "$DIR/tests.log" 2>&1
  rc=$?
  echo "tests: exit $rc in $(( $(date +%s) - t0 )) s"
  grep -E "^(FAILED|ERROR)" "$DIR/tests.log" | head -40
  tail -3 "$DIR/tests.log"
  exit $rc                       # the tests' verdict is the script's (the exit trap still packs the folder)
fi
