#!/usr/bin/env bash
# Call 2: the whole suite (release build, bench/gpu_check.sh) and, beside it once the build is done,
# docs/results/2026-12-07-h100-vmap-alias/vmap_study.py on the same build (its "step" case needs a lab build: there it records the refusal).
set -u
[ -n "${OUT-}" ] || exit 2
mkdir -p $OUT/study
( while [ ! -e $OUT/gpu-check/tests.log ]; do sleep 2; [ -e $OUT/gpu-check.tgz ] && exit 0; done
  export PYTHONPATH=/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_CLIENT_MEM_FRACTION=0.04
  [ -s .carry/commit ] && export JAXLLM_GIT_COMMIT=$(cat .carry/commit)
  timeout 420 python3 docs/results/2026-12-07-h100-vmap-alias/vmap_study.py all $OUT/study > $OUT/study.jsonl 2> $OUT/study.err
  echo "study rc $?" >> $OUT/study.err
  [ -d $OUT/study/dump_step ] && tar czf $OUT/dump_step.tgz -C $OUT/study dump_step && rm -rf $OUT/study/dump_step
) &
SP=$!
JAXLLM_TEST_OFFLINE=1 TESTS=all T_TESTS=420 OUT=$OUT bash bench/gpu_check.sh
wait $SP
cut -c1-330 $OUT/study.jsonl
tail -3 $OUT/study.err
