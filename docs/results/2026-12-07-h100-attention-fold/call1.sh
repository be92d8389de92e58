#!/usr/bin/env bash
# One call: (1) release build: test_fused (vmap with the layers call mapped again: .carry/vmap_layers.patch applied
# uncommitted), test_kernels, test_embedding, test_lab, and the new test_launches (uncommitted); (2) lab build:
# the layers-call-vs-per-op bits test with JAXLLM_ATTN_REGCAP=1; the 7B step at batch 1, default / splits capped
# at 8 / attention registers capped, interleaved A B C C B A; then a step profile of each, as time allows.
set -u
[ -d .whl ] || { mkdir -p .whl && cp .carry/whl_c/*.whl .whl/; }
export DEADLINE=${DEADLINE:-585}
source bench/device_call.sh
echo "tree: the commit above + .carry/vmap_layers.patch + tests/test_launches.py (uncommitted)" >> $R/env.txt
XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_CLIENT_MEM_FRACTION=0.064 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
  JAXLLM_TEST_OFFLINE=1 timeout 170 python3 -m pytest -q -rfEs -n 14 --dist loadgroup -p no:cacheprovider \
  tests/test_fused.py tests/test_kernels.py tests/test_embedding.py tests/test_lab.py tests/test_launches.py \
  > $R/tests.log 2>&1; stamp "tests rc $?"
tail -25 $R/tests.log
timeout 200 python3 -m pip install --no-build-isolation --no-deps -e . -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90-real \
  -Ccmake.define.JAXLLM_LAB=ON > $R/build_lab.log 2>&1 || { stamp "lab build failed"; tail -30 $R/build_lab.log; exit 1; }
python3 -c "import jaxllm.lab as l; print('lab build:', l.lab_build())" | tee -a $R/env.txt
stamp "lab build"
JAXLLM_ATTN_REGCAP=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAXLLM_TEST_OFFLINE=1 timeout 90 python3 -m pytest -q -rfEs \
  -n 4 -p no:cacheprovider tests/test_fused.py -k "layers_call_equals" > $R/regcap_bits.log 2>&1
stamp "regcap bits rc $?"; tail -3 $R/regcap_bits.log
run() {  # label env...
  local label=$1; shift
  room 45 "$label" || return 1
  env "$@" timeout $(( $(left) )) python3 -m jaxllm.bench synthetic:qwen2.5-7b --loop pipelined --batch 1 \
    --kernels ffi --label "$label" --prompt-len 128 --decode-len 128 --repeat 3 \
    --out $R/splits.jsonl >> $R/splits.log 2>&1; stamp "$label rc $?"
}
A="JAXLLM_ATTN_MAX_SPLITS=256 JAXLLM_ATTN_REGCAP=0"; B="JAXLLM_ATTN_MAX_SPLITS=8 JAXLLM_ATTN_REGCAP=0"
C="JAXLLM_ATTN_MAX_SPLITS=256 JAXLLM_ATTN_REGCAP=1"
run "7b default r1" $A; run "7b splits8 r1" $B; run "7b regcap r1" $C
run "7b regcap r2" $C; run "7b splits8 r2" $B; run "7b default r2" $A
python3 - $R/splits.jsonl <<'PY'
import json, sys
for line in open(sys.argv[1]):
  r = json.loads(line)
  print(r.get("label"), r.get("kernels"), "tpot_ms_mean", r.get("tpot_ms_mean"), "step p50", r.get("tpot_step_ms_p50"),
        "burst", r.get("step_ms_burst"))
PY
prof() {  # name env...
  local name=$1; shift
  room 60 "profile $name" && env "$@" timeout $(( $(left) )) python3 bench/step_profile.py \
    --model synthetic:qwen2.5-7b --batch 1 --tokens 64 --prompt-len 192 --out $R/profile_$name.json \
    > $R/profile_$name.log 2>&1 && stamp "profile $name" && tail -12 $R/profile_$name.log
}
prof default $A; prof regcap $C; prof splits8 $B
cp $R/splits.jsonl $R/profile_*.json $R/tests.log $OUT/ 2>/dev/null
