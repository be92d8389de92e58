#!/usr/bin/env bash
# Tensor-core W8A16: build this tree and fd067c4 (before it), kernel tests, the sweep at M = 8-64, batch benches old vs new.
set -u
ROOT=$PWD; T=$ROOT/.carry/tree; O=$ROOT/.carry/old; R=$OUT/c
mkdir -p $R
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site $T/.whl/*.whl
export PYTHONPATH=/tmp/site
export CUDACXX=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/env.txt
t0=$(date +%s)
(cd $O && python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/old_site . \
   -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90-real > $R/old_build.log 2>&1; echo "old build rc $?" >> $R/old_build.log) &
(cd $T && nvcc -O3 -std=c++17 -arch=sm_90 -I ffi -I $(python3 -c "import jax; print(jax.ffi.include_dir())") \
   bench/gemv_sweep.cu -o /tmp/gemv_sweep > $R/sweep_build.log 2>&1; echo "sweep build rc $?" >> $R/sweep_build.log) &
(cd $T && python3 -m pip install --no-build-isolation --no-deps -e . -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90-real \
   > $R/build.log 2>&1) || { tail -30 $R/build.log; exit 1; }
wait
echo "builds: $(( $(date +%s) - t0 )) s; $(tail -1 $R/old_build.log); $(tail -1 $R/sweep_build.log)"
cd $T
t0=$(date +%s)
XLA_PYTHON_CLIENT_PREALLOCATE=false OMP_NUM_THREADS=1 timeout 150 python3 -m pytest -q -n 16 -p no:cacheprovider \
  --durations=5 tests/test_kernels.py -k w8a16 > $R/tests.log 2>&1
echo "tests rc $? in $(( $(date +%s) - t0 )) s"; tail -2 $R/tests.log; grep -E "^(FAILED|ERROR)|assert" $R/tests.log | head -12
GEMV_MS=8,16,32,64 timeout 100 /tmp/gemv_sweep $R/sweep.jsonl \
  qkv,o,gate_up,down,lm_head,qkv_7b,o_7b,gate_up_7b,down_7b,lm_head_7b > $R/sweep.log 2>&1; echo "sweep rc $?"
python3 - $R/sweep.jsonl <<'PY'
import json, sys, collections
rows = [json.loads(l) for l in open(sys.argv[1])]
best = {}
for r in rows:
  key = (r["shape"], r["m"])
  if r["config"] == "cublas_bf16": best.setdefault(key, {})["cublas"] = r["us"]; continue
  if not r["config"].startswith("mma"): continue
  if r.get("err", 0) and r["err"] == r["err"] and r["err"] > 1e-2: print("BAD", r); continue
  b = best.setdefault(key, {})
  if "us" not in b or r["us"] < b["us"]: b.update(us=r["us"], cfg=r["config"], gbps=r["gbps"])
for (s, m), b in best.items(): print(f"{s:11s} M={m:2d} {b.get('cfg','-'):22s} {b.get('us',0):8.2f} us {b.get('gbps',0):6.0f} GB/s  cublas {b.get('cublas',0):8.2f}")
PY
B="python3 -m jaxllm.bench --loop pipelined --repeat 2 --prompt-len 64 --decode-len 64"
old() { (cd /tmp && PYTHONPATH=/tmp/old_site:/tmp/site JAXLLM_GIT_COMMIT=fd067c4 timeout $1 $B ${@:2} --label old-fd067c4 --out $R/batch.jsonl 2>> $R/batch.log); echo "old $* rc $?"; }
new() { JAXLLM_GIT_COMMIT=$(cat $ROOT/.carry/commit) timeout $1 $B ${@:2} --label new --out $R/batch.jsonl 2>> $R/batch.log; echo "new $* rc $?"; }
new 100 synthetic:qwen2.5-7b --batch 16
old 100 synthetic:qwen2.5-7b --batch 16
new 100 synthetic:qwen2.5-7b --batch 64
new 60 synthetic:qwen2.5-0.5b --batch 16
old 60 synthetic:qwen2.5-0.5b --batch 16
new 60 synthetic:qwen2.5-0.5b --batch 64
old 60 synthetic:qwen2.5-0.5b --batch 64
python3 - $R/batch.jsonl <<'PY'
import json, sys
for l in open(sys.argv[1]):
  r = json.loads(l)
  print(r.get("label"), r.get("model"), "batch", r.get("batch"), r.get("kernels"), "step ms", r.get("tpot_step_ms_p50"),
        "token ms", r.get("tpot_token_ms_p50"), "total tok/s", round(r.get("decode_tok_s_total") or 0),
        "peak GB", round((r.get("peak_memory_bytes") or 0) / 1e9, 2), "GB/s", round(r.get("weight_gb_s") or 0))
PY
