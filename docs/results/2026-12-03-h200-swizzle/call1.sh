#!/usr/bin/env bash
# Fifteenth session, call 1: one build, the variants picked by environment variables in separate processes:
#   JAXLLM_ATTN_SWIZZLE=0|1   the attention's key tile copy in shared memory swizzled (1) or not (0, main's layout)
#   JAXLLM_EXP_DOWN=0..6      the down projection's configuration (0: main's; the rest, see w8a16::Dispatch)
#   JAXLLM_EXP_GU=0|1         gate/up compiled for 4 blocks an SM (64 registers, 96 bytes spilled) instead of 80
# Then the layers-call and merged-attention GPU tests (the swizzle on), a second round, and traces.
source bench/device_call.sh
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi --loop pipelined"
row() { local label=$1; shift; room 24 "$label" && { env "$@" timeout 40 $B --label "$label" >> $R/bench.log 2>&1; stamp "$label rc=$?"; }; }
round() {
  row "main layout, round $1" JAXLLM_ATTN_SWIZZLE=0 JAXLLM_EXP_DOWN=0
  row "swizzle, round $1" JAXLLM_ATTN_SWIZZLE=1 JAXLLM_EXP_DOWN=0
  for d in 1 2 3 4 6; do row "swizzle + down$d, round $1" JAXLLM_EXP_DOWN=$d; done
  row "swizzle + gu1, round $1" JAXLLM_EXP_GU=1
  row "swizzle + gu1 + down1, round $1" JAXLLM_EXP_GU=1 JAXLLM_EXP_DOWN=1
}
round 1
room 150 "fused tests" && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 140 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_fused.py \
  -k "layers_call or merged or (norm_linear and (2048 or 4608))" > $R/gpu_tests_fused.log 2>&1; stamp "fused tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_fused.log | tail -8; }
for d in 1 2; do room 40 "residual test down$d" && { JAXLLM_EXP_DOWN=$d XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 40 python3 -m pytest -q -rfE \
  -p no:cacheprovider tests/test_fused.py -k "linear_residual and 4864" > $R/gpu_tests_down$d.log 2>&1; stamp "residual test down$d rc=$?"; }; done
round 2
prof() { local name=$1; shift; room 25 "profile $name" && { env "$@" timeout 40 python3 bench/step_profile.py --tokens 64 --out $R/profile_$name.json > $R/profile_$name.txt 2>&1; stamp "profile $name rc=$?"; sed -n "/^role/,\$p" $R/profile_$name.txt; }; }
prof swizzle X=1; prof main JAXLLM_ATTN_SWIZZLE=0
python3 - $R/bench.jsonl <<'P'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l); b = r['step_ms_burst']
  print(f"{r['label']:28s} TPOT {r['tpot_ms_mean']:.3f} burst {b if b is None else round(b, 3)} floor {r['byte_floor_ms']:.3f} "
        f"peak {r['peak_memory_bytes']/1e9:.2f} GB rss {r['peak_rss_bytes']/1e9:.2f} GB {r['env']['device']}")
P
stamp end
