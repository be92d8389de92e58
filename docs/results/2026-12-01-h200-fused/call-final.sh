#!/usr/bin/env bash
# Final H200 call: llama.cpp (CUDA) built in the background while the GPU tests run; then, with the machine
# otherwise idle, jaxllm's fused and unfused decode (greedy, sampled, graphs off, batch 4, depth 4000) and
# llama-bench on a same-shape Q8_0 GGUF. Logs into $OUT/r, packed at exit.
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1
pack() { tar czf $OUT/g.tgz -C $OUT r && rm -rf $R; }
trap pack EXIT
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/stamps.txt; }
DEADLINE=${DEADLINE:-570}
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
git log -1 --format=%H > $R/commit.txt 2>/dev/null
python3 -c "import jax, jaxllm.kernels.ffi as f; print(jax.devices(), 'ffi:', f.unavailable_reason() or 'ok')" | tee -a $R/env.txt
python3 bench/peers/random_gguf.py model qwen2.5-0.5b .carry/qwen-vocab.gguf /tmp/q8.gguf > $R/gguf.log 2>&1
stamp "gguf rc=$?"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m pytest -q -rfEs -n 4 --maxfail=20 -p no:cacheprovider \
  tests/test_fused.py tests/test_kernels.py tests/test_graphs.py tests/test_prefill.py > $R/gpu_tests.log 2>&1
stamp "tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests.log | head -20
while kill -0 $LPID 2>/dev/null && room 200 "waiting for llama"; do sleep 3; done
stamp "llama build: $(tail -1 $R/llama_build.log)"
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3"
room 60 greedy && { timeout 80 $B --kernels ffi,ffi-unfused --loop both --graph-state --label greedy >> $R/bench.log 2>&1; stamp "greedy rc=$?"; }
room 30 sampled && { timeout 45 $B --kernels ffi --loop pipelined --temperature 0.7 --top-p 0.9 --label "sampled t0.7 p0.9" >> $R/bench.log 2>&1; stamp "sampled rc=$?"; }
room 30 nographs && { timeout 45 $B --kernels ffi --loop pipelined --graphs off --label "graphs off" >> $R/bench.log 2>&1; stamp "graphs off rc=$?"; }
room 30 nopdl && { JAXLLM_PDL=0 timeout 45 $B --kernels ffi --loop pipelined --label "no PDL" >> $R/bench.log 2>&1; stamp "no pdl rc=$?"; }
room 50 batch4 && { timeout 70 $B --kernels ffi,ffi-unfused --loop pipelined --batch 4 --label "batch 4" >> $R/bench.log 2>&1; stamp "batch4 rc=$?"; }
room 60 depth && { timeout 80 python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 4000 --max-context 4096 --decode-len 64 --repeat 2 --kernels ffi,ffi-unfused --loop pipelined --label "depth 4000" >> $R/bench.log 2>&1; stamp "depth rc=$?"; }
LB=/tmp/lc/llama.cpp/build/bin/llama-bench
if [ -x $LB ]; then
  room 30 llama-bench && { timeout 60 $LB -m /tmp/q8.gguf -ngl 99 -fa 1 -p 128 -n 128 -r 3 -o jsonl > $R/llama.jsonl 2> $R/llama.err; stamp "llama-bench rc=$?"; }
  room 20 llama-nographs && { GGML_CUDA_DISABLE_GRAPHS=1 timeout 40 $LB -m /tmp/q8.gguf -ngl 99 -fa 1 -p 0 -n 128 -r 2 -o jsonl > $R/llama_nographs.jsonl 2>> $R/llama.err; stamp "llama no graphs rc=$?"; }
  room 15 llama-depth && { timeout $(( DEADLINE - $(date +%s) + T0 - 3 )) $LB -m /tmp/q8.gguf -ngl 99 -fa 1 -p 0 -n 64 -d 4000 -r 2 -o jsonl >> $R/llama.jsonl 2>> $R/llama.err; stamp "llama depth rc=$?"; }
fi
grep "^|" $R/bench.log | grep -v "^|---" | sort -u | head -30
python3 -c "
import json
for l in open('$R/llama.jsonl'):
  r=json.loads(l); print('llama', r.get('n_prompt'), r.get('n_gen'), r.get('n_depth'), round(r.get('avg_ts',0),1))
" 2>/dev/null
