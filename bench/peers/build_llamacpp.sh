#!/usr/bin/env bash
# Builds the llama.cpp peer (llama-bench, llama-batched-bench, llama-server) from the llama-cpp-python 0.3.36
# sources, and packs the binaries with their shared libraries into one tarball that unpacks to llamacpp-bin/.
#
#   bash bench/peers/build_llamacpp.sh cuda 90 OUT.tar.xz   # for an sm_90 GPU (the H200), built on this CPU machine
#   bash bench/peers/build_llamacpp.sh cpu - OUT.tar.xz     # for this machine's CPU (GGML_NATIVE: its own instructions)
#
# The CUDA build needs nvcc (CUDA 13) but no GPU: cuBLAS comes from the nvidia-cublas wheel (its headers and
# libraries; the tarball carries no cuBLAS, so the GPU machine's own is put on LD_LIBRARY_PATH there, as in
# bench/device/serve.sh). On the 2-core machine the CUDA build takes most of an hour: start it early, e.g.
# `setsid nice bash bench/peers/build_llamacpp.sh cuda 90 .carry/llamacpp-cuda-sm90.tar.xz > /tmp/llama.log 2>&1 &`.
# Work files go to $WORK (default /tmp/llamacpp-build); nothing else is written but OUT.
set -euo pipefail
kind=${1:?"cuda or cpu"}; arch=${2:?"the CUDA architecture (90) or - for cpu"}; out=${3:?"the tarball to write"}
case "$kind" in cuda|cpu) ;; *) echo "build_llamacpp.sh: the first argument is cuda or cpu, got $kind"; exit 2;; esac
out=$(realpath -m "$out")
W=${WORK:-/tmp/llamacpp-build}
mkdir -p "$W"
cd "$W"
t0=$(date +%s)
if [ ! -d src ]; then
  # pip reads the sdist's metadata with its build backend, here, without build isolation
  python3 -c "import scikit_build_core" 2>/dev/null || {
    echo "build_llamacpp.sh: pip needs scikit-build-core (the sdist's build backend): pip install scikit-build-core"
    exit 2; }
  python3 -m pip download -q --no-deps --no-binary :all: --no-build-isolation -d sdist llama-cpp-python==0.3.36
  mkdir -p unpack && tar xzf sdist/llama_cpp_python-0.3.36.tar.gz -C unpack
  mv unpack/llama_cpp_python-0.3.36/vendor/llama.cpp src && rm -rf unpack
fi
# Only the three tools (the full tools/ list needs more than the sdist carries).
printf 'add_subdirectory(llama-bench)\nadd_subdirectory(batched-bench)\nadd_subdirectory(ui)\nadd_subdirectory(mtmd)\nadd_subdirectory(server)\n' \
  > src/tools/CMakeLists.txt
[ -f src/app/CMakeLists.txt ] || { mkdir -p src/app && : > src/app/CMakeLists.txt; }
flags=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
       -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON
       -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DCMAKE_INSTALL_RPATH='$ORIGIN'
       -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON)
if [ "$kind" = cuda ]; then
  if [ ! -d cublas ]; then
    python3 -m pip download -q --no-deps --only-binary :all: -d wheels "nvidia-cublas==13.1.1.3"
    mkdir -p cublas && python3 -m zipfile -e wheels/nvidia_cublas-*.whl cublas
  fi
  CB=$(dirname "$(find "$W/cublas" -name cublas_v2.h | head -1)")/..
  CB=$(realpath "$CB")
  # The wheel has versioned libraries only: link names for the linker.
  for l in cublas cublasLt; do ln -sf "$(ls "$CB"/lib/lib$l.so.* | head -1)" "$CB/lib/lib$l.so"; done
  # ggml-cuda calls the driver API (its VMM pool), and this machine has no libcuda.so: link against an empty
  # stand-in with the driver's soname, so that libggml-cuda.so needs libcuda.so.1 and binds its symbols to the
  # GPU machine's driver at run time (the executables are linked with those symbols left to it).
  mkdir -p stub && echo "" > stub/empty.c
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o stub/libcuda.so stub/empty.c
  NVCC=$(command -v nvcc)
  flags+=(-DGGML_NATIVE=OFF -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" -DCMAKE_CUDA_COMPILER="$NVCC"
          -DCUDA_cublas_LIBRARY="$CB/lib/libcublas.so" -DCUDA_cublasLt_LIBRARY="$CB/lib/libcublasLt.so"
          -DCUDA_cuda_driver_LIBRARY="$W/stub/libcuda.so" -DCMAKE_EXE_LINKER_FLAGS="-Wl,--allow-shlib-undefined"
          -DCMAKE_SHARED_LINKER_FLAGS="-Wl,--no-as-needed"
          -DCMAKE_CUDA_FLAGS="-I$CB/include" -DCMAKE_CXX_FLAGS="-I$CB/include" -DCMAKE_C_FLAGS="-I$CB/include")
  build=build-cuda
else
  flags+=(-DGGML_NATIVE=ON)           # the instructions of the CPU it is built on
  build=build-cpu
fi
cmake -S src -B $build "${flags[@]}" > $build-cmake.log 2>&1 || { tail -40 $build-cmake.log; exit 1; }
cmake --build $build -j "$(nproc)" --target llama-bench llama-batched-bench llama-server > $build.log 2>&1 \
  || { grep -E "error|Error" $build.log | head -20; tail -20 $build.log; exit 1; }
rm -rf pack && mkdir -p pack/llamacpp-bin
cp $build/bin/llama-bench $build/bin/llama-batched-bench $build/bin/llama-server pack/llamacpp-bin/
find $build -name "*.so*" \( -type f -o -type l \) -exec cp -P {} pack/llamacpp-bin/ \;
tar cJf "$out" -C pack llamacpp-bin
echo "llama.cpp ($kind ${arch}) built in $(( $(date +%s) - t0 )) s: $out ($(du -h "$out" | cut -f1))"
