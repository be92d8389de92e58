#!/usr/bin/env bash
# Tenth session, call 1: the default decode step traced on the device (bench/step_profile.py: CUPTI through
# jax.profiler), graphs on and off, and with every layer stage left out (the step's other kernels alone);
# XLA's thunk sequence of the K = 8 decode executable.
DEADLINE=${DEADLINE:-550}
source bench/device_call.sh   # environment, build, stamp/room helpers, logs packed at exit
P="timeout 90 python3 bench/step_profile.py --tokens 64"
$P --out $R/profile_on.json > $R/profile_on.log 2>&1; stamp "profile on rc=$?"; tail -40 $R/profile_on.log
JAXLLM_CUDA_GRAPHS=0 $P --out $R/profile_off.json > $R/profile_off.log 2>&1; stamp "profile off rc=$?"; tail -40 $R/profile_off.log
JAXLLM_LAYERS_SKIP=qkv,attention,o,gate_up,down $P --out $R/profile_nolayers.json > $R/profile_nolayers.log 2>&1
stamp "profile without the layers rc=$?"; tail -25 $R/profile_nolayers.log
timeout 90 python3 - $R/dump <<'P' > $R/graph_state.log 2>&1
import sys
from jaxllm.bench import load_model
from jaxllm.engine import Engine
config, weights, _, _ = load_model("synthetic:qwen2.5-0.5b", "w8a16", 0)
engine = Engine(config, weights, None, max_context=300, kernels="ffi")
print(engine.graph_state(True, dump_dir=sys.argv[1]))
P
stamp "graph state rc=$?"; tail -3 $R/graph_state.log
# keep the decode executable's thunk sequence and optimized HLO only
mkdir -p $R/hlo; for f in $(ls -S $R/dump/*thunk_sequence* 2>/dev/null | head -2) $(ls -S $R/dump/*after_optimizations.txt 2>/dev/null | head -2); do cp $f $R/hlo/; done
rm -rf $R/dump; ls -la $R/hlo
stamp end
