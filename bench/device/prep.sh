#!/usr/bin/env bash
# Makes .carry/ (ignored) for the H200 calls of bench/device/*.sh, on the CPU machine, from the repository root:
#
#   bash bench/device/prep.sh            # the tree of HEAD with its wheels, the tokenizer GGUF
#   bash bench/device/prep.sh --llama    # and, in the background, the llama.cpp CUDA build (most of an hour)
#
#   .carry/tree/        `git archive HEAD` (what the calls build and run: edits after this do not travel),
#                       with .whl/: the packages the H200 lacks, for its Python 3.12 (CONTRIBUTING.md)
#   .carry/commit       HEAD's hash, for the records' commit field
#   .carry/vocab.gguf   Qwen2.5's tokenizer in a GGUF of its own (bench/peers/random_gguf.py; the peers' files)
#   .carry/llamacpp-cuda-sm90.tar.xz   llama-bench, llama-batched-bench, llama-server for sm_90
#                       (bench/peers/build_llamacpp.sh; log in /tmp/llamacpp-cuda.log)
#
# Then, one device call each (`run` with carry [".carry/tree", ".carry/llamacpp-cuda-sm90.tar.xz",
# ".carry/vocab.gguf", ".carry/commit"], about 50 MB of the 64 MiB), chained so the machine stays warm:
#   cd .carry/tree && JAXLLM_TEST_OFFLINE=1 TESTS=all WORKERS=16 T_TESTS=480 OUT=$OUT bash bench/gpu_check.sh
#   bash bench/device/serve.sh
#   bash bench/device/perf.sh
set -euo pipefail
[ -d .git ] && [ -f bench/device/prep.sh ] || { echo "prep.sh: run it from the repository root"; exit 2; }
C=.carry
mkdir -p $C
[ -z "$(git status --porcelain --untracked-files=no)" ] || echo "prep.sh: uncommitted changes are not in the tree (it is HEAD)"
rm -rf $C/tree && mkdir -p $C/tree && git archive HEAD | tar x -C $C/tree
git rev-parse HEAD > $C/commit
python3 -m pip download -q -d $C/tree/.whl --python-version 3.12 --only-binary :all: \
  --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 \
  starlette==1.10.0 uvicorn==0.54.0 "pydantic>=2.7,<3" openai==3.51.0 llguidance==1.9.1 jsonschema==4.26.0 \
  "gguf>=0.17,<1" 2>&1 | grep -v "^WARNING: Location" || true
# The machine has its own numpy (its jax and torch are built against it): never shadow it from /tmp/site.
rm -f $C/tree/.whl/numpy-*.whl
ls $C/tree/.whl/*.whl > /dev/null
[ -s $C/vocab.gguf ] || python3 bench/peers/random_gguf.py vocab qwen2.5-coder-0.5b $C/vocab.gguf
if [ "${1-}" = --llama ] && [ ! -s $C/llamacpp-cuda-sm90.tar.xz ]; then
  setsid nice bash bench/peers/build_llamacpp.sh cuda 90 $C/llamacpp-cuda-sm90.tar.xz > /tmp/llamacpp-cuda.log 2>&1 &
  echo "prep.sh: llama.cpp building in the background (tail /tmp/llamacpp-cuda.log)"
fi
du -sch $C/tree $C/vocab.gguf $C/llamacpp-cuda-sm90.tar.xz 2>/dev/null | tail -1
echo "prep.sh: .carry/tree is $(cat $C/commit)"
