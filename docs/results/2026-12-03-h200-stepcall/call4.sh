#!/usr/bin/env bash
# Sixteenth session, call 4 (the last of the session's device time): the sampled step (temperature 0.7, top-p 0.9)
# against the greedy one on the committed tree, alternating, one process a row.
DEADLINE=${DEADLINE:-150}
source bench/device_call.sh
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi --loop pipelined"
run() { local secs=$1 what=$2; shift 2; room $secs "$what" && { timeout $secs "$@" >> $R/bench.log 2>&1; stamp "$what rc=$?"; }; }
for i in 1 2; do
  run 24 "greedy $i" $B --label "greedy, round $i"
  run 24 "sampled $i" $B --temperature 0.7 --top-p 0.9 --seed 1 --label "sampled, round $i"
done
python3 - $R/bench.jsonl <<'P'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l)
  print(f"{r['label']:18s} TPOT {r['tpot_ms_mean']:.3f} floor {r['byte_floor_ms']:.3f} peak {r['peak_memory_bytes']/1e9:.2f} GB "
        f"rss {r['peak_rss_bytes']/1e9:.2f} GB")
P
stamp end
