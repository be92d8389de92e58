# Sourced at the top of a device-call script (docs/results/*/call*.sh): the machine's environment, the
# extension built for sm_90, and helpers. Logs go to $OUT/r, packed into $OUT/g.tgz when the script exits.
#   stamp MSG          seconds since the start, and MSG, into r/stamps.txt
#   room SECONDS WHAT  true while SECONDS more fit before $DEADLINE (default 560 s), else logs WHAT as skipped
#   left               seconds before $DEADLINE less a 25 s margin (a study's --time-limit)
#   use_llamacpp TAR   unpacks a bench/peers/build_llamacpp.sh tarball to /tmp/llamacpp-bin and puts it and the
#                      machine's cuBLAS on LD_LIBRARY_PATH
# Expects the ignored .whl/ (the gguf wheel: the machine has no gguf) beside the working tree.
# LAB=1 (set before sourcing) builds the lab extension, which reads the lab switches (JAXLLM_LAYERS_SKIP,
# JAXLLM_PDL_EARLY, ...; docs/benchmarks.md): a script that sets one needs it, or the switch is ignored.
set -u
R="$OUT/r"
[ -e "$R" ] && { echo "bench/device_call.sh: $R exists already; move it away first (only what this makes is deleted)"; exit 1; }
mkdir -p "$R"
export PYTHONUNBUFFERED=1
pack() { tar czf "$OUT/g.tgz" -C "$OUT" r && rm -rf "$R"; }
trap pack EXIT
# The records' commit (the machine's copy may hold a stale .git): .carry/commit (carry it; write it with
# `git rev-parse HEAD > .carry/commit` after the last commit), else "unknown", never the stale .git's.
[ -s .carry/commit ] && export JAXLLM_GIT_COMMIT=${JAXLLM_GIT_COMMIT:-$(cat .carry/commit)}
export JAXLLM_GIT_COMMIT=${JAXLLM_GIT_COMMIT:-unknown}
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/stamps.txt; }
DEADLINE=${DEADLINE:-560}
room() { [ $(( $(date +%s) - T0 + $1 )) -lt $DEADLINE ] || { stamp "skipped: $2"; return 1; }; }
left() { echo $(( DEADLINE - 25 - $(date +%s) + T0 )); }
use_llamacpp() {
  [ -x /tmp/llamacpp-bin/llama-server ] || tar xJf "$1" -C /tmp || { stamp "no llama.cpp build in $1"; return 1; }
  local cb=$(find / -name "libcublas.so.13*" -not -path "/proc/*" 2>/dev/null | head -1)
  echo "cublas: $cb" >> $R/env.txt
  export LD_LIBRARY_PATH=/tmp/llamacpp-bin:${cb:+$(dirname $cb):}/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/env.txt
echo "records' commit: $JAXLLM_GIT_COMMIT" >> $R/env.txt
export CUDACXX=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
timeout 300 python3 -m pip install --no-build-isolation --no-deps -e . -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90-real \
  ${LAB:+-Ccmake.define.JAXLLM_LAB=ON} > $R/build.log 2>&1 || { stamp "build failed"; tail -30 $R/build.log; exit 1; }
stamp "built${LAB:+ (lab build)}"
