# python docs/results/2026-12-07-cpu-serve-rows-fixed/rowcopy_ab.py [--cut]  (2026-12-07, the 2-core CPU)
# rowcopy.py of 2026-12-07-cpu-serve-rows, the server's decode call on 1 or 4 of 4 slots at 512 and 4096 tokens of
# context; --cut runs the call as it was before the fix (decode_rows cutting the rows' cache out and writing it back,
# the test's _decode_rows_cutting_the_cache), on the same tree and build, for an A/B in one sitting.
import sys, time
sys.path.insert(0, "/work/main/tests")
import numpy as np
from tiny import write_tiny_model
from jaxllm import Engine, GGUFFile, Tokenizer
from jaxllm.weights import load_weights
from jaxllm.serve import slots
from jaxllm.serve.slots import SlotPrograms, GREEDY, FULL
if "--cut" in sys.argv:
  from test_step_rows import _decode_rows_cutting_the_cache
  slots.decode_rows = _decode_rows_cutting_the_cache
path = write_tiny_model("/tmp/rowcopy.gguf", "llama", context=4096, n_layers=8)
gf = GGUFFile(path)
w = load_weights(gf, progress=False)
for ctx in (512, 4096):
  e = Engine(gf.config, w, Tokenizer(gf.metadata), max_context=ctx)
  p = SlotPrograms(e, 4)
  for count in (1, 4):
    for masked in (False, True):
      p.decode(count, GREEDY if not masked else FULL, masked=masked)  # compile
      np.asarray(p.decode(count, GREEDY if not masked else FULL, masked=masked))
      rounds = []
      for _ in range(5):   # 5 rounds of 20 calls, each call read before the next: the median and the fastest round
        t = time.perf_counter(); n = 20
        for _ in range(n):
          np.asarray(p.decode(count, GREEDY if not masked else FULL, masked=masked))
        rounds.append((time.perf_counter() - t) / n * 1e3)
      print(f"{'cut' if '--cut' in sys.argv else 'whole'} ctx {ctx} count {count} masked {masked}: "
            f"{np.median(rounds):.2f} ms a call (median of 5 rounds; fastest {min(rounds):.2f})", flush=True)
