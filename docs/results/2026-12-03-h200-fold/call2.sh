#!/usr/bin/env bash
# Twelfth session, call 2: where the folded attention's time goes. The step timed with the fold, without it
# (JAXLLM_QKV_FOLD=0), with each kernel preferring the largest shared memory carveout (JAXLLM_CARVEOUT=100,
# so that a block needing much shared memory need not wait for its SM to be reconfigured), and with the fold's
# attention stopped at points (JAXLLM_ATTN_STOP=wait|norm|fold|prologue: timing only).
DEADLINE=${DEADLINE:-540}
source bench/device_call.sh
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi --loop pipelined"
row() { local label=$1; shift; room 22 "$label" && { env "$@" timeout 40 $B --label "$label" >> $R/bench.log 2>&1; stamp "$label rc=$?"; }; }
for round in 1 2; do
  row "fold, round $round" JAXLLM_QKV_FOLD=1
  row "fold0, round $round" JAXLLM_QKV_FOLD=0
  row "fold carveout100, round $round" JAXLLM_QKV_FOLD=1 JAXLLM_CARVEOUT=100
  row "fold0 carveout100, round $round" JAXLLM_QKV_FOLD=0 JAXLLM_CARVEOUT=100
done
for stop in wait norm fold prologue tiles; do row "fold stop=$stop" JAXLLM_QKV_FOLD=1 JAXLLM_ATTN_STOP=$stop; done
for stop in wait prologue tiles; do row "fold0 stop=$stop" JAXLLM_QKV_FOLD=0 JAXLLM_ATTN_STOP=$stop; done
P="timeout 50 python3 bench/step_profile.py --tokens 64"
room 20 "profile carveout" && { JAXLLM_CARVEOUT=100 $P --out $R/profile_carveout.json > $R/profile_carveout.log 2>&1; stamp "profile rc=$?"; sed -n '/^role/,/^0 /p' $R/profile_carveout.log; grep "^span" $R/profile_carveout.log; }
python3 - $R/bench.jsonl <<'P'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l); print(f"{r['label']:32s} TPOT {r['tpot_ms_mean']:.3f} burst {r['step_ms_burst']:.3f} floor {r['byte_floor_ms']:.3f} "
                         f"peak {r['peak_memory_bytes']/1e9:.2f} GB rss {r['peak_rss_bytes']/1e9:.2f} GB {r['env']['device']}")
P
stamp end
