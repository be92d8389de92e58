#!/usr/bin/env bash
# Final call: llama.cpp (CUDA) builds in the background while jaxllm builds and the GPU tests and the path
# parity run; then, with the machine otherwise idle, the timed runs: jaxllm's fused step at 8 tokens per call
# (the default) and at 1, the unfused step, sampled, batch 4 and 16, depth 4000, graphs off, and llama-bench
# on a same-shape Q8_0 GGUF. Logs in $OUT/r, packed at exit.
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1 JAXLLM_GIT_COMMIT=${JAXLLM_GIT_COMMIT:-unknown}
pack() { tar czf $OUT/g.tgz -C $OUT r && rm -rf $R; }
trap pack EXIT
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/stamps.txt; }
DEADLINE=${DEADLINE:-560}
room() { [ $(( $(date +%s) - T0 + $1 )) -lt $DEADLINE ] || { stamp "skipped: $2"; return 1; }; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/env.txt
mkdir -p /tmp/lc && tar xzf .carry/llama.cpp.tgz -C /tmp/lc
( cd /tmp/lc/llama.cpp && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF > $R/llama_cfg.log 2>&1 && cmake --build build --target llama-bench -j 14 \
    > $R/llama_build.log 2>&1; echo "llama build rc=$?" >> $R/llama_build.log ) &
LPID=$!
export CUDACXX=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
timeout 300 python3 -m pip install --no-build-isolation --no-deps -e . -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90-real \
  > $R/build.log 2>&1 || { stamp "build failed"; tail -30 $R/build.log; exit 1; }
stamp built
python3 -c "import jax, jaxllm.kernels.ffi as f; print(jax.devices(), 'ffi:', f.unavailable_reason() or 'ok')" | tee -a $R/env.txt
python3 bench/peers/random_gguf.py model qwen2.5-0.5b .carry/qwen-vocab.gguf /tmp/q8.gguf > $R/gguf.log 2>&1
stamp "gguf rc=$?"
timeout 80 python3 bench/path_parity.py --json $R/parity.json > $R/parity.log 2>&1
stamp "parity rc=$?"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 190 python3 -m pytest -q -rfEs -n 4 --maxfail=20 -p no:cacheprovider \
  tests/test_fused.py tests/test_graphs.py tests/test_stream.py > $R/gpu_tests.log 2>&1
stamp "tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests.log | head -20
while kill -0 $LPID 2>/dev/null && room 230 "waiting for llama"; do sleep 3; done
stamp "llama build: $(tail -1 $R/llama_build.log)"
LB=/tmp/lc/llama.cpp/build/bin/llama-bench
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3"
room 45 k8 && { timeout 55 $B --kernels ffi --loop both --graph-state --host-timings --label "fused, K=8 (default)" >> $R/bench.log 2>&1; stamp "k8 rc=$?"; }
room 35 unfused && { timeout 45 $B --kernels ffi-unfused --loop both --tokens-per-call 1 --label "unfused, K=1 (main before)" >> $R/bench.log 2>&1; stamp "unfused rc=$?"; }
[ -x $LB ] && room 30 llama && { timeout 40 $LB -m /tmp/q8.gguf -ngl 99 -fa 1 -p 128 -n 128 -r 3 -o jsonl > $R/llama.jsonl 2> $R/llama.err; stamp "llama-bench rc=$?"; }
room 30 k1 && { timeout 40 $B --kernels ffi --loop both --tokens-per-call 1 --label "fused, K=1" >> $R/bench.log 2>&1; stamp "k1 rc=$?"; }
room 25 sampled && { timeout 35 $B --kernels ffi --loop pipelined --temperature 0.7 --top-p 0.9 --label "sampled t0.7 p0.9, K=8" >> $R/bench.log 2>&1; stamp "sampled rc=$?"; }
room 30 batch4 && { timeout 40 $B --kernels ffi --loop pipelined --batch 4 --label "batch 4 (unfused, K=1)" >> $R/bench.log 2>&1; stamp "batch4 rc=$?"; }
room 30 batch16 && { timeout 40 $B --kernels ffi --loop pipelined --batch 16 --label "batch 16 (unfused, K=1)" >> $R/bench.log 2>&1; stamp "batch16 rc=$?"; }
room 35 depth && { timeout 45 python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 4000 --max-context 4096 --decode-len 64 --repeat 2 --kernels ffi --loop pipelined --label "depth 4000, K=8" >> $R/bench.log 2>&1; stamp "depth rc=$?"; }
[ -x $LB ] && room 20 llama-depth && { timeout 30 $LB -m /tmp/q8.gguf -ngl 99 -fa 1 -p 0 -n 64 -d 4000 -r 2 -o jsonl >> $R/llama.jsonl 2>> $R/llama.err; stamp "llama depth rc=$?"; }
room 25 nographs && { timeout 35 $B --kernels ffi --loop pipelined --graphs off --label "graphs off, K=8" >> $R/bench.log 2>&1; stamp "graphs off rc=$?"; }
[ -x $LB ] && room 15 llama-nographs && { GGML_CUDA_DISABLE_GRAPHS=1 timeout $(( DEADLINE - $(date +%s) + T0 - 3 )) $LB -m /tmp/q8.gguf -ngl 99 -fa 1 -p 0 -n 128 -r 2 -o jsonl > $R/llama_nographs.jsonl 2>> $R/llama.err; stamp "llama no graphs rc=$?"; }
grep "\[bench\]" $R/bench.log | cut -c1-200
python3 -c "
import json
for f in ('$R/llama.jsonl', '$R/llama_nographs.jsonl'):
  try:
    for l in open(f):
      r=json.loads(l); print('llama', f[-20:], r.get('n_prompt'), r.get('n_gen'), r.get('n_depth'), round(r.get('avg_ts',0),1))
  except OSError: pass
"
