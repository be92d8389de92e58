#!/usr/bin/env bash
# The changed tests on the GPU (preset shapes' matmuls with the tensor-core kernel, the CLI batch, sampling, serve, cli),
# then the 7B batch-16 step with the chosen tensor-core configurations.
set -u
ROOT=$PWD; T=$ROOT/.carry/tree; R=$OUT/c
mkdir -p $R
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site $T/.whl/*.whl
export PYTHONPATH=/tmp/site CUDACXX=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
t0=$(date +%s)
(cd $T && python3 -m pip install --no-build-isolation --no-deps -e . -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90-real \
   > $R/build.log 2>&1) || { tail -30 $R/build.log; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
cd $T
t0=$(date +%s)
JAXLLM_TEST_OFFLINE=1 JAXLLM_TEST_TIMES=$R/test_times.jsonl XLA_PYTHON_CLIENT_PREALLOCATE=false OMP_NUM_THREADS=1 \
  timeout 120 python3 -m pytest -q -n 16 -p no:cacheprovider --dist worksteal tests/test_kernels.py::test_w8a16_matches_reference_at_preset_shapes \
  tests/test_stream.py::test_cli_batch_of_prompts tests/test_sampling.py tests/test_serve.py tests/test_cli.py > $R/tests.log 2>&1
echo "tests rc $? in $(( $(date +%s) - t0 )) s"; tail -2 $R/tests.log; grep -E "^(FAILED|ERROR)" $R/tests.log | head -20
JAXLLM_GIT_COMMIT=$(cat $ROOT/.carry/commit) timeout 50 python3 -m jaxllm.bench --loop pipelined --repeat 2 --prompt-len 64 \
  --decode-len 64 synthetic:qwen2.5-7b --batch 16 --label new-dispatch --out $R/batch.jsonl 2> $R/batch.log; echo "bench rc $?"
python3 -c "
import json
for l in open('$R/batch.jsonl'):
  r = json.loads(l); print(r['label'], r['batch'], 'step ms', r['tpot_step_ms_p50'], 'total tok/s', round(r['decode_tok_s_total']))
" 2>/dev/null
