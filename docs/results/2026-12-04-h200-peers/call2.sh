#!/usr/bin/env bash
# Call 2 (2026-12-04 pm): test_structured.py on the GPU (the suite's one error: jsonschema missing there);
# issue 35's TPOT, this tree against 6f75ef6 interleaved; llama.cpp prebuilt check; the scaling study with peers.
# carry [".carry/tree", ".carry/old", ".carry/llamacpp-cuda-sm90.tar.xz", ".carry/vocab.gguf"]
set -u
ROOT=$PWD
( python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/tree/.whl/*.whl 2>/dev/null
  cd .carry/old && CUDACXX=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc) PYTHONPATH=/tmp/site python3 -m pip install -q \
  --no-build-isolation --no-deps --target /tmp/old_site . -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90-real > /tmp/old_build.log 2>&1
  echo "old build rc $?" >> /tmp/old_build.log ) &
(tar xJf .carry/llamacpp-cuda-sm90.tar.xz -C /tmp) &
cd .carry/tree
DEADLINE=${DEADLINE:-575} source bench/device_call.sh
wait
cp /tmp/old_build.log $R/
stamp "old: $(tail -1 $R/old_build.log)"
JAXLLM_TEST_OFFLINE=1 XLA_PYTHON_CLIENT_PREALLOCATE=false OMP_NUM_THREADS=1 timeout 150 python3 -m pytest -v -rfEs -n 16 \
  -p no:cacheprovider --dist worksteal tests/test_structured.py > $R/structured.log 2>&1
stamp "test_structured rc $?: $(tail -1 $R/structured.log)"
grep -E "^(FAILED|ERROR)" $R/structured.log | head
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --loop pipelined --repeat 3 --prompt-len 64 --decode-len 128"
new() { JAXLLM_GIT_COMMIT=$(cat $ROOT/.carry/commit) timeout 90 $B --label new --out $R/tpot.jsonl 2>> $R/tpot.log; stamp "new rc $?"; }
old() { (cd /tmp && PYTHONPATH=/tmp/old_site:/tmp/site JAXLLM_GIT_COMMIT=6f75ef6 timeout 90 $B --label old-6f75ef6 --out $R/tpot.jsonl 2>> $R/tpot.log); stamp "old rc $?"; }
new; old; new; old
python3 - $R/tpot.jsonl <<'PY'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l)
  print(r.get("label"), r.get("commit", "")[:8], r.get("kernels"), "token ms", r.get("tpot_token_ms_p50"), "step ms", r.get("tpot_step_ms_p50"), "graphs", r.get("graphs"))
PY
CB=$(find / -name "libcublas.so.13*" -not -path "/proc/*" 2>/dev/null | head -1)
export LD_LIBRARY_PATH=/tmp/llamacpp-bin:${CB:+$(dirname $CB):}/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
echo "cublas: $CB" >> $R/env.txt
LB=/tmp/llamacpp-bin
timeout 60 $LB/llama-bench --list-devices > $R/llama_devices.txt 2>&1; stamp "llama-bench --list-devices rc $?: $(grep CUDA0 $R/llama_devices.txt)"
ldd $LB/llama-bench $LB/libggml-cuda.so.0 > $R/ldd.txt 2>&1
PEERS=""
grep -q "CUDA0" $R/llama_devices.txt && PEERS="--llama-bench $LB/llama-bench --llama-batched-bench $LB/llama-batched-bench --vocab $ROOT/.carry/vocab.gguf --peer-types Q8_0,Q4_0"
left() { echo $(( DEADLINE - 20 - $(date +%s) + T0 )); }
stamp "scaling, peers: ${PEERS:-none}, $(left) s left"
timeout $(left) python3 bench/scaling.py --dir $OUT/scaling --presets qwen2.5-7b,qwen2.5-0.5b --batches 1,16,64 \
  $PEERS --gguf-dir /tmp/gguf --time-limit $(( $(left) - 10 )) > $R/scaling.log 2>&1; stamp "scaling rc $?"
tail -30 $R/scaling.log
