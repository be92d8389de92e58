#!/usr/bin/env bash
# Tenth session, call 3: room for the next kernel's blocks. The down projection (896 blocks of 256 threads:
# every thread slot of the SMs) and gate/up (3 blocks of 80 registers a thread on every SM: the register
# file) leave no room for their dependents' blocks to launch early. Variants (JAXLLM_EXP_DOWN: threads per
# down row, 2 or 4 rows a block; JAXLLM_EXP_BALANCE=0: gate/up's 304 blocks instead of 396), traced by role
# and timed alternately; their kernel tests first.
DEADLINE=${DEADLINE:-560}
source bench/device_call.sh   # environment, build, stamp/room helpers, logs packed at exit
T="tests/test_fused.py -k norm_linear or linear_residual or layers_call"
JAXLLM_EXP_DOWN=128 JAXLLM_EXP_BALANCE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 python3 -m pytest -q -rfE -p no:cacheprovider \
  tests/test_fused.py -k "norm_linear or linear_residual or layers_call" > $R/tests_down128_nobal.log 2>&1
stamp "tests down 128, no balance rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/tests_down128_nobal.log | tail -3
JAXLLM_EXP_DOWN=64 XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 60 python3 -m pytest -q -rfE -p no:cacheprovider \
  tests/test_fused.py -k "linear_residual or layers_call" > $R/tests_down64.log 2>&1
stamp "tests down 64 rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/tests_down64.log | tail -3
variant_env() { case $1 in base) echo "";; d128) echo "JAXLLM_EXP_DOWN=128";; d64) echo "JAXLLM_EXP_DOWN=64";;
  nobal) echo "JAXLLM_EXP_BALANCE=0";; d128nobal) echo "JAXLLM_EXP_DOWN=128 JAXLLM_EXP_BALANCE=0";; d64nobal) echo "JAXLLM_EXP_DOWN=64 JAXLLM_EXP_BALANCE=0";; esac; }
P="timeout 50 python3 bench/step_profile.py --tokens 64"
for v in base d128 d64 nobal d128nobal d64nobal; do
  room 20 "profile $v" && { env $(variant_env $v) $P --out $R/profile_$v.json > $R/profile_$v.log 2>&1; stamp "profile $v rc=$?"; sed -n '/^role/,/^head/p' $R/profile_$v.log; grep "^span" $R/profile_$v.log; }
done
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi --loop pipelined"
for round in 1 2; do
  for v in base d128 d64 d128nobal d64nobal; do
    room 20 "$v $round" && { env $(variant_env $v) timeout 40 $B --label "$v, round $round" >> $R/bench.log 2>&1; stamp "$v rc=$?"; }
  done
done
python3 - $R/bench.jsonl <<'P'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l); print(f"{r['label']:24s} TPOT {r['tpot_ms_mean']:.3f} burst {r['step_ms_burst']:.3f} {r['env']['device']}")
P
stamp end
