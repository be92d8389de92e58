#!/usr/bin/env bash
# On the H200 (a device call from the repository root; carry as bench/device/prep.sh says): issue 36's open
# measurements, most telling first, each started only while it fits before DEADLINE (default 570 s):
#   1. where the 7B step's time goes outside the matmuls: bench/step_profile.py at batch 1 and 16;
#   2. the W8A16 configuration sweep (bench/gemv_sweep.cu, with the tensor-core candidates
#      bench/w8a16_mma_staged.cuh and bench/w8a16_wgmma.cuh) on the 7B shapes and the tensor-core edges;
#   3. the 1B and 1.5B shapes at batch 1 (issue 36's 0.42 ms target; the 1B-3B down rule), the 7B at 16 and 64;
#   4. 7B prefill (TTFT at 2k and 8k) beside llama-bench -p 2048,8192 (bench/scaling.py --prefill).
# Writes under $OUT: profile.json, gemv_sweep_mma.jsonl, gemv_sweep_m1.jsonl, bench.jsonl, prefill/ (scaling.py's); logs in $OUT/g.tgz.
set -u
ROOT=$PWD
# The machine's copy of the working tree is what runs; prep.sh's .whl/ and .carry/vocab.gguf.xz travel beside it.
[ -d .whl ] && [ -s .carry/vocab.gguf.xz ] ||
  { echo "perf.sh: no .whl/ or .carry/vocab.gguf.xz (bench/device/prep.sh)"; exit 2; }
[ -s .carry/vocab.gguf ] || xz -dc .carry/vocab.gguf.xz > .carry/vocab.gguf
export DEADLINE=${DEADLINE:-570}
source bench/device_call.sh
if room 120 "step profile"; then
  timeout 150 python3 bench/step_profile.py --model synthetic:qwen2.5-7b --batch 1,16 --out $OUT/profile.json \
    > $R/profile.log 2>&1; stamp "step_profile rc $?"
fi
if room 290 "gemv sweep"; then
  bash bench/build_gemv_sweep.sh 90 /tmp/gemv_sweep > $R/gemv_build.log 2>&1
  stamp "gemv_sweep built rc $?"
  # Tensor cores at 7B (full and part-filled row tiles), then batch 1 on the 1B-3B down projections.
  GEMV_MS=16,32,64,13,50 timeout 180 /tmp/gemv_sweep $OUT/gemv_sweep_mma.jsonl odd_n,qkv_7b,o_7b,gate_up_7b,down_7b,lm_head_7b \
    > $R/gemv_sweep_mma.log 2>&1; stamp "gemv_sweep (tensor cores) rc $?"
  GEMV_MS=1 timeout 60 /tmp/gemv_sweep $OUT/gemv_sweep_m1.jsonl down_1b,down_1.5b,down_3b \
    > $R/gemv_sweep_m1.log 2>&1; stamp "gemv_sweep (batch 1) rc $?"
fi
B="python3 -m jaxllm.bench --loop pipelined --repeat 3 --prompt-len 128 --decode-len 128 --out $OUT/bench.jsonl"
for preset in llama-3.2-1b qwen2.5-1.5b; do
  room 60 "$preset batch 1" && { timeout 90 $B synthetic:$preset --label $preset-b1 >> $R/bench.log 2>&1; stamp "$preset rc $?"; }
done
# The batched 7B step since the engine runs 8 steps a device call at batch > 1 (a while loop; was one step).
for b in 16 64; do
  room 100 "7B batch $b" && { timeout 150 $B synthetic:qwen2.5-7b --batch $b --label qwen2.5-7b-b$b >> $R/bench.log 2>&1
                              stamp "7B batch $b rc $?"; }
done
if room 150 "7B prefill" && use_llamacpp $ROOT/.carry/llamacpp-cuda-sm90.tar.xz; then
  timeout $(left) python3 bench/scaling.py --dir $R/prefill --presets qwen2.5-7b --batches 1 --kernels auto \
    --prefill 2048,8192 --llama-bench /tmp/llamacpp-bin/llama-bench --vocab $ROOT/.carry/vocab.gguf --peer-types Q8_0,Q4_0 \
    --gguf-dir /tmp/gguf --time-limit $(( $(left) - 10 )) > $R/prefill.log 2>&1; stamp "prefill rc $?"
  cp $R/prefill/*.jsonl $R/prefill.md $OUT/ 2>/dev/null
fi
python3 - $OUT/bench.jsonl <<'PY' 2>/dev/null
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l)
  print(r.get("label"), "TPOT ms", r.get("tpot_token_ms_p50"), "step", r.get("tpot_step_ms_p50"), "total tok/s",
        r.get("decode_tok_s_total"), "floor ms", r.get("byte_floor_ms"), "peak bytes", r.get("peak_memory_bytes"))
PY
