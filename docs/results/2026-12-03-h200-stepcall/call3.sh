#!/usr/bin/env bash
# Sixteenth session, call 3: the tree to be committed (the attention's cluster merge on a transaction barrier; the
# step call of calls 1-2 left out, its code in step-call.patch). llama.cpp (CUDA, llama-bench) builds in the
# background while: the final row with both loops and the host timings, the unfused FFI step, the GPU tests
# (graphs, merged attention, layers call), XLA's command-buffer log (graph_diag, now with the streaming loop),
# the K-step call as a while loop, batch 4 and 16, path parity, then llama-bench and the final row again.
DEADLINE=${DEADLINE:-575}
source bench/device_call.sh
mkdir -p /tmp/lc && tar xzf .carry/llama.cpp.tgz -C /tmp/lc
( cd /tmp/lc/llama.cpp && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    > $R/llama_cfg.log 2>&1 && cmake --build build --target llama-bench -j 12 > $R/llama_build.log 2>&1
  echo "llama build rc=$?" >> $R/llama_build.log ) &
LPID=$!
python3 bench/peers/random_gguf.py model qwen2.5-0.5b .carry/qwen-vocab.gguf /tmp/q8.gguf > $R/gguf.log 2>&1
stamp "gguf rc=$?"
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3"
run() { local secs=$1 what=$2; shift 2; room $secs "$what" && { timeout $secs "$@" >> $R/bench.log 2>&1; stamp "$what rc=$?"; }; }
run 50 final $B --kernels ffi --loop both --graph-state --host-timings --label "final"
run 30 unfused $B --kernels ffi-unfused --loop pipelined --tokens-per-call 1 --label "unfused FFI step, K=1"
python3 -c "import xdist" 2>/dev/null && PAR="-n 4" || PAR=""
room 130 tests && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 130 python3 -m pytest -q -rfE $PAR -p no:cacheprovider tests/test_graphs.py \
  tests/test_fused.py -k "gpu or merged or layers_call" > $R/gpu_tests.log 2>&1; stamp "tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests.log | tail -8; }
room 70 diag && { timeout 70 python3 bench/graph_diag.py --steps 64 --json $R/diag.json --log $R/diag.log > $R/diag.txt 2>&1; stamp "diag rc=$?"; }
run 50 "while loop" $B --kernels ffi --loop both --host-timings --device-loop while --label "final, while loop"
run 30 "batch 4" $B --kernels ffi --loop pipelined --batch 4 --label "final, batch 4"
run 30 "batch 16" $B --kernels ffi --loop pipelined --batch 16 --label "final, batch 16"
room 100 parity && { timeout 100 python3 bench/path_parity.py --json $R/parity.json > $R/parity.txt 2>&1; stamp "parity rc=$?"; tail -5 $R/parity.txt; }
while kill -0 $LPID 2>/dev/null && room 45 "waiting for llama"; do sleep 3; done
stamp "llama build: $(tail -1 $R/llama_build.log)"
LB=/tmp/lc/llama.cpp/build/bin/llama-bench
[ -x $LB ] && room 30 llama && { timeout 35 $LB -m /tmp/q8.gguf -ngl 99 -fa 1 -p 128 -n 128 -r 3 -o jsonl > $R/llama.jsonl 2> $R/llama.err; stamp "llama-bench rc=$?"; }
run 22 "final again" $B --kernels ffi --loop pipelined --label "final again"
grep "\[bench\] host" $R/bench.log
python3 -c "import json; d = json.load(open('$R/diag.json')); print({k: v for k, v in d['segments'].items()})" 2>/dev/null
python3 - $R/bench.jsonl <<'P'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l); b = r['step_ms_burst']; g = r.get('graph_state', {})
  print(f"{r['label'][:26]:26s} {r['kernels']} b{r['batch']} {r['loop'][:4]} K{r.get('tokens_per_call')} TPOT {r['tpot_ms_mean']:.3f} "
        f"burst {b if b is None else round(b, 3)} tok/s {r['decode_tok_s_total']:.1f} floor {r['byte_floor_ms']:.3f} "
        f"peak {r['peak_memory_bytes']/1e9:.2f} GB rss {r['peak_rss_bytes']/1e9:.2f} GB {g.get('work_thunks')} {g.get('state')}")
P
python3 -c "
import json
for l in open('$R/llama.jsonl'):
  r = json.loads(l); print('llama', r.get('n_prompt'), r.get('n_gen'), round(r.get('avg_ts', 0), 1), 'tok/s', round(1e3 / r['avg_ts'], 3) if r.get('n_gen') else '', 'ms/token')
" 2>/dev/null
stamp end
