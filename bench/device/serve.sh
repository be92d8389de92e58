#!/usr/bin/env bash
# On the H200 (a device call from the repository root; carry as bench/device/prep.sh says): issue 38's
# comparison, jaxllm.serve beside llama-server on the same random-Q8_0 GGUF and the same load generator at 1,
# 8, 32 and 64 streams (bench/serve_peers.py), the 0.5B shape then the 7B. Resumes: a carried
# .carry/serve.jsonl (the last call's serve.jsonl) is read first, and the records it holds are not run again.
#   PRESETS (default qwen2.5-0.5b,qwen2.5-7b), DEADLINE (seconds for the whole call, default 570),
#   START_TIMEOUT (seconds a server may take to be ready, default 420: a 7B jaxllm converts and compiles first)
#   Another jaxllm configuration (an A/B: a run of its own, in its own device call): JAXLLM_ARGS (more arguments
#   for jaxllm.serve, split on spaces, e.g. "--admit-group 1"), TAG (needed with JAXLLM_ARGS: its study's name,
#   serve-TAG.jsonl, resumed from .carry/serve-TAG.jsonl, so that the default run's records are never taken for
#   it), PEER=0 (jaxllm only, no llama-server); e.g. TAG=admit1 PEER=0 JAXLLM_ARGS="--admit-group 1" bash ...
# Writes $OUT/serve.jsonl and $OUT/serve.md (serve-TAG.*); logs in $OUT/g.tgz.
set -u
ROOT=$PWD
[ -n "${JAXLLM_ARGS:-}" ] && [ -z "${TAG:-}" ] &&
  { echo "serve.sh: JAXLLM_ARGS needs a TAG (another configuration's records must not resume the default's)"; exit 2; }
# The machine's copy of the working tree is what runs; prep.sh's .whl/ and .carry/vocab.gguf.xz travel beside it.
[ -d .whl ] && [ -s .carry/vocab.gguf.xz ] ||
  { echo "serve.sh: no .whl/ or .carry/vocab.gguf.xz (bench/device/prep.sh)"; exit 2; }
[ -s .carry/vocab.gguf ] || xz -dc .carry/vocab.gguf.xz > .carry/vocab.gguf
export DEADLINE=${DEADLINE:-570}
source bench/device_call.sh
if [ "${PEER:-1}" != 0 ]; then
  use_llamacpp $ROOT/.carry/llamacpp-cuda-sm90.tar.xz || exit 1
  timeout 60 /tmp/llamacpp-bin/llama-server --version > $R/llama_version.txt 2>&1; stamp "llama-server --version rc $?"
fi
NAME=serve${TAG:+-$TAG}
D=$R/$NAME
mkdir -p $D
[ -f $ROOT/.carry/$NAME.jsonl ] && cp $ROOT/.carry/$NAME.jsonl $D/serve.jsonl
PEER_ARGS=(--llama-server /tmp/llamacpp-bin/llama-server)
[ "${PEER:-1}" = 0 ] && PEER_ARGS=()
stamp "serve_peers ($NAME), $(left) s left"
python3 bench/serve_peers.py --dir $D --presets ${PRESETS:-qwen2.5-0.5b,qwen2.5-7b} ${PEER_ARGS[@]+"${PEER_ARGS[@]}"} \
  --jaxllm-args="${JAXLLM_ARGS:-}" --vocab $ROOT/.carry/vocab.gguf --gguf-dir /tmp/gguf \
  --time-limit $(left) --start-timeout ${START_TIMEOUT:-420} > $R/$NAME.log 2>&1
stamp "serve_peers rc $?"
cp $D/serve.jsonl $OUT/$NAME.jsonl 2>/dev/null; cp $R/$NAME.md $OUT/ 2>/dev/null
tail -40 $R/$NAME.log
