#!/usr/bin/env bash
# Re-run on the warm machine with nothing in the background: jaxllm fused/unfused and llama-bench (built by g5.sh).
set -u
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
pack() { tar czf $OUT/g.tgz -C $OUT r && rm -rf $R; }
trap pack EXIT
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/stamps.txt; }
python3 -c "import jaxllm._ffi" || { echo "not built"; exit 1; }
LB=/tmp/lc/llama.cpp/build/bin/llama-bench
ls -la $LB /tmp/q8.gguf > $R/llama_present.txt 2>&1
B="python3 -m jaxllm.bench synthetic:qwen2.5-0.5b --out $R/bench.jsonl --prompt-len 128 --decode-len 128 --repeat 3"
timeout 70 $B --kernels ffi,ffi-unfused --loop both --label greedy >> $R/bench.log 2>&1; stamp "greedy rc=$?"
timeout 60 $B --kernels ffi,ffi-unfused --loop pipelined --batch 4 --label "batch 4" >> $R/bench.log 2>&1; stamp "batch4 rc=$?"
timeout 35 $B --kernels ffi --loop pipelined --temperature 0.7 --top-p 0.9 --label "sampled t0.7 p0.9" >> $R/bench.log 2>&1; stamp "sampled rc=$?"
[ -x $LB ] && { timeout 40 $LB -m /tmp/q8.gguf -ngl 99 -fa 1 -p 128 -n 128 -r 3 -o jsonl > $R/llama.jsonl 2> $R/llama.err; stamp "llama rc=$?"; }
grep "^|" $R/bench.log | grep -v "^|---" | sort -u
grep "\[bench\]" $R/bench.log | grep -o "burst step [0-9.]* ms" 
cat $R/llama.jsonl | python3 -c "
import json,sys
for l in sys.stdin:
  r=json.loads(l); print('llama', r.get('n_prompt'), r.get('n_gen'), r.get('n_depth'), round(r.get('avg_ts',0),1))"
