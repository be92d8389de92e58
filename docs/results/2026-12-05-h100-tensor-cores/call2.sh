#!/usr/bin/env bash
# call 2: jax settings introspection, the fixed test, the tensor-core sweep at 7B (mma vs staged)
set -u
R=$OUT; mkdir -p $R
python3 - > $R/jaxcfg.txt 2>&1 <<'PY'
import jax
from jax._src import config as c
print(jax.__version__)
for n in sorted(dir(c)):
  v = getattr(c, n)
  if type(v).__name__ in ("State", "Flag") and any(s in n for s in ("effort", "level", "pgle", "remat", "optim", "fitting")):
    print(n, type(v).__name__, repr(getattr(v, "value", None)))
PY
cat $R/jaxcfg.txt
cb=$(python3 -c "import nvidia.cublas as c, os; print(os.path.dirname(c.__file__))" 2>/dev/null || true)
src="-O3 -std=c++17 -arch=sm_90 -I ffi -I bench -I $(python3 -c "import jax; print(jax.ffi.include_dir())") bench/gemv_sweep.cu -o /tmp/gemv_sweep"
( nvcc $src -DWITH_CUBLAS -I"$cb/include" -L"$cb/lib" -l:libcublas.so.13 -Xlinker -rpath="$cb/lib" > $R/gemv_build.log 2>&1 || nvcc $src >> $R/gemv_build.log 2>&1; echo built $? >> $R/gemv_build.log ) &
bp=$!
ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
t0=$(date +%s); pip install -q --no-build-isolation --no-deps -e . > $R/build.log 2>&1; echo "build rc $? $(( $(date +%s)-t0 )) s"
wait $bp; tail -2 $R/gemv_build.log
JAXLLM_TEST_OFFLINE=1 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py -k "callers_thread or compile" > $R/test.log 2>&1; echo "tests rc $?"; tail -3 $R/test.log
GEMV_MS=16,64,32 timeout 200 /tmp/gemv_sweep $R/sweep_mma.jsonl gate_up_7b,down_7b,qkv_7b,o_7b > $R/sweep_mma.log 2>&1; echo "sweep rc $?"
GEMV_MS=13,50 timeout 40 /tmp/gemv_sweep $R/sweep_odd.jsonl odd_n > $R/sweep_odd.log 2>&1; echo "odd rc $?"
grep -c WRONG $R/sweep_*.log
