#!/usr/bin/env bash
# Call 3: the same warm machine as call 2 (its builds in place): scaling with peers; then more TPOT pairs.
set -u
ROOT=$PWD
cd .carry/tree
DEADLINE=575; R=$OUT/r; mkdir -p $R; T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/stamps.txt; }
pack() { tar czf "$OUT/g.tgz" -C "$OUT" r && rm -rf "$R"; }; trap pack EXIT
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -c "import jaxllm.kernels.ffi as f; print('ffi', f.unavailable_reason() or 'ok')" || { python3 -m pip install --no-build-isolation --no-deps -e . -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90-real > $R/build.log 2>&1; stamp "rebuilt $?"; }
[ -x /tmp/llamacpp-bin/llama-bench ] || tar xJf $ROOT/.carry/llamacpp-cuda-sm90.tar.xz -C /tmp
CB=$(find / -name "libcublas.so.13*" -not -path "/proc/*" 2>/dev/null | head -1)
export LD_LIBRARY_PATH=/tmp/llamacpp-bin:${CB:+$(dirname $CB):}/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
LB=/tmp/llamacpp-bin
PEERS="--llama-bench $LB/llama-bench --llama-batched-bench $LB/llama-batched-bench --vocab $ROOT/.carry/vocab.gguf --peer-types Q8_0,Q4_0"
left() { echo $(( DEADLINE - 20 - $(date +%s) + T0 )); }
stamp "scaling, $(left) s left"
timeout $(left) python3 bench/scaling.py --dir $OUT/scaling --presets qwen2.5-7b,qwen2.5-0.5b --batches 1,16,64 \
  $PEERS --gguf-dir /tmp/gguf --time-limit $(( $(left) - 10 )) > $R/scaling.log 2>&1; stamp "scaling rc $?"
tail -30 $R/scaling.log
