#!/bin/bash
# CPU, a97fdac: --admit-group 1 against 4, alternating, 3 rounds; smollm2-135m, 16 slots, context 512, the default
# prefill chunk (512); per server: a burst of 16 streams x 2 requests of 32-token prompts, then of 128-token
# prompts, 16 new tokens each
cd /work/main
for rep in 1 2 3; do
for g in 1 4; do
  python -m jaxllm.serve smollm2-135m --port 8790 --max-batch 16 --max-context 512 --admit-group $g > /tmp/adm3/server_${g}_${rep}.log 2>&1 &
  S=$!
  until curl -sf localhost:8790/health > /dev/null; do sleep 1; done
  for plen in 32 128; do
    python -m jaxllm.serve.loadgen http://127.0.0.1:8790 -c 16 -n 32 --prompt-len $plen --max-tokens 16 --vocab 40000 --seed $rep --json /tmp/adm3/g${g}_p${plen}.jsonl > /tmp/adm3/load_${g}_${plen}_${rep}.log 2>&1
  done
  curl -s localhost:8790/metrics | grep -E '^jaxllm_(admit_calls_total|xla_compiles_while)' > /tmp/adm3/metrics_${g}_${rep}.txt
  kill $S; wait $S 2>/dev/null
  echo "round $rep group $g done"
done
done
