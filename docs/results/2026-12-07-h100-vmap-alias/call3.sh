#!/usr/bin/env bash
# Call 3 (warm, right after call 2): a lab build; the per-op fused step under jax.vmap with the handlers' alias
# copy on and off (JAXLLM_ALIAS_COPY=0), and the QKV epilogue alone with it off. Run as one command line.
export LAB=1 DEADLINE=220; source bench/device_call.sh; for v in "" 0; do JAXLLM_ALIAS_COPY=$v XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 60 python3 docs/results/2026-12-07-h100-vmap-alias/vmap_study.py step 2>&1 | tail -1 | cut -c1-400; stamp "step copy=${v:-on}"; done; JAXLLM_ALIAS_COPY=0 timeout 40 python3 docs/results/2026-12-07-h100-vmap-alias/vmap_study.py qkv 2>&1 | tail -1 | cut -c1-200
