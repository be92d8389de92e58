# python docs/results/2026-12-07-cpu-serve-rows/rowcopy.py  (2026-12-07, the 2-core CPU, tree 04c48f7)
# Does a decode call on fewer rows than the slots cost time that grows with max_context? (the cache rows copied)
import sys, time
sys.path.insert(0, "/work/main/tests")
import numpy as np
from tiny import write_tiny_model
from jaxllm import Engine, GGUFFile, Tokenizer
from jaxllm.weights import load_weights
from jaxllm.serve.slots import SlotPrograms, GREEDY, FULL
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
      t = time.perf_counter(); n = 20
      for _ in range(n):
        np.asarray(p.decode(count, GREEDY if not masked else FULL, masked=masked))
      dt = (time.perf_counter() - t) / n
      print(f"ctx {ctx} count {count} masked {masked}: {dt*1e3:.2f} ms a call", flush=True)
