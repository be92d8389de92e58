#!/usr/bin/env bash
# On a lent GPU (a device call from the repository root, carrying .whl/ and .carry/commit): do the batched step's
# tensor-core matmuls lose time to the address translations of the step's working set? At 7B and 16 rows gate/up
# repeated over every layer's weights took 31% more time than over two layers' (down 13%; H100, 2026-12-06,
# docs/results/2026-12-06-h100-matmul-study.md). Most telling first, each started only while it fits before
# DEADLINE (default 565 s):
#   1. bench/matmul_chain.cu (built here, about 20 s): each shape alone over every layer's weights, with the next
#      layer's pages touched first (one word per 64 KB) against a far layer's (the control; both include the
#      touch kernel's own time); and each shape over 1, 2, 4, 8 and every layer's weights, the matmul beside the
#      read-only kernel (a share kept in L2 falls smoothly with the working set; missed translations would step);
#   2. only where the chain's touch paid (7B gate/up at 16 rows 3% faster): the engine's step with the lab switch JAXLLM_MMA_TOUCH (the same touch after each tensor-core matmul) off,
#      `1` (the next layer) and `far` (the control), interleaved, two rounds: 7B at batch 16; then once at 7B
#      batch 64 (a lab build).
# Records under $OUT/g.tgz: chain.jsonl, bench.jsonl and the logs; the summary is printed.
set -u
export LAB=1
export DEADLINE=${DEADLINE:-565}
source bench/device_call.sh
nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I ffi -I bench -I "$(python3 -c 'import jax; print(jax.ffi.include_dir())')" \
  bench/matmul_chain.cu -o /tmp/matmul_chain > $R/build_chain.log 2>&1
stamp "built matmul_chain rc $?"
room 60 "chain" && { timeout 150 /tmp/matmul_chain $R/chain.jsonl 7b,0.5b 16,64,1 > $R/chain.log 2>&1; stamp "chain rc $?"; }
grep -E "touched|alone:|rotated" $R/chain.log
# The engine's runs only where the chain's touch paid: 7B gate/up at 16 rows at least 3% faster with the next
# layer's pages touched than with a far layer's.
python3 - $R/chain.jsonl <<'PY' || { stamp "the touch did not pay in the chain: no engine runs"; exit 0; }
import json, sys
r = [json.loads(l) for l in open(sys.argv[1])]
t = [x for x in r if x["what"] == "alone, touched" and x["model"] == "7b" and x["m"] == 16 and x["n"] == 37888]
print("7b gate/up 16 rows: next touched", t[0]["us_next_touched"], "far touched", t[0]["us_far_touched"])
sys.exit(0 if t[0]["us_next_touched"] < 0.97 * t[0]["us_far_touched"] else 1)
PY
export JAXLLM_TEST_OFFLINE=1
B="python3 -m jaxllm.bench --loop pipelined --repeat 3 --prompt-len 128 --decode-len 128 --out $R/bench.jsonl"
for r in 1 2; do
  for v in 0 1 far; do
    room 95 "7b b16 touch=$v r$r" && { JAXLLM_MMA_TOUCH=$v timeout 90 $B synthetic:qwen2.5-7b --batch 16 \
      --label "7b b16 touch=$v r$r" >> $R/bench.log 2>&1; stamp "7b b16 touch=$v r$r rc $?"; }
  done
done
for v in 0 1 far; do
  room 95 "7b b64 touch=$v" && { JAXLLM_MMA_TOUCH=$v timeout 90 $B synthetic:qwen2.5-7b --batch 64 \
    --label "7b b64 touch=$v" >> $R/bench.log 2>&1; stamp "7b b64 touch=$v rc $?"; }
done
python3 - $R/bench.jsonl <<'PY'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l)
  print(r.get("label"), "TPOT ms", round(r["tpot_ms_mean"], 4), "step p50", round(r["tpot_step_ms_p50"], 4),
        "floor ms", round(r.get("byte_floor_ms") or 0, 4), r["env"]["device"], "lab", r["env"].get("lab_build"))
PY
