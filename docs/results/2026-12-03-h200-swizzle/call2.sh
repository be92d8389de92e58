#!/usr/bin/env bash
# Fifteenth session, call 2: llama.cpp (CUDA, llama-bench) builds in the background while jaxllm builds and the
# variants run (one build, picked by environment variables; the swizzled tile is on in every row):
#   JAXLLM_EXP_DOWN=1|7   the down projection: 4 rows a block of 256 threads, or 2 rows a team of 128 with 3 loads
#                         a row, int16 products, rows shared evenly between the SMs (1: call 1's best)
#   JAXLLM_EXP_SCORE=1    the attention's scores in four chains of FMAs, its weighted sum in two
#   JAXLLM_EXP_QKV=1|2|4  the QKV projection on 132 blocks (a warp a row, 2 rows: f32 or int16 products; or 2 warps a
#                         row, 4 rows)
# The best combination is then tested (tests/test_fused.py whole, the graphs tests) and timed again with the
# machine otherwise idle, beside the unfused FFI step and llama-bench on a same-shape Q8_0 GGUF.
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
row() { local label=$1; shift; room 24 "$label" && { env "$@" timeout 40 $B --kernels ffi --loop pipelined --label "$label" >> $R/bench.log 2>&1; stamp "$label rc=$?"; }; }
round() {
  row "down1, round $1" JAXLLM_EXP_DOWN=1
  row "down1 + score, round $1" JAXLLM_EXP_DOWN=1 JAXLLM_EXP_SCORE=1
  row "down1 + qkv1, round $1" JAXLLM_EXP_DOWN=1 JAXLLM_EXP_QKV=1
  row "down1 + qkv2, round $1" JAXLLM_EXP_DOWN=1 JAXLLM_EXP_QKV=2
  row "down1 + qkv4, round $1" JAXLLM_EXP_DOWN=1 JAXLLM_EXP_QKV=4
  row "down7, round $1" JAXLLM_EXP_DOWN=7
}
round 1
row "main's kernels, round 1" JAXLLM_ATTN_SWIZZLE=0
round 2
# The best: down1 or down7, then each of score and the best QKV variant where it beat that by 2 us a token.
python3 - $R/bench.jsonl > $R/best.env <<'P'
import json, sys, collections
t = collections.defaultdict(list)
for l in open(sys.argv[1]):
  r = json.loads(l); t[r['label'].split(',')[0]].append(r['tpot_ms_mean'])
m = {k: sum(v) / len(v) for k, v in t.items()}
env = ["JAXLLM_EXP_DOWN=7" if m.get("down7", 9) < m["down1"] else "JAXLLM_EXP_DOWN=1"]
base = m["down1"]
if m.get("down1 + score", 9) < base - 0.002: env.append("JAXLLM_EXP_SCORE=1")
q = min((k for k in m if k.startswith("down1 + qkv")), key=m.get, default=None)
if q and m[q] < base - 0.002: env.append("JAXLLM_EXP_QKV=" + q[-1])
print(" ".join(env))
P
BEST=$(cat $R/best.env); stamp "best: $BEST"
python3 -c "import xdist" 2>/dev/null && PAR="-n 4" || PAR=""
room 150 "tests" && { env $BEST XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest -q -rfE $PAR -p no:cacheprovider \
  tests/test_fused.py tests/test_graphs.py > $R/gpu_tests.log 2>&1; stamp "tests ($BEST) rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests.log | tail -12; }
while kill -0 $LPID 2>/dev/null && room 100 "waiting for llama"; do sleep 3; done
stamp "llama build: $(tail -1 $R/llama_build.log)"
LB=/tmp/lc/llama.cpp/build/bin/llama-bench
room 40 final && { env $BEST timeout 50 $B --kernels ffi --loop both --graph-state --host-timings --label "final: $BEST" >> $R/bench.log 2>&1; stamp "final rc=$?"; }
room 30 unfused && { timeout 40 $B --kernels ffi-unfused --loop pipelined --tokens-per-call 1 --label "unfused FFI step, K=1" >> $R/bench.log 2>&1; stamp "unfused rc=$?"; }
[ -x $LB ] && room 25 llama && { timeout 35 $LB -m /tmp/q8.gguf -ngl 99 -fa 1 -p 128 -n 128 -r 3 -o jsonl > $R/llama.jsonl 2> $R/llama.err; stamp "llama-bench rc=$?"; }
room 20 final2 && { env $BEST timeout 30 $B --kernels ffi --loop pipelined --label "final again: $BEST" >> $R/bench.log 2>&1; stamp "final again rc=$?"; }
prof() { local name=$1; shift; room 22 "profile $name" && { env "$@" timeout 30 python3 bench/step_profile.py --tokens 64 --out $R/profile_$name.json > $R/profile_$name.txt 2>&1; stamp "profile $name rc=$?"; sed -n "/^role/,/^o /p" $R/profile_$name.txt; }; }
prof final $BEST
python3 - $R/bench.jsonl <<'P'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l); b = r['step_ms_burst']
  print(f"{r['label'][:44]:44s} TPOT {r['tpot_ms_mean']:.3f} burst {b if b is None else round(b, 3)} floor {r['byte_floor_ms']:.3f} "
        f"peak {r['peak_memory_bytes']/1e9:.2f} GB rss {r['peak_rss_bytes']/1e9:.2f} GB")
P
python3 -c "
import json
for l in open('$R/llama.jsonl'):
  r = json.loads(l); print('llama', r.get('n_prompt'), r.get('n_gen'), round(r.get('avg_ts', 0), 1), 'tok/s', round(1e3 / r['avg_ts'], 3) if r.get('n_gen') else '', 'ms/token')
" 2>/dev/null
stamp end
