"""The bench's reports: markdown tables of its records (a runs table, an A/B table of paired processes)
and a PNG of TPOT against the byte floor. python -m jaxllm.bench writes them with --report; bench/suite.py
reuses the A/B table."""
from __future__ import annotations

import statistics


def ab_table(records: list[dict]) -> str:
  """Markdown: per pair and configuration, TPOT/TTFT on vs off and their ratios; medians last."""
  from collections import defaultdict
  groups = defaultdict(dict)
  for r in records:
    groups[(r["kernels"], r["loop"], r["pair"])][r["graphs_requested"]] = r
  lines = ["| kernels | loop | pair | TPOT on (ms) | TPOT off (ms) | off/on | TTFT on (ms) | TTFT off (ms) | "
           "tok/s on | tok/s off |", "|---|---|---|---|---|---|---|---|---|---|"]
  ratios = defaultdict(list)
  for (kernels, loop, pair), g in sorted(groups.items()):
    if True in g and False in g:
      on, off = g[True], g[False]
      ratio = off["tpot_ms_mean"] / on["tpot_ms_mean"]
      ratios[(kernels, loop)].append((on, off, ratio))
      lines.append(f"| {kernels} | {loop} | {pair} | {on['tpot_ms_mean']:.3f} | {off['tpot_ms_mean']:.3f} | "
                   f"{ratio:.2f}x | {on['ttft_ms']:.2f} | {off['ttft_ms']:.2f} | {on['decode_tok_s']:.0f} | "
                   f"{off['decode_tok_s']:.0f} |")
  for (kernels, loop), rows in sorted(ratios.items()):
    med = statistics.median
    lines.append(f"| {kernels} | {loop} | **median** | {med(r[0]['tpot_ms_mean'] for r in rows):.3f} | "
                 f"{med(r[1]['tpot_ms_mean'] for r in rows):.3f} | **{med(r[2] for r in rows):.2f}x** | "
                 f"{med(r[0]['ttft_ms'] for r in rows):.2f} | {med(r[1]['ttft_ms'] for r in rows):.2f} | "
                 f"{med(r[0]['decode_tok_s'] for r in rows):.0f} | {med(r[1]['decode_tok_s'] for r in rows):.0f} |")
  return "\n".join(lines)


def _platform(rec: dict) -> str:
  return rec.get("env", {}).get("platform", "gpu")


def graphs_word(rec: dict) -> str:
  """CUDA graphs as a record asked for them: on or off; n/a (the platform) where the backend has no command
  buffers."""
  if _platform(rec) != "gpu":
    return f"n/a ({_platform(rec)})"
  return "on" if rec["graphs_requested"] else "off"


def state_seen(rec: dict) -> str:
  """What --graph-state saw of the command buffers, in brackets, on the GPU; nothing elsewhere."""
  return f"({rec['graph_state'].get('state')})" if _platform(rec) == "gpu" else ""


def runs_table(records: list[dict]) -> str:
  lines = ["| label | kernels | graphs | state | thunks/call | K | loop | TTFT (ms) | TPOT mean (ms) | per step "
           "p50/p90 (ms) | per token received p50/p90 (ms) | tok/s | weight GB/s | floor (ms) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in records:
    lines.append(f"| {r.get('label') or ''} | {r['kernels']} | {graphs_word(r)} | "
                 f"{r['graph_state'].get('state')} | {r['graph_state'].get('work_thunks', '')} | "
                 f"{r.get('tokens_per_call', 1)}{' while' if r.get('device_loop') == 'while' else ''} | {r['loop']} | "
                 f"{r['ttft_ms']:.2f} | {r['tpot_ms_mean']:.3f} | {r['tpot_step_ms_p50']:.3f} / "
                 f"{r['tpot_step_ms_p90']:.3f} | {r['tpot_token_ms_p50']:.3f} / {r['tpot_token_ms_p90']:.3f} | "
                 f"{r['decode_tok_s']:.1f} | "
                 f"{r['weight_gb_s']:.0f} | {r['byte_floor_ms']:.3f} |")
  return "\n".join(lines)


def plot(records: list[dict], path: str, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  labels = [f"{r.get('label') or ''}\n{r['kernels']} {'g-on' if r['graphs_requested'] else 'g-off'} {r['loop'][:4]}"
            for r in records]
  fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(records)), 4))
  ax.bar(range(len(records)), [r["tpot_ms_mean"] for r in records], color="tab:blue")
  floor = records[0].get("byte_floor_ms")
  if floor:
    ax.axhline(floor, color="tab:red", ls="--", label=f"byte floor {floor:.3f} ms")
    ax.legend()
  ax.set_xticks(range(len(records)), labels, fontsize=6, rotation=90)
  ax.set_ylabel("TPOT (ms)")
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
