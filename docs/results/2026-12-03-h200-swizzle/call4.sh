#!/usr/bin/env bash
# Fifteenth session, call 4: the committed tree (the winners of calls 1-2 made the defaults, the switches and the
# losing variants removed): build, the layers-call tests, one bench row.
DEADLINE=${DEADLINE:-190}
source bench/device_call.sh
room 60 tests && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 60 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_fused.py \
  -k "layers_call or linear_residual or (norm_linear and none)" > $R/gpu_tests.log 2>&1; stamp "tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests.log | tail -5; }
room 25 bench && { timeout 30 python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 \
  --kernels ffi --loop pipelined --label "committed tree" > $R/bench.log 2>&1; stamp "bench rc=$?"; grep "\[bench\]" $R/bench.log | cut -c1-200; }
stamp end
