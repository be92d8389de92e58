#!/usr/bin/env bash
# Tenth session, call 2: loads moved off the path after each kernel's wait (the attention's inputs and
# constants before it, the norm weight's lines into L1 before it, the residual right after it) against
# JAXLLM_PREFETCH=0; the fused tests first; traces by role, also with the attention stopped early
# (JAXLLM_ATTN_STOP=wait|prologue|tiles: timing only) to place its time.
DEADLINE=${DEADLINE:-550}
source bench/device_call.sh   # environment, build, stamp/room helpers, logs packed at exit
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_fused.py \
  -k "layers_call_equals or merged or match_unfused" > $R/gpu_tests_fused.log 2>&1
stamp "fused tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_fused.log | tail -5
P="timeout 60 python3 bench/step_profile.py --tokens 64"
for v in default prefetch0 wait prologue tiles; do
  case $v in
    default) E="";; prefetch0) E="JAXLLM_PREFETCH=0";; *) E="JAXLLM_ATTN_STOP=$v";;
  esac
  room 20 "profile $v" && { env $E $P --out $R/profile_$v.json > $R/profile_$v.log 2>&1; stamp "profile $v rc=$?"; sed -n '/^role/,$p' $R/profile_$v.log; }
done
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi --loop pipelined"
for round in 1 2 3; do
  room 25 "on $round" && { timeout 40 $B --label "loads off the path (default), round $round" >> $R/bench.log 2>&1; stamp "on rc=$?"; }
  room 25 "off $round" && { JAXLLM_PREFETCH=0 timeout 40 $B --label "JAXLLM_PREFETCH=0, round $round" >> $R/bench.log 2>&1; stamp "off rc=$?"; }
done
python3 - $R/bench.jsonl <<'P'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l); print(f"{r['label']:44s} TPOT {r['tpot_ms_mean']:.3f} burst {r['step_ms_burst']:.3f} {r['env']['device']}")
P
stamp end
