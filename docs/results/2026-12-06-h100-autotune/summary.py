"""The best configuration of each kernel per shape and rows in one sweep record (the tables of section 1):
  python3 summary.py sweep_call2.jsonl"""
import collections
import json
import sys

best = collections.defaultdict(dict)
for line in open(sys.argv[1]):
  r = json.loads(line)
  if not r.get("matmul"):
    continue
  family = r["config"].split("_")[0]       # mma: the kernel in use; mmaring, mmabulk: today's candidates
  cell = best[(r["shape"], r["m"])]
  if family not in cell or r["us"] < cell[family][0]:
    cell[family] = (r["us"], r["config"])
for (shape, m), cell in sorted(best.items()):
  print(f"{shape:12s} {m:3d}  " + "  ".join(f"{f} {us:.1f} ({c[len(f) + 1:]})" for f, (us, c) in sorted(cell.items())))
