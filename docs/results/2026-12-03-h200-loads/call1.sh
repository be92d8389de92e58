#!/usr/bin/env bash
# Fourteenth session, call 1: the loads after each kernel's wait issued together (NormRows' 16-byte pieces, the
# down projection's second chunk of x asked into L1, the attention prologue's QKV row loads in flight at once),
# with and without the attention's first tile copied before its wait (JAXLLM_ATTN_PRELOAD), against main
# (5c3ea21: the same tree with call1.patch reversed, built beside it; the extension's .so swapped between rows).
# GPU tests on the new build, then alternating bench rows and a trace of each.
source bench/device_call.sh
D=docs/results/2026-12-03-h200-loads
SO=$(python3 -c "import jaxllm._ffi as f; print(f.__file__)")
cp $SO /tmp/new.so
patch -s -R -p1 < $D/call1.patch && timeout 300 python3 -m pip install --no-build-isolation --no-deps -e . \
  -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90-real > $R/build_main.log 2>&1 || { stamp "main build failed"; tail -20 $R/build_main.log; }
cp $SO /tmp/main.so; patch -s -p1 < $D/call1.patch; cp /tmp/new.so $SO
stamp "built main"
cmp -s /tmp/new.so /tmp/main.so && stamp "WARNING: the two builds are the same file"
use() { cp /tmp/$1.so $SO; }
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_fused.py \
  > $R/gpu_tests_fused.log 2>&1
stamp "fused tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_fused.log | tail -8
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi --loop pipelined"
row() { local so=$1 label=$2; shift 2; room 22 "$label" && { use $so; env "$@" timeout 40 $B --label "$label" >> $R/bench.log 2>&1; stamp "$label rc=$?"; }; }
round() { row new "together + preload, round $1" JAXLLM_ATTN_PRELOAD=1; row main "main, round $1" X=1; row new "together, round $1" JAXLLM_ATTN_PRELOAD=0; }
round 1; round 2
prof() { local so=$1 name=$2; shift 2; room 25 "profile $name" && { use $so; env "$@" timeout 40 python3 bench/step_profile.py --tokens 64 --out $R/profile_$name.json > $R/profile_$name.txt 2>&1; stamp "profile $name rc=$?"; sed -n "/^role/,\$p" $R/profile_$name.txt; }; }
prof new new X=1; prof main main X=1
round 3
use new
python3 - $R/bench.jsonl <<'P'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l); b = r['step_ms_burst']
  print(f"{r['label']:28s} TPOT {r['tpot_ms_mean']:.3f} burst {b if b is None else round(b, 3)} floor {r['byte_floor_ms']:.3f} "
        f"peak {r['peak_memory_bytes']/1e9:.2f} GB rss {r['peak_rss_bytes']/1e9:.2f} GB {r['env']['device']}")
P
stamp end
