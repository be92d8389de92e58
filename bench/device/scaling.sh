#!/usr/bin/env bash
# On the lent GPU machine (a device call from the repository root): issue 36's acceptance rows, jaxllm beside
# llama.cpp in one call. bench/scaling.py over PRESETS (default the 7B, 0.5B and 1B shapes) at batch 1, 16 and
# 64, auto and ffi-unfused, llama-bench (batch 1) and llama-batched-bench (every batch) on GGUFs of PEERS blocks
# (default Q8_0), with --check (auto within 3% of the best other path). A run already in $SCALING/scaling.jsonl is
# skipped: put a cut-short call's folder back in the tree as SCALING to go on where it stopped. BATCHES (default
# 1,16,64) and PRESETS narrow it to what a short call has room for.
#
# Carry [".whl", ".carry/llamacpp-cuda-sm90.tar.xz", ".carry/vocab.gguf.xz", ".carry/commit"]
# (bench/device/prep.sh --llama makes them). With all of prep.sh's wheels the tree can pass the call's 64 MiB:
# this study needs gguf's alone (gguf, pyyaml, tqdm, requests and its four), so keep the others out of .whl/.
# Writes under $OUT: scaling.jsonl, scaling.md, scaling.png; logs in $OUT/g.tgz.
set -u
ROOT=$PWD
[ -d .whl ] && [ -s .carry/vocab.gguf.xz ] && [ -s .carry/llamacpp-cuda-sm90.tar.xz ] || {
  echo "scaling.sh: no .whl/, .carry/vocab.gguf.xz or .carry/llamacpp-cuda-sm90.tar.xz (bench/device/prep.sh --llama)"
  exit 2; }
[ -s .carry/vocab.gguf ] || xz -dc .carry/vocab.gguf.xz > .carry/vocab.gguf
export DEADLINE=${DEADLINE:-570}
source bench/device_call.sh
use_llamacpp $ROOT/.carry/llamacpp-cuda-sm90.tar.xz || exit 1
B=/tmp/llamacpp-bin
D=${SCALING:-$R/scaling}
D=${D%/}                                  # scaling.py writes its report beside the folder: $D.md
room 60 "the study (the build took the time)" || exit 1
timeout $(left) python3 bench/scaling.py --dir $D --presets ${PRESETS:-qwen2.5-7b,qwen2.5-0.5b,llama-3.2-1b} \
  --batches ${BATCHES:-1,16,64} --kernels auto,ffi-unfused --llama-bench $B/llama-bench \
  --llama-batched-bench $B/llama-batched-bench --vocab $ROOT/.carry/vocab.gguf --peer-types ${PEERS:-Q8_0} \
  --gguf-dir /tmp/gguf --time-limit $(( $(left) - 10 )) --check > $R/scaling.log 2>&1; stamp "scaling rc $?"
cp $D/scaling.jsonl $D/scaling.png $OUT/ 2>/dev/null
cp $D.md $OUT/scaling.md 2>/dev/null || stamp "no report at $D.md"
rm -rf /tmp/gguf
cat $D.md 2>/dev/null | head -40
