#!/usr/bin/env bash
# Short call, release build (the attention's fold on, uncommitted): the merged-attention tests against float64,
# the layers call against the per-op calls (bits), vmap, and the launches test (7B head expectation fixed).
set -u
[ -d .whl ] || { mkdir -p .whl && cp .carry/whl_c/*.whl .whl/; }
export DEADLINE=${DEADLINE:-170}
source bench/device_call.sh
echo "tree: the commit above + the fold in ffi/attention_cuda.cuh, tests (uncommitted)" >> $R/env.txt
XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_CLIENT_MEM_FRACTION=0.1 JAXLLM_TEST_OFFLINE=1 timeout $(( $(left) + 15 )) \
  python3 -m pytest -q -rfEs -n 8 -p no:cacheprovider tests/test_fused.py tests/test_launches.py \
  -k "merged_attention or layers_call or launches or vmap" > $R/tests.log 2>&1; stamp "tests rc $?"
tail -8 $R/tests.log
cp $R/tests.log $OUT/
