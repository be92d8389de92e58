#!/usr/bin/env bash
# NOT RUN: prepared in the fourth session of 2026-12-01 for a second device call that was not lent (see ../2026-12-01-h200-cluster.md).
# Call 2 (fourth session): build; GPU tests of the candidates kernel and sampling; sampling's parts; greedy vs
# sampled step; the while program's thunk dumps; batch 4 and 16; fused-decode parity.
source bench/device_call.sh   # environment, build, stamp/room helpers, logs packed at exit
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_sampling.py \
  > $R/gpu_tests_sampling.log 2>&1
stamp "sampling tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_sampling.log | head; grep -E "^E " $R/gpu_tests_sampling.log | head -8
room 60 sample && { timeout 80 python3 bench/sample_cost.py --out $R/sample_cost.json > $R/sample_cost.log 2>&1; stamp "sample_cost $?"; tail -9 $R/sample_cost.log; }
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3"
room 60 b1 && { timeout 70 $B --kernels ffi,ffi-unfused --loop both --label "greedy" > $R/bench1.log 2>&1; stamp "b1 $?"; }
room 50 b2 && { timeout 60 $B --kernels ffi --loop pipelined --temperature 0.7 --top-p 0.9 --label "sampled" > $R/bench2.log 2>&1; stamp "b2 $?"; }
room 50 b3 && { JAXLLM_CANDIDATES_KERNEL=1 timeout 60 $B --kernels ffi --loop pipelined --temperature 0.7 --top-p 0.9 --label "sampled, candidates kernel" > $R/bench3.log 2>&1; stamp "b3 $?"; }
grep -h "\[bench\]" $R/bench*.log | cut -c1-250
for fl in default +WHILE,+CONDITIONAL; do
  room 40 dump && { X=""; [ $fl = default ] || X="--xla_gpu_enable_command_buffer=$fl"; XLA_FLAGS="$X" timeout 50 python3 -c "
from jaxllm.engine import Engine; from jaxllm.presets import preset; from jaxllm.weights import random_weights
import glob, shutil, os
c = preset('qwen2.5-0.5b'); w = random_weights(c, seed=0)
e = Engine(c, w, None, max_context=256, tokens_per_call=8, device_loop='while')
d = '/tmp/dump_$fl'; s = e.graph_state(True, dump_dir=d)
print({k: s.get(k) for k in ('state', 'command_buffers', 'work_thunks', 'captured', 'coverage', 'kinds_outside')})
os.makedirs('$R/dump_$fl', exist_ok=True)
[shutil.copy(f, '$R/dump_$fl') for f in glob.glob(d + '/*thunk_sequence*')]
" > $R/dump_$fl.log 2>&1; stamp "dump $fl $?"; tail -2 $R/dump_$fl.log; }
done
room 60 b4 && { timeout 70 $B --kernels ffi --loop pipelined --batch 4 --label "batch 4" > $R/bench4.log 2>&1; stamp "b4 $?"; }
room 60 b16 && { timeout 70 $B --kernels ffi --loop pipelined --batch 16 --label "batch 16" > $R/bench16.log 2>&1; stamp "b16 $?"; }
grep -h "\[bench\]" $R/bench4.log $R/bench16.log | cut -c1-250
room 90 parity && { timeout $(( DEADLINE - $(date +%s) + T0 - 5 )) python3 bench/path_parity.py --json $R/parity.json > $R/parity.log 2>&1; stamp "parity $?"; tail -30 $R/parity.log; }
stamp end
