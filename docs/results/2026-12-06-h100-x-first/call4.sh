#!/usr/bin/env bash
# Issue 36: the remaining x-first rules (q/k/v and gate/up at 1B-14B, the 0.5B short-K rule) with
# JAXLLM_X_FIRST=1 (x staged first, the rule now) against =0 (weights first), interleaved; 7B, 1B, 0.5B at batch 1.
# Then the 7B prefill TTFT at 2k and 8k after f0a7011 (scaling.py's arguments), and 7B --quant gguf decode.
export LAB=1
export DEADLINE=${DEADLINE:-330}
source bench/device_call.sh
B="python3 -m jaxllm.bench --loop pipelined --repeat 3 --prompt-len 128 --decode-len 128 --out $OUT/bench.jsonl"
for m in qwen2.5-7b llama-3.2-1b qwen2.5-0.5b; do
  for r in 1 2; do
    for v in 1 0; do
      room 18 "$m x_first=$v r$r" && { JAXLLM_X_FIRST=$v timeout 60 $B synthetic:$m --label "$m x_first=$v r$r" >> $R/bench.log 2>&1; stamp "$m x_first=$v r$r rc $?"; }
    done
  done
done
P="python3 -m jaxllm.bench synthetic:qwen2.5-7b --loop pipelined --batch 1 --kernels auto --decode-len 18 --repeat 3 --out $OUT/prefill.jsonl"
for p in 2048 8192; do
  room 30 "prefill $p" && { timeout 60 $P --prompt-len $p --label "prefill qwen2.5-7b p$p" >> $R/prefill.log 2>&1; stamp "prefill $p rc $?"; }
done
python3 - $OUT/bench.jsonl $OUT/prefill.jsonl <<'PY'
import json, sys
for f in sys.argv[1:]:
  for l in open(f):
    r = json.loads(l)
    print(r.get("label"), "TPOT", round(r["tpot_ms_mean"], 4), "TTFT", round(r["ttft_ms"], 2), "floor", round(r.get("byte_floor_ms") or 0, 4), "peak GB", round(r.get("peak_memory_bytes", 0) / 1e9, 3), r["env"]["device"])
PY
