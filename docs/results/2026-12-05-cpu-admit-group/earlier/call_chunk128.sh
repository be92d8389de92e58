#!/bin/bash
# CPU A/B of --admit-group: smollm2-135m, 16 slots, a burst of 16 streams of 32-token prompts
cd /work/main
for rep in 1 2; do
for g in 1 4; do
  python -m jaxllm.serve smollm2-135m --port 8790 --max-batch 16 --max-context 256 --prefill-chunk 128 --admit-group $g -q > /tmp/adm/server_$g.log 2>&1 &
  S=$!
  t0=$(date +%s)
  until curl -sf localhost:8790/health > /dev/null; do sleep 1; done
  echo "group $g ready in $(( $(date +%s) - t0 )) s"
  python -m jaxllm.serve.loadgen http://127.0.0.1:8790 -c 16 -n 32 --prompt-len 32 --max-tokens 16 --vocab 40000 --json /tmp/adm/g${g}_r${rep}.jsonl > /tmp/adm/load_${g}_${rep}.log 2>&1
  curl -s localhost:8790/metrics | grep -E '^jaxllm_admit_calls_total' >> /tmp/adm/load_${g}_${rep}.log
  kill $S; wait $S 2>/dev/null
done
done
