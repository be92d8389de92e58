#!/usr/bin/env bash
# The test files the whole-suite run at 436711d left unfinished at its 400 s (release build).
set -u
JAXLLM_TEST_OFFLINE=1 WORKERS=16 T_TESTS=${T_TESTS:-220} OUT=$OUT TESTS="tests/test_launches.py tests/test_presets.py \
tests/test_serve_cli.py tests/test_serve_peers.py tests/test_startup.py tests/test_admit.py tests/test_cache_trust.py \
tests/test_lab.py" bash bench/gpu_check.sh > $OUT/check.log 2>&1
echo "gpu_check rc $?"
grep -E "passed|failed|FAILED|ERROR|exit" $OUT/check.log | tail -15
