#!/usr/bin/env bash
# Seventh session, call 3: main after the one-kernel MLP was removed and the CPU's default became 8 steps a
# call in a while loop (the GPU's default unchanged): the graphs, stream and fused-layers tests on the GPU,
# then the default step, three rounds.
DEADLINE=${DEADLINE:-420}
source bench/device_call.sh   # environment, build, stamp/room helpers, logs packed at exit
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_graphs.py \
  tests/test_stream.py tests/test_fused.py -k "parity_qwen or replay or while or tokens_per_call or layers_call" \
  > $R/gpu_tests.log 2>&1
stamp "tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests.log | head
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi --loop pipelined"
for round in 1 2 3; do
  room 30 default$round && { timeout 40 $B --label "default, round $round" >> $R/bench.log 2>&1; stamp "default rc=$?"; }
done
grep "\[bench\]" $R/bench.log | cut -c1-200
stamp end
