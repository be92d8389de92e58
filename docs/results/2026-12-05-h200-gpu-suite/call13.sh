#!/bin/bash
# The tests the last call's time limit cut (every collected test not in .carry/done.txt), then serve.sh (0.5B).
set -u
ROOT=$PWD; T0=$(date +%s)
# The machine's copy of the working tree (HEAD, clean) is the tree: only its wheels (.carry/tree/.whl) travel.
cp -a bench ffi jaxllm tests docs pyproject.toml README.md CONTRIBUTING.md .carry/tree/
xz -dc .carry/vocab.gguf.xz > .carry/vocab.gguf
cd .carry/tree
D=$OUT/finish; mkdir -p $D
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 JAXLLM_TEST_OFFLINE=1
export CUDACXX=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $D/env.txt
timeout 300 python3 -m pip install --no-build-isolation --no-deps -e . -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90-real > $D/build.log 2>&1 || { tail -30 $D/build.log; exit 1; }
echo "build done at $(( $(date +%s)-T0 )) s"
timeout 90 python3 -m pytest --collect-only -q -p no:cacheprovider tests > $D/collect.txt 2>&1
python3 - $D/collect.txt $ROOT/.carry/done.txt $D/remaining.txt <<'PY'
import sys
ids = [l.rstrip("\n") for l in open(sys.argv[1]) if l.startswith("tests/") and "::" in l]
done = set(l.rstrip("\n") for l in open(sys.argv[2]))
rem = [i for i in ids if i not in done]
open(sys.argv[3], "w").write("".join(i + "\n" for i in rem))
print(f"collected {len(ids)}, done before {len(done & set(ids))} (of {len(done)} recorded), to run {len(rem)}")
PY
JAXLLM_TEST_TIMES=$D/test_times.jsonl XLA_PYTHON_CLIENT_PREALLOCATE=false OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
  MKL_NUM_THREADS=1 timeout 280 python3 - $D/remaining.txt > $D/tests.log 2>&1 <<'PY'
import sys, pytest
ids = [l.rstrip("\n") for l in open(sys.argv[1]) if l.strip()]
sys.exit(pytest.main(["-v", "-rfEs", "-n", "16", "--dist", "worksteal", "-p", "no:cacheprovider", "--durations=40",
                      "-o", "faulthandler_timeout=250"] + ids))
PY
echo "tests: exit $? at $(( $(date +%s)-T0 )) s"
grep -E "^(FAILED|ERROR)" $D/tests.log | head -30; tail -3 $D/tests.log
cd $ROOT
PRESETS=qwen2.5-0.5b,qwen2.5-7b DEADLINE=$(( ${LIMIT:-585} - 15 - $(date +%s) + T0 )) bash bench/device/serve.sh
