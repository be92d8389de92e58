#!/usr/bin/env bash
# Issue 36, call 2 (the last 300 s of device time): the batched step's fused attention block (c8ff37a) on the GPU.
# Graphs on and off at batch 16 (tests/test_graphs.py::test_parity_batched_gpu), then auto against ffi-unfused
# through the bench, interleaved, 0.5B and 7B at batch 16, each process only while it fits before DEADLINE.
export DEADLINE=${DEADLINE:-230}
source bench/device_call.sh
export JAXLLM_TEST_OFFLINE=1
XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 60 python3 -m pytest -q -p no:cacheprovider \
  tests/test_graphs.py::test_parity_batched_gpu -rfEs > $R/tests.log 2>&1
stamp "tests rc $? $(tail -1 $R/tests.log)"
B="python3 -m jaxllm.bench --loop pipelined --repeat 3 --prompt-len 128 --decode-len 128 --out $R/ab.jsonl"
for model in qwen2.5-0.5b qwen2.5-7b; do
  for k in auto ffi-unfused; do
    room 45 "$model $k" && { timeout 60 $B synthetic:$model --batch 16 --kernels $k --label "$k" >> $R/ab.log 2>&1; stamp "$model $k rc $?"; }
  done
done
python3 - $R/ab.jsonl <<'PY'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l)
  print(r["model"], r["batch"], r.get("label"), r.get("kernels"), "TPOT ms", round(r["tpot_ms_mean"], 4), "step p50", round(r["tpot_step_ms_p50"], 4), r["env"]["device"])
PY
tail -2 $R/tests.log
