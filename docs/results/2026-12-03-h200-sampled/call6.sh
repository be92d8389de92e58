#!/usr/bin/env bash
# Twelfth session, call 6 (the last of the session's device time): the sampled step (temperature 0.7, top-p
# 0.9) against the greedy one on main 7a5d73b, alternating, one process a row: issue 14's "at most 1.1x"
# re-checked since the greedy step got faster. Records written straight to $OUT (the call may be cut short).
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/stamps.txt; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/env.txt
export CUDACXX=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
timeout 300 python3 -m pip install --no-build-isolation --no-deps -e . -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90-real \
  > $OUT/build.log 2>&1 || { stamp "build failed"; tail -30 $OUT/build.log; exit 1; }
stamp built
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $OUT/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3 --kernels ffi --loop pipelined"
for round in 1 2 3; do
  timeout 40 $B --label "greedy, round $round" >> $OUT/bench.log 2>&1; stamp "greedy $round rc=$?"
  timeout 40 $B --temperature 0.7 --top-p 0.9 --seed 1 --label "sampled t0.7 p0.9, round $round" >> $OUT/bench.log 2>&1; stamp "sampled $round rc=$?"
  python3 - $OUT/bench.jsonl <<'P'
import json, sys
for l in list(open(sys.argv[1]))[-2:]:
  r = json.loads(l); print(f"{r['label']:32s} TPOT {r['tpot_ms_mean']:.3f} burst {r['step_ms_burst']:.3f} floor {r['byte_floor_ms']:.3f} "
                         f"peak {r['peak_memory_bytes']/1e9:.2f} GB rss {r['peak_rss_bytes']/1e9:.2f} GB {r['env']['device']}")
P
done
stamp end
