#!/usr/bin/env bash
# Ninth session, call 2: where the one-kernel form's time goes. The chain (pdl) beside the one kernel with
# its waits polling every 128 ns (the default), 32 ns and without sleeping, and with no waits or counts at
# all (JAXLLM_ONE_KERNEL_NOSYNC=1: wrong results, the time of the items alone), alternating, two rounds.
DEADLINE=${DEADLINE:-550}
source bench/device_call.sh   # environment, build, stamp/room helpers, logs packed at exit
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi --loop pipelined"
run() { local label=$1; shift; room 30 "$label" && { env "$@" timeout 45 $B --label "$label" >> $R/bench.log 2>&1; stamp "$label rc=$?"; }; }
for round in 1 2; do
  run "chain (pdl), round $round" JAXLLM_LAYERS_LAUNCH=pdl
  run "one kernel, sleep 128, round $round" JAXLLM_LAYERS_LAUNCH=one-kernel
  run "one kernel, sleep 32, round $round" JAXLLM_LAYERS_LAUNCH=one-kernel JAXLLM_ONE_KERNEL_SLEEP=32
  run "one kernel, no sleep, round $round" JAXLLM_LAYERS_LAUNCH=one-kernel JAXLLM_ONE_KERNEL_SLEEP=0
  run "one kernel, no waits, round $round" JAXLLM_LAYERS_LAUNCH=one-kernel JAXLLM_ONE_KERNEL_NOSYNC=1
done
python3 - $R/bench.jsonl <<'P'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l); print(f"{r['label']:36s} TPOT {r['tpot_ms_mean']:.3f} burst {r['step_ms_burst']:.3f}")
P
stamp end
