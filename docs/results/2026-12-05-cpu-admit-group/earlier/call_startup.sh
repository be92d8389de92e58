#!/bin/bash
# CPU: --admit-group 1, 4, 8 at the default prefill chunk (512): start-up without the compile cache, then a burst
cd /work/main
for g in 1 4 8; do
  python -m jaxllm.serve smollm2-135m --port 8790 --max-batch 16 --max-context 512 --admit-group $g --no-compile-cache > /tmp/adm/server2_$g.log 2>&1 &
  S=$!
  t0=$(date +%s)
  until curl -sf localhost:8790/health > /dev/null; do sleep 1; done
  echo "group $g ready in $(( $(date +%s) - t0 )) s (no compile cache)"
  for plen in 32 128; do
    python -m jaxllm.serve.loadgen http://127.0.0.1:8790 -c 16 -n 32 --prompt-len $plen --max-tokens 16 --vocab 40000 --json /tmp/adm/b_g${g}_p${plen}.jsonl > /tmp/adm/load2_${g}_${plen}.log 2>&1
  done
  curl -s localhost:8790/metrics | grep -E '^jaxllm_(admit_calls_total|xla_compiles)' >> /tmp/adm/load2_${g}_128.log
  kill $S; wait $S 2>/dev/null
done
