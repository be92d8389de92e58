#!/usr/bin/env bash
# Fourteenth session, call 2: call 1's changes in steps, each its own build (the extension's .so swapped between
# rows), because call 1's pipelined TPOT (the 8-token program) read 0.483-0.487 ms against main's 0.463-0.466
# while its trace and the one-token burst step read the new code faster. Call 1's trace put down 0.5 us a layer
# slower with its change, which this tree leaves out:
#   main            5c3ea21 (this tree with call2-nodown.patch reversed)
#   norm+prologue   call2-norm-prologue.patch: NormRows' loads together, the attention prologue's QKV row loads together
#   +preload        this tree (call2-nodown.patch): and the attention's first tile copied before its wait
# Then the fused GPU tests on the fastest, if it beats main.
DEADLINE=${DEADLINE:-400}
source bench/device_call.sh
D=docs/results/2026-12-03-h200-loads
SO=$(python3 -c "import jaxllm._ffi as f; print(f.__file__)")
cp $SO /tmp/preload.so
build() { timeout 200 python3 -m pip install --no-build-isolation --no-deps -e . -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90-real \
  > $R/build_$1.log 2>&1 && cp $SO /tmp/$1.so || stamp "$1 build failed"; }
patch -s -R -p1 < $D/call2-nodown.patch
build main
patch -s -p1 < $D/call2-norm-prologue.patch && build prologue; patch -s -R -p1 < $D/call2-norm-prologue.patch
patch -s -p1 < $D/call2-nodown.patch
stamp "built the variants"; md5sum /tmp/*.so > $R/so.md5
use() { cp /tmp/$1.so $SO; }
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi --loop pipelined"
row() { local so=$1; room 22 "$so round $2" && { use $so; timeout 40 $B --label "$so, round $2" >> $R/bench.log 2>&1; stamp "$so round $2 rc=$?"; }; }
round() { row main $1; row prologue $1; row preload $1; }
round 1; round 2
best=$(python3 - $R/bench.jsonl <<'P'
import json, sys, collections
t = collections.defaultdict(list)
for l in open(sys.argv[1]):
  r = json.loads(l); t[r['label'].split(',')[0]].append(r['tpot_ms_mean'])
m = {k: sum(v) / len(v) for k, v in t.items()}
b = min((k for k in m if k != 'main'), key=m.get, default='main')
print(b if 'main' in m and m[b] < m['main'] - 0.004 else 'none')
P
)
stamp "fastest beside main: $best"
if [ "$best" != none ]; then use $best; room 150 "fused tests" && { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_fused.py \
  -k "layers_call or merged or vocabulary or norm_linear or residual or argmax" > $R/gpu_tests_fused.log 2>&1
stamp "fused tests ($best) rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_fused.log | tail -8; }; fi
round 3
use preload
python3 - $R/bench.jsonl <<'P'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l); b = r['step_ms_burst']
  print(f"{r['label']:20s} TPOT {r['tpot_ms_mean']:.3f} p90 {r['tpot_ms_p90']:.3f} burst {b if b is None else round(b, 3)} floor {r['byte_floor_ms']:.3f} "
        f"peak {r['peak_memory_bytes']/1e9:.2f} GB rss {r['peak_rss_bytes']/1e9:.2f} GB {r['env']['device']}")
P
stamp end
