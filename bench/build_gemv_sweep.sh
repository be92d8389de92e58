#!/usr/bin/env bash
# Builds bench/gemv_sweep.cu for one GPU architecture (from the repository root):
#   bash bench/build_gemv_sweep.sh 90 /tmp/gemv_sweep      # compute capability without the dot, output binary
# Hopper (90) gets sm_90a, which the wgmma candidate needs (bench/w8a16_wgmma.cuh; built for another target the
# sweep skips it). cuBLAS's bf16 GEMM is timed beside the kernels when its headers are found (the nvidia-cublas
# wheel); without them the sweep is built without it. Compiler output goes to stdout and stderr.
set -u
arch=${1:?compute capability, e.g. 90}
out=${2:?output binary}
target="-arch=sm_${arch}"
[ "$arch" = 90 ] && target="-gencode arch=compute_90a,code=sm_90a"
src="-O3 -std=c++17 $target -I ffi -I $(python3 -c "import jax; print(jax.ffi.include_dir())") bench/gemv_sweep.cu -o $out"
cb=$(python3 -c "import nvidia.cublas as c, os; print(os.path.dirname(c.__file__))" 2>/dev/null || true)
if [ -n "$cb" ] && nvcc $src -DWITH_CUBLAS -I"$cb/include" -L"$cb/lib" -l:libcublas.so.13 -Xlinker -rpath="$cb/lib"; then
  exit 0
fi
echo "build_gemv_sweep.sh: building without cuBLAS"
nvcc $src
