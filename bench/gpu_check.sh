#!/usr/bin/env bash
# One call on the GPU machine: build the FFI extension, run the GPU tests, the kernel microbenchmarks and
# the end-to-end bench. Logs and JSON go to $OUT (default ./gpu-out). Stages have their own time limits so
# one slow stage still leaves the others' results.
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export CUDACXX=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/env.txt"
timeout 300 python3 -m pip install --no-build-isolation --no-deps -e . \
  -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90-real > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
python3 -c "import jax, jaxllm.kernels.ffi as f; print(jax.devices(), 'ffi:', f.unavailable_reason() or 'ok')" | tee -a "$OUT/env.txt"
stage() { local limit=$1; shift; echo "== $*"; timeout "$limit" "$@"; echo "== exit $?"; }
stage ${T_TESTS:-240} python3 -m pytest -q -rA -s ${TESTS:-tests/test_kernels.py tests/test_graphs.py} 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
stage ${T_E2E:-150} python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --kernels both --loop both --graph-state \
  --repeat 3 --out "$OUT/e2e.jsonl" --report "$OUT/e2e.md" 2>&1 | tail -12
stage ${T_KERNELS:-200} python3 bench/kernels.py ${KERNEL_ARGS:---m 1} --out "$OUT/kernels.jsonl" --report "$OUT/kernels.md" 2>&1 | tail -40
stage ${T_PEERS:-300} bash -c "python3 bench/peers/hf_torch.py synthetic:qwen2.5-0.5b --mode graph --out $OUT/peers.jsonl; \
  python3 bench/peers/hf_torch.py synthetic:qwen2.5-0.5b --mode compile --out $OUT/peers.jsonl" 2>&1 | grep "^\[torch"
