#!/usr/bin/env bash
# Call 1 (fourth session): build; GPU tests of the cluster-merged attention and the while device loop;
# attention chain and the step with clusters on/off; sampling's parts; the while-loop flag sweep.
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1
pack() { tar czf $OUT/g.tgz -C $OUT r && rm -rf $R; }
trap pack EXIT
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/stamps.txt; }
DEADLINE=${DEADLINE:-560}
room() { [ $(( $(date +%s) - T0 + $1 )) -lt $DEADLINE ] || { stamp "skipped: $2"; return 1; }; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/env.txt
export CUDACXX=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
timeout 300 python3 -m pip install --no-build-isolation --no-deps -e . -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90-real \
  > $R/build.log 2>&1 || { stamp "build failed"; tail -30 $R/build.log; exit 1; }
stamp built
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider -n 4 \
  tests/test_fused.py -k "merged or layers" > $R/gpu_tests_attn.log 2>&1
stamp "attn tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_attn.log | head; grep -E "^E " $R/gpu_tests_attn.log | head -8
room 60 chain && { timeout 70 python3 bench/attention_chain.py --lengths 1 256 4096 --splits default 8 64 --out $R/chain_cluster.json > $R/chain_cluster.log 2>&1; stamp "chain $?"; cat $R/chain_cluster.log | tail -12; }
room 60 chain0 && { JAXLLM_ATTN_CLUSTER=0 timeout 70 python3 bench/attention_chain.py --lengths 1 256 4096 --splits default 8 64 --out $R/chain_global.json > $R/chain_global.log 2>&1; stamp "chain0 $?"; cat $R/chain_global.log | tail -12; }
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3"
room 50 b1 && { timeout 60 $B --kernels ffi --loop pipelined --label "cluster merge" > $R/bench1.log 2>&1; stamp "b1 $?"; }
room 50 b2 && { JAXLLM_ATTN_CLUSTER=0 timeout 60 $B --kernels ffi --loop pipelined --label "global merge" > $R/bench2.log 2>&1; stamp "b2 $?"; }
room 50 b3 && { timeout 60 $B --kernels ffi --loop pipelined --temperature 0.7 --top-p 0.9 --label "sampled" > $R/bench3.log 2>&1; stamp "b3 $?"; }
grep -h "\[bench\]" $R/bench*.log | cut -c1-250
room 50 sample && { timeout 60 python3 bench/sample_cost.py --out $R/sample_cost.json > $R/sample_cost.log 2>&1; stamp "sample_cost $?"; cat $R/sample_cost.log | tail -8; }
room 70 graphs && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 90 python3 -m pytest -q -rfE -p no:cacheprovider \
  tests/test_graphs.py -k "while or graph_state or replay" > $R/gpu_tests_graphs.log 2>&1; stamp "graph tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_graphs.log | head; grep -E "^E " $R/gpu_tests_graphs.log | head -8; }
room 100 sweep && { timeout $(( DEADLINE - $(date +%s) + T0 - 5 )) python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --kernels ffi --loop pipelined --repeat 2 --tokens-per-call 8 --device-loop while --graph-state \
  --sweep bench/sweeps/device-loop.txt --out $R/sweep_while.jsonl --report $R/sweep_while.md > $R/sweep_while.log 2>&1; stamp "sweep $?"; cat $R/sweep_while.md | head -12; }
stamp end
