#!/usr/bin/env bash
# Call 1: (1) issue 36's acceptance shapes beside llama.cpp (bench/scaling.py: 0.5B, 1B, 7B at batch 1, 16, 64;
# auto and ffi-unfused; llama-bench / llama-batched-bench on Q8_0 GGUFs); (2) docs/results/2026-12-07-h100-vmap-alias/vmap_study.py on this
# release build; (3) tests/test_fused.py and tests/test_lab.py, as time allows.
set -u
ROOT=$PWD
[ -d .whl ] || { mkdir -p .whl && cp .carry/whl_c/*.whl .whl/; }
[ -s .carry/vocab.gguf ] || xz -dc .carry/vocab.gguf.xz > .carry/vocab.gguf
export DEADLINE=${DEADLINE:-575}
source bench/device_call.sh
use_llamacpp $ROOT/.carry/llamacpp-cuda-sm90.tar.xz || exit 1
B=/tmp/llamacpp-bin
timeout $(( $(left) - 200 )) python3 bench/scaling.py --dir $R/scaling --presets ${PRESETS:-qwen2.5-7b,qwen2.5-0.5b,llama-3.2-1b} \
  --batches 1,16,64 --kernels auto,ffi-unfused --llama-bench $B/llama-bench --llama-batched-bench $B/llama-batched-bench \
  --vocab $ROOT/.carry/vocab.gguf --peer-types ${PEERS:-Q8_0} --gguf-dir /tmp/gguf \
  --time-limit $(( $(left) - 215 )) --check > $R/scaling.log 2>&1; stamp "scaling rc $?"
cp $R/scaling/*.jsonl $R/scaling.md $R/scaling/*.png $OUT/ 2>/dev/null
rm -rf /tmp/gguf
mkdir -p $R/study
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout $(( $(left) - 60 )) python3 docs/results/2026-12-07-h100-vmap-alias/vmap_study.py all $R/study \
  > $R/study.jsonl 2> $R/study.err; stamp "study rc $?"
for d in $R/study/dump_*; do [ -d $d ] && tar czf $d.tgz -C $R/study $(basename $d) && rm -rf $d; done
cp $R/study.jsonl $OUT/
if room 60 "tests"; then
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout $(( $(left) )) python3 -m pytest -q -rfEs -n 8 -p no:cacheprovider \
    tests/test_fused.py tests/test_lab.py > $R/tests.log 2>&1; stamp "tests rc $?"
  tail -15 $R/tests.log
fi
cat $R/scaling.md 2>/dev/null | head -40
cut -c1-260 $R/study.jsonl
