#!/usr/bin/env bash
# Fifth session, call 2: the layers call's early trigger and attention preload (GPU tests, then A/B against
# each turned off); the faster candidates kernel (tests, sampling's parts, sampled step against greedy).
source bench/device_call.sh
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi --loop pipelined"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_sampling.py tests/test_fused.py -k "candidates or kernel_path or merged or layers" > $R/gpu_tests_1.log 2>&1
stamp "tests 1 rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_1.log | head; grep -E "^E " $R/gpu_tests_1.log | head -8
unset XLA_PYTHON_CLIENT_PREALLOCATE
room 40 a1 && { timeout 45 $B --label "early+preload (new default)" > $R/a1.log 2>&1; stamp "a1 $?"; }
room 40 a2 && { JAXLLM_PDL_EARLY=0 JAXLLM_ATTN_PRELOAD=0 timeout 45 $B --label "neither (previous)" > $R/a2.log 2>&1; stamp "a2 $?"; }
room 40 a3 && { JAXLLM_PDL_EARLY=0 timeout 45 $B --label "preload only" > $R/a3.log 2>&1; stamp "a3 $?"; }
room 40 a4 && { JAXLLM_ATTN_PRELOAD=0 timeout 45 $B --label "early only" > $R/a4.log 2>&1; stamp "a4 $?"; }
room 40 a5 && { timeout 45 $B --label "early+preload (again)" > $R/a5.log 2>&1; stamp "a5 $?"; }
grep -h "\[bench\]" $R/a*.log | cut -c1-200
room 60 sample && { timeout 70 python3 bench/sample_cost.py --out $R/sample_cost.json > $R/sample_cost.log 2>&1; stamp "sample_cost $?"; tail -11 $R/sample_cost.log; }
room 40 s1 && { timeout 45 $B --temperature 0.7 --top-p 0.9 --label "sampled, candidates kernel" > $R/s1.log 2>&1; stamp "s1 $?"; }
room 40 s2 && { JAXLLM_CANDIDATES_KERNEL=0 timeout 45 $B --temperature 0.7 --top-p 0.9 --label "sampled, jnp candidates" > $R/s2.log 2>&1; stamp "s2 $?"; }
grep -h "\[bench\]" $R/s*.log | cut -c1-200
room 90 tests2 && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout $(( DEADLINE - $(date +%s) + T0 - 5 )) python3 -m pytest -q -rfE -p no:cacheprovider tests/test_graphs.py -k "parity or while or replay or graph_state" > $R/gpu_tests_2.log 2>&1; stamp "tests 2 rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_2.log | head; }
stamp end
