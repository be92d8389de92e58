#!/usr/bin/env bash
# Fifth session, call 1: build; ncu's per-kernel durations of the fused decode step (graphs off, one token a
# call); the candidates kernel's GPU tests; sampling's parts; greedy vs sampled (jnp and kernel candidates);
# batch 4 and 16; fused-decode parity.
source bench/device_call.sh
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1); echo "ncu: $NCU" >> $R/env.txt
room 120 ncu && { JAXLLM_CUDA_GRAPHS=0 XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 110 $NCU --clock-control none \
  --kernel-name-base demangled -k regex:jaxllm --launch-count 700 --csv \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__grid_size,launch__block_size,launch__registers_per_thread,sm__throughput.avg.pct_of_peak_sustained_elapsed \
  python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --prompt-len 16 --decode-len 16 --repeat 1 --warmup 0 --kernels ffi \
  --loop pipelined --tokens-per-call 1 --max-context 512 > $R/ncu.csv 2> $R/ncu.err; stamp "ncu $?"; wc -l $R/ncu.csv; tail -3 $R/ncu.err; }
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_sampling.py \
  > $R/gpu_tests_sampling.log 2>&1
stamp "sampling tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_sampling.log | head; grep -E "^E " $R/gpu_tests_sampling.log | head -8
room 60 sample && { timeout 80 python3 bench/sample_cost.py --out $R/sample_cost.json > $R/sample_cost.log 2>&1; stamp "sample_cost $?"; tail -11 $R/sample_cost.log; }
room 60 b1 && { timeout 70 $B --kernels ffi --loop both --label "greedy" > $R/bench1.log 2>&1; stamp "b1 $?"; }
room 50 b2 && { timeout 60 $B --kernels ffi --loop pipelined --temperature 0.7 --top-p 0.9 --label "sampled" > $R/bench2.log 2>&1; stamp "b2 $?"; }
room 50 b3 && { JAXLLM_CANDIDATES_KERNEL=1 timeout 60 $B --kernels ffi --loop pipelined --temperature 0.7 --top-p 0.9 --label "sampled, candidates kernel" > $R/bench3.log 2>&1; stamp "b3 $?"; }
grep -h "\[bench\]" $R/bench*.log | cut -c1-250
room 60 b4 && { timeout 70 $B --kernels ffi --loop pipelined --batch 4 --label "batch 4" > $R/bench4.log 2>&1; stamp "b4 $?"; }
room 60 b16 && { timeout 70 $B --kernels ffi --loop pipelined --batch 16 --label "batch 16" > $R/bench16.log 2>&1; stamp "b16 $?"; }
grep -h "\[bench\]" $R/bench4.log $R/bench16.log | cut -c1-250
room 70 parity && { timeout $(( DEADLINE - $(date +%s) + T0 - 5 )) python3 bench/path_parity.py --json $R/parity.json > $R/parity.log 2>&1; stamp "parity $?"; tail -30 $R/parity.log; }
stamp end
