#!/usr/bin/env bash
# call 3: the wgmma candidate in the sweep (sm_90a) beside mma / staged / cuBLAS at 7B shapes
set -u
R=$OUT
nvidia-smi --query-gpu=name --format=csv,noheader
cb=$(python3 -c "import nvidia.cublas as c, os; print(os.path.dirname(c.__file__))" 2>/dev/null || true)
src="-O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I ffi -I bench -I $(python3 -c "import jax; print(jax.ffi.include_dir())") bench/gemv_sweep.cu -o /tmp/gemv_sweep"
nvcc $src -DWITH_CUBLAS -I"$cb/include" -L"$cb/lib" -l:libcublas.so.13 -Xlinker -rpath="$cb/lib" > $R/gemv_build.log 2>&1 || nvcc $src >> $R/gemv_build.log 2>&1; echo "built $?"
GEMV_MS=13,50 timeout 60 /tmp/gemv_sweep $R/sweep_odd.jsonl odd_n > $R/sweep_odd.log 2>&1; echo "odd rc $?"
grep -E "wgmma" $R/sweep_odd.log
GEMV_MS=16,64 timeout 200 /tmp/gemv_sweep $R/sweep_mma.jsonl gate_up_7b,down_7b,qkv_7b > $R/sweep_mma.log 2>&1; echo "sweep rc $?"
grep -E "wgmma|cublas|^gate|^down|^qkv|^o_|^lm" $R/sweep_mma.log | head -80
