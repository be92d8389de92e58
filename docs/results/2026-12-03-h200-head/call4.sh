#!/usr/bin/env bash
# Twelfth session, call 4: the vocabulary-size head test broken on purpose, once each way: (1) the int16
# staging without its NaN probe (the main code before this session), (2) the resident head dropping the last
# row. Each must fail.
DEADLINE=${DEADLINE:-400}
source bench/device_call.sh
T="timeout 100 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_fused.py -k vocabulary"
build() { timeout 300 python3 -m pip install --no-build-isolation --no-deps -e . -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90-real > $R/build_$1.log 2>&1; stamp "build $1 rc=$?"; }
sed -i 's|  out.s = amax \* (1.f / 32767.f) + probe;|  out.s = amax * (1.f / 32767.f);|' ffi/w8a16_cuda.cuh
grep -c "+ probe;" ffi/w8a16_cuda.cuh
build no_probe; XLA_PYTHON_CLIENT_PREALLOCATE=false $T > $R/test_no_probe.log 2>&1; stamp "no probe: test rc=$?"; grep -E "^FAILED|passed|failed" $R/test_no_probe.log | tail -8
sed -i 's|  out.s = amax \* (1.f / 32767.f);|  out.s = amax * (1.f / 32767.f) + probe;|; s|n + j < n_total) {|n + j < n_total - 1) {|' ffi/w8a16_cuda.cuh
grep -c "n_total - 1) {" ffi/w8a16_cuda.cuh
build last_row; XLA_PYTHON_CLIENT_PREALLOCATE=false $T > $R/test_last_row.log 2>&1; stamp "last row dropped: test rc=$?"; grep -E "^FAILED|passed|failed" $R/test_last_row.log | tail -8
stamp end
