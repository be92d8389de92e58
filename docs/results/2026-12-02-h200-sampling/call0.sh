#!/usr/bin/env bash
# Ran as call 0 of the sixth session (2026-12-02) on 12a13a9: a copy of
# docs/results/2026-12-01-h200-profile/next-call.sh, whose header below is the fifth session's.
# NOT RUN: prepared at the end of the fifth session of 2026-12-01 (its device time was spent). Runs first
# what the final code has not run on a GPU: the layers call's bit identity and graphs on/off token identity
# with the early trigger; then the candidates kernel by stage (bench/candidates_sweep.cu) and sampling's
# parts, to find where its 38 us go.
source bench/device_call.sh   # environment, build, stamp/room helpers, logs packed at exit
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_fused.py -k "layers" \
  > $R/gpu_tests_layers.log 2>&1
stamp "layers tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_layers.log | head
room 150 graphs && { timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_graphs.py -k "parity_qwen or replay" \
  > $R/gpu_tests_graphs.log 2>&1; stamp "graphs tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" $R/gpu_tests_graphs.log | head; }
unset XLA_PYTHON_CLIENT_PREALLOCATE
room 60 sweep && { I=$(python3 -c "import jax.ffi; print(jax.ffi.include_dir())"); nvcc -O3 -std=c++17 -arch=sm_90 -I ffi -I $I \
  bench/candidates_sweep.cu -o /tmp/candidates_sweep > $R/candidates_build.log 2>&1 && timeout 40 /tmp/candidates_sweep \
  > $R/candidates_sweep.jsonl 2>&1; stamp "candidates_sweep rc=$?"; cat $R/candidates_sweep.jsonl; }
room 60 sample && { timeout 70 python3 bench/sample_cost.py --out $R/sample_cost.json > $R/sample_cost.log 2>&1; stamp "sample_cost $?"; tail -11 $R/sample_cost.log; }
stamp end
