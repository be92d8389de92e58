"""The tables of ../2026-12-06-h100-mma-profile.md from Nsight Compute's exports in this folder (python3 summary.py).

<name>_raw.csv.gz: `ncu --import <report> --page raw --csv` (first profiled launch); <name>_sass.csv.gz: `--page
source --csv --print-source sass` (executed instructions and warp-stall samples per SASS instruction).
"""
import csv
import gzip
import os
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
NAMES = ("gate_up_7b_16", "down_7b_16", "gate_up_7b_64")
METRICS = {
    "duration (us; ncu locks the clocks)": "gpu__time_duration.sum",
    "SM clock (GHz)": "sm__cycles_elapsed.avg.per_second",
    "registers a thread": "launch__registers_per_thread",
    "warps active, % of the SM's": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "DRAM throughput, % of peak": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "issue slots busy, %": "sm__issue_active.avg.pct_of_peak_sustained_elapsed",
    "tensor pipe (HMMA) active, %": "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "ALU pipe active, %": "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active",
    "L1 hit rate, %": "l1tex__t_sector_hit_rate.pct",
}
STALLS = ("long_scoreboard", "wait", "not_selected", "math_pipe_throttle", "barrier", "dispatch_stall",
          "short_scoreboard", "lg_throttle")
# The int8 -> bf16 conversion's instructions: every PRMT, the FADDs of -8388736 (2^23 + 128), the LOP3s that XOR
# with 0x80808080.
def is_conversion(source):
  words = source.split()
  op = words[1] if words[0].startswith("@") else words[0]
  return (op == "PRMT" or (op == "FADD" and "-8388736" in source)
          or (op == "LOP3.LUT" and "0x80808080" in source))


def raw(name):
  """{metric: value} of the first launch, durations in us."""
  with gzip.open(os.path.join(HERE, f"{name}_raw.csv.gz"), "rt") as f:
    rows = list(csv.reader(f))
  values = dict(zip(rows[0], rows[2]))
  unit = dict(zip(rows[0], rows[1]))["gpu__time_duration.sum"]
  scale = {"ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}[unit]
  values["gpu__time_duration.sum"] = str(number(values["gpu__time_duration.sum"]) * scale)
  return values


def number(text):
  return float(text.replace(",", ""))


def sass(name):
  with gzip.open(os.path.join(HERE, f"{name}_sass.csv.gz"), "rt") as f:
    rows = list(csv.reader(f))
  head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
  cols = rows[head]
  data = [r for r in rows[head + 1:] if len(r) == len(cols) and r[0].startswith("0x")]
  seen, unique = set(), []
  for r in data:                      # an export of two launches lists each instruction twice: count it once
    if r[0] not in seen:
      seen.add(r[0])
      unique.append(r)
  samples_col, exec_col = cols.index("Warp Stall Sampling (All Samples)"), cols.index("Instructions Executed")
  long_col = cols.index("stall_long_sb")
  executed, samples, long_sb = Counter(), Counter(), Counter()
  for r in unique:
    words = r[1].split()
    op = words[1] if words[0].startswith("@") else words[0]
    if is_conversion(r[1]):
      executed["(conversion)"] += int(r[exec_col])
      samples["(conversion)"] += int(r[samples_col])
      if op == "LOP3.LUT":
        executed["(conversion XOR)"] += int(r[exec_col])
        long_sb["(conversion XOR)"] += int(r[long_col])
        samples["(conversion XOR)"] += int(r[samples_col])
    executed[op] += int(r[exec_col])
    samples[op] += int(r[samples_col])
    long_sb[op] += int(r[long_col])
  return executed, samples, long_sb


def main():
  metrics = {n: raw(n) for n in NAMES}
  print("| metric | " + " | ".join(NAMES) + " |")
  print("|---|" + "---|" * len(NAMES))
  for label, key in METRICS.items():
    vals = []
    for n in NAMES:
      vals.append(f"{number(metrics[n][key]):.2f}")
    print(f"| {label} | " + " | ".join(vals) + " |")
  print("\nStall cycles per issued instruction, by reason:\n")
  print("| reason | " + " | ".join(NAMES) + " |")
  print("|---|" + "---|" * len(NAMES))
  for s in STALLS:
    key = f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio"
    print(f"| {s} | " + " | ".join(f"{number(metrics[n][key]):.2f}" for n in NAMES) + " |")
  print("\nInstruction mix (share of executed instructions) and where the warps waited (share of stall samples):\n")
  print("| instruction | " + " | ".join(f"{n} executed / stalls" for n in NAMES) + " |")
  print("|---|" + "---|" * len(NAMES))
  mixes = {n: sass(n) for n in NAMES}

  def share(counts, key):
    """counts[key] as a percentage of all instructions' counts (the "(...)" keys are subsets, not added in)."""
    return 100 * counts[key] / sum(v for o, v in counts.items() if not o.startswith("("))

  ops = Counter()
  for executed, _, _ in mixes.values():
    for op in executed:
      if not op.startswith("("):
        ops[op] += share(executed, op)
  rows = [(op, op) for op, _ in ops.most_common(10)]
  rows += [("the conversion (PRMT, FADD -8388736, LOP3 ^0x80808080)", "(conversion)"),
           ("its XOR alone (the first use of the weights)", "(conversion XOR)")]
  for label, op in rows:
    cells = [f"{share(mixes[n][0], op):.1f}% / {share(mixes[n][1], op):.1f}%" for n in NAMES]
    print(f"| {label} | " + " | ".join(cells) + " |")
  print("\nThe long-scoreboard (global load) stall samples, by the instruction that waited: the conversion's XOR is the")
  print("first use of the weights, HMMA's only loaded operand is x, FFMA's the scale:\n")
  print("| instruction | " + " | ".join(NAMES) + " |")
  print("|---|" + "---|" * len(NAMES))
  for op in ("(conversion XOR)", "HMMA.16816.F32.BF16", "FFMA"):
    print(f"| {op} | " + " | ".join(f"{share(mixes[n][2], op):.1f}%" for n in NAMES) + " |")


if __name__ == "__main__":
  main()
