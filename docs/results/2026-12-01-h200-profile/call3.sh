#!/usr/bin/env bash
# Fifth session, call 3 (final): llama.cpp (CUDA) builds in the background from the start; jaxllm's timed
# runs go first (beside that build: noted as contended), then the GPU tests of the final code, then
# llama-bench once its build is done, then jaxllm's default again with the machine idle.
mkdir -p /tmp/lc $OUT/r && tar xzf .carry/llama.cpp.tgz -C /tmp/lc
( cd /tmp/lc/llama.cpp && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF > $OUT/r/llama_cfg.log 2>&1 && cmake --build build --target llama-bench -j 14 \
    > $OUT/r/llama_build.log 2>&1; echo "llama build rc=$?" >> $OUT/r/llama_build.log ) &
LPID=$!
DEADLINE=545
source bench/device_call.sh   # environment, our build, stamp/room helpers, logs packed at exit
python3 bench/peers/random_gguf.py model qwen2.5-0.5b .carry/qwen-vocab.gguf /tmp/q8.gguf > $R/gguf.log 2>&1
stamp "gguf rc=$?"
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3"
room 50 k8 && { timeout 55 $B --kernels ffi --loop both --graph-state --host-timings --label "fused, K=8 (default), contended" >> $R/bench.log 2>&1; stamp "k8 rc=$?"; }
room 40 late && { JAXLLM_PDL_EARLY=0 timeout 40 $B --kernels ffi --loop pipelined --label "fused, K=8, JAXLLM_PDL_EARLY=0, contended" >> $R/bench.log 2>&1; stamp "late rc=$?"; }
room 40 unfused && { timeout 45 $B --kernels ffi-unfused --loop pipelined --tokens-per-call 1 --label "unfused, K=1, contended" >> $R/bench.log 2>&1; stamp "unfused rc=$?"; }
room 35 sampled && { timeout 40 $B --kernels ffi --loop pipelined --temperature 0.7 --top-p 0.9 --label "sampled t0.7 p0.9, K=8, contended" >> $R/bench.log 2>&1; stamp "sampled rc=$?"; }
room 35 nographs && { timeout 40 $B --kernels ffi --loop pipelined --graphs off --label "graphs off, K=8, contended" >> $R/bench.log 2>&1; stamp "graphs off rc=$?"; }
grep "\[bench\]" $R/bench.log | cut -c1-200
room 60 tests && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_fused.py tests/test_graphs.py -k "merged or layers or parity_qwen or replay" > $R/gpu_tests.log 2>&1; stamp "tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests.log | head; }
while kill -0 $LPID 2>/dev/null && room 100 "waiting for llama"; do sleep 3; done
stamp "llama build: $(tail -1 $R/llama_build.log)"
LB=/tmp/lc/llama.cpp/build/bin/llama-bench
[ -x $LB ] && room 35 llama && { timeout 40 $LB -m /tmp/q8.gguf -ngl 99 -fa 1 -p 128 -n 128 -r 3 -o jsonl > $R/llama.jsonl 2> $R/llama.err; stamp "llama-bench rc=$?"; }
room 45 idle && { timeout 50 $B --kernels ffi --loop both --label "fused, K=8 (default), idle" >> $R/bench.log 2>&1; stamp "idle k8 rc=$?"; }
[ -x $LB ] && room 20 llama-nographs && { GGML_CUDA_DISABLE_GRAPHS=1 timeout $(( DEADLINE - $(date +%s) + T0 - 3 )) $LB -m /tmp/q8.gguf -ngl 99 -fa 1 -p 0 -n 128 -r 2 -o jsonl > $R/llama_nographs.jsonl 2>> $R/llama.err; stamp "llama no graphs rc=$?"; }
grep "\[bench\]" $R/bench.log | tail -2 | cut -c1-200
python3 -c "
import json
for f in ('$R/llama.jsonl', '$R/llama_nographs.jsonl'):
  try:
    for l in open(f):
      r=json.loads(l); print('llama', f[-20:], r.get('n_prompt'), r.get('n_gen'), r.get('n_depth'), round(r.get('avg_ts',0),1))
  except OSError: pass
"
stamp end
