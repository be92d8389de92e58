# The session's H200 calls (2026-12-07, 13:28-13:35 UTC), tree bd47d68, in order on one machine (calls 2-5 found it
# warm). Calls 1-3 carried [".whl" (gguf's wheels), ".carry/llamacpp-cuda-sm90.tar.xz", ".carry/vocab.gguf.xz",
# ".carry/commit"]; calls 4-5 [".whl", ".carry/commit"]. llama.cpp: the llama-cpp-python 0.3.36 sdist built for
# sm_90 on the CPU machine (bench/peers/build_llamacpp.sh), the same tarball as 2026-12-07-h100-scaling-14b.
# 1: batch 1 (asked for kind nvidia-h200: an H200 came; the command ran nothing on another card)
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$G"
if echo "$G" | grep -q H200; then DEADLINE=300 BATCHES=1 bash bench/device/scaling.sh; else echo "not an H200: nothing run"; fi
# 2: batch 16 and 64 at 7B and 0.5B
DEADLINE=270 BATCHES=16,64 PRESETS=qwen2.5-7b,qwen2.5-0.5b bash bench/device/scaling.sh
# 3: batch 16 and 64 at 1B
DEADLINE=140 BATCHES=16,64 PRESETS=llama-3.2-1b bash bench/device/scaling.sh
# 4, 5: the batch-1 rows at 7B and 0.5B again, jaxllm alone, in new processes
export DEADLINE=85; source bench/device_call.sh >/dev/null 2>&1
timeout 75 python3 -m jaxllm.bench synthetic:qwen2.5-7b --batch 1 --kernels auto --loop pipelined --repeat 3
timeout 45 python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --batch 1 --kernels auto --loop pipelined --repeat 3
# The report: the three calls' scaling.jsonl in one file, then
python bench/scaling.py --dir docs/results/2026-12-07-h200-scaling/scaling --presets qwen2.5-7b,qwen2.5-0.5b,llama-3.2-1b \
  --batches 1,16,64 --kernels auto,ffi-unfused --render --check
