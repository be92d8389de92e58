#!/usr/bin/env bash
# Makes what the H200 calls of bench/device/*.sh carry beside the working tree (all ignored), on the CPU machine,
# from the repository root:
#
#   bash bench/device/prep.sh            # the wheels, the tokenizer GGUF, HEAD's hash
#   bash bench/device/prep.sh --llama    # and, in the background, the llama.cpp CUDA build (most of an hour)
#
#   .whl/               the packages the H200 lacks, for its Python 3.12 (CONTRIBUTING.md); bench/gpu_check.sh
#                       and bench/device_call.sh install them into /tmp/site there
#   .carry/commit       HEAD's hash, for the records' commit field (the call runs the working tree: commit first)
#   .carry/vocab.gguf.xz   Qwen2.5's tokenizer in a GGUF of its own (bench/peers/random_gguf.py; the peers'
#                       files), compressed (1.3 MB against 5.9)
#   .carry/llamacpp-cuda-sm90.tar.xz   llama-bench, llama-batched-bench, llama-server for sm_90
#                       (bench/peers/build_llamacpp.sh; log in /tmp/llamacpp-cuda.log)
#
# Then one device call each, from the repository root (the machine's copy of the working tree is what runs),
# carrying [".whl", ".carry/llamacpp-cuda-sm90.tar.xz", ".carry/vocab.gguf.xz", ".carry/commit"], chained so the
# machine stays warm. With every wheel, that and the tree came to more than a call's 64 MiB on 2026-12-07 (wheels
# 11 MB, build 42 MB): keep in .whl/ only the wheels the call needs (scaling.sh's header).
#   JAXLLM_TEST_OFFLINE=1 TESTS=all WORKERS=16 T_TESTS=520 OUT=$OUT bash bench/gpu_check.sh   (carry .whl alone)
#   bash bench/device/scaling.sh   (its header says which wheels to keep so that the call fits)
#   bash bench/device/serve.sh
#   bash bench/device/perf.sh
set -euo pipefail
[ -d .git ] && [ -f bench/device/prep.sh ] || { echo "prep.sh: run it from the repository root"; exit 2; }
C=.carry
mkdir -p $C
[ -z "$(git status --porcelain --untracked-files=no)" ] || echo "prep.sh: uncommitted changes: .carry/commit is HEAD"
git rev-parse HEAD > $C/commit       # rewrite it (git rev-parse HEAD > .carry/commit) after a later commit
rm -rf .whl && mkdir .whl            # no wheel of an older version beside a newer one
python3 -m pip download -q -d .whl --python-version 3.12 --only-binary :all: \
  --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 \
  starlette==1.10.0 uvicorn==0.54.0 "pydantic>=2.7,<3" openai==3.51.0 llguidance==1.9.1 jsonschema==4.26.0 \
  "gguf>=0.17,<1" 2>&1 | grep -v "^WARNING: Location" || true
# The machine has its own numpy (its jax and torch are built against it): never shadow it from /tmp/site.
rm -f .whl/numpy-*.whl
ls .whl/*.whl > /dev/null
if [ ! -s $C/vocab.gguf.xz ]; then
  [ -s $C/vocab.gguf ] || python3 bench/peers/random_gguf.py vocab qwen2.5-coder-0.5b $C/vocab.gguf
  xz -kc $C/vocab.gguf > $C/vocab.gguf.xz
fi
if [ "${1-}" = --llama ] && [ ! -s $C/llamacpp-cuda-sm90.tar.xz ]; then
  # checked here, since the build's own message would only reach its log
  python3 -c "import scikit_build_core" 2>/dev/null || {
    echo "prep.sh: the llama.cpp build needs scikit-build-core (pip reads the sdist's metadata with it):" \
      "pip install scikit-build-core"; exit 2; }
  setsid nice bash bench/peers/build_llamacpp.sh cuda 90 $C/llamacpp-cuda-sm90.tar.xz > /tmp/llamacpp-cuda.log 2>&1 &
  echo "prep.sh: llama.cpp building in the background (tail /tmp/llamacpp-cuda.log)"
fi
du -sch .whl $C/vocab.gguf.xz $C/llamacpp-cuda-sm90.tar.xz 2>/dev/null | tail -1
echo "prep.sh: .carry/commit is $(cat $C/commit)"
