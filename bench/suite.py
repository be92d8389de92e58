"""The benchmark suite: runs every stage into one folder and writes the report beside it.

  python bench/suite.py gpu --dir docs/results/2026-11-29-h200-suite     # H200: -> ...-suite.md
  python bench/suite.py cpu --dir docs/results/2026-11-29-cpu-suite      # CPU:  -> ...-suite.md

GPU stages (synthetic Qwen2.5-0.5B shape, random weights):
  parity   FFI vs XLA path: greedy tokens, first divergence, teacher-forced logits (bench/path_parity.py)
  replay   command-buffer updates per replay from XLA's log (bench/graph_diag.py)
  kernels  kernel microbenchmarks (bench/kernels.py)
  ab       graphs on vs off in paired processes, both kernel paths, pipelined and streaming loops
  peers    HF transformers + StaticCache: manual CUDA graph (seed 001) and torch.compile reduce-overhead
  batch    batch 1, 4, 16, 64, both kernel paths, pipelined loop
CPU stages (smollm2-135m, the real GGUF):
  cpu      jaxllm W8A16 (FFI and XLA paths) and llama.cpp (llama-cpp-python) on the same file; needs
           llama-cpp-python built for the CPU: CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON
           -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" pip install llama-cpp-python==0.3.36

Each stage runs in its own processes with a time limit and logs into the folder; a stage that fails or
times out is reported as such. `--stages` picks stages (their files are replaced, others kept), and
`--render` only rewrites the report from the files present, so stages can run in separate sessions.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GPU_MODEL = "synthetic:qwen2.5-0.5b"
CPU_MODEL = "smollm2-135m"
BATCHES = (1, 4, 16, 64)


def _bench(*args: str) -> list[str]:
  return [sys.executable, "-m", "jaxllm.bench", *args]


def _script(name: str, *args: str) -> list[str]:
  return [sys.executable, os.path.join(HERE, name), *args]


def stages(target: str, d: str, pairs: int, model: str) -> dict[str, tuple[int, list[list[str]], list[str]]]:
  """name -> (time limit in s, commands, files it writes)."""
  j = functools.partial(os.path.join, d)
  if target == "cpu":
    common = ["--prompt-len", "64", "--loop", "pipelined", "--repeat", "2", "--out", j("cpu.jsonl")]
    return {"cpu": (3000, [_bench(model, "--decode-len", "64", "--kernels", "ffi", *common),
                           _bench(model, "--decode-len", "26", "--kernels", "xla", *common),
                           _script("peers/llamacpp_bench.py", model, "--prompt-len", "64", "--decode-len", "64",
                                   "--repeat", "2", "--out", j("cpu.jsonl"))], ["cpu.jsonl"])}
  return {
      "parity": (300, [_script("path_parity.py", "--model", model, "--json", j("parity.json"))], ["parity.json"]),
      # graph_diag exits 1 when it saw updates: a finding the report shows, not a failed stage
      "replay": (300, [_script("graph_diag.py", "--model", model, "--json", j("replay.json"), "--log", j("replay-xla.log"))], ["replay.json"]),
      "kernels": (420, [_script("kernels.py", "--naive", "--out", j("kernels.jsonl"), "--report", j("kernels.md"))],
                  ["kernels.jsonl", "kernels.md"]),
      "ab": (1800, [_bench(model, "--ab", "graphs", "--pairs", str(pairs), "--kernels", "both", "--loop", "both",
                           "--repeat", "3", "--graph-state", "--out", j("ab.jsonl"))], ["ab.jsonl"]),
      "peers": (600, [_script("peers/hf_torch.py", model, "--mode", mode, "--out", j("peers.jsonl"))
                      for mode in ("graph", "compile")], ["peers.jsonl"]),
      "batch": (900, [_bench(model, "--batch", str(b), "--kernels", "both", "--loop", "pipelined", "--repeat", "3",
                             "--label", f"batch {b}", "--out", j("batch.jsonl")) for b in BATCHES], ["batch.jsonl"]),
  }


def run_stage(name: str, limit: int, commands: list[list[str]], files: list[str], d: str) -> dict:
  for f in files:
    if os.path.exists(os.path.join(d, f)):
      os.remove(os.path.join(d, f))
  t0, status = time.perf_counter(), "ok"
  with open(os.path.join(d, f"{name}.log"), "w") as log:
    for cmd in commands:
      log.write("$ " + " ".join(cmd) + "\n")
      log.flush()
      left = limit - (time.perf_counter() - t0)
      try:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=max(1, left)).returncode
      except subprocess.TimeoutExpired:
        status = f"timed out after {limit} s"
        break
      if rc != 0 and not (rc == 1 and name == "replay"):
        status = f"exit code {rc} from {os.path.basename(cmd[1]) if cmd[1] != '-m' else cmd[2]}"
  from jaxllm.bench import _git_commit
  return {"stage": name, "status": status, "seconds": round(time.perf_counter() - t0, 1), "commit": _git_commit()}


# ---- report ------------------------------------------------------------------------------------------

def _jsonl(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _json(path: str) -> dict | None:
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def _plt():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def _rows(records, kernels, loop, graphs=True):
  """The records of one kernels path, loop mode and graph setting."""
  return [r for r in records if r["kernels"] == kernels and r["loop"] == loop and r["graphs_requested"] == graphs]


def section_ab(records: list[dict], d: str, png: str) -> list[str]:
  from jaxllm.bench_report import ab_table
  out = ["## Graphs on vs off (paired processes)", "",
         f"`python -m jaxllm.bench {records[0]['model']} --ab graphs --pairs N --kernels both --loop both --repeat 3 "
         "--graph-state` (`ab.jsonl`). Each pair is one process with command buffers on, then one with them off; "
         "the ratio is TPOT off / TPOT on.", "", ab_table(records), ""]
  states = {(r["kernels"], r["graphs_requested"]): r["graph_state"] for r in records}
  out += ["Graph state verified from XLA's dump in these processes:", "",
          "| kernels | graphs | state | command buffers | captured / work thunks | coverage |", "|---|---|---|---|---|---|"]
  for (k, g), s in sorted(states.items()):
    out.append(f"| {k} | {'on' if g else 'off'} | {s.get('state')} | {s.get('command_buffers')} | "
               f"{s.get('captured')} / {s.get('work_thunks')} | {s.get('coverage', 0):.0%} |")
  plt = _plt()
  groups = sorted({(r["kernels"], r["loop"]) for r in records})
  fig, ax = plt.subplots(figsize=(7, 4))
  for gi, (k, loop) in enumerate(groups):
    for off, graphs, color in ((-0.18, True, "tab:blue"), (0.18, False, "tab:orange")):
      vals = [r["tpot_ms_mean"] for r in _rows(records, k, loop, graphs)]
      ax.bar(gi + off, statistics.median(vals), 0.34, color=color,
             label=("graphs on" if graphs else "graphs off") if gi == 0 else None)
      ax.scatter([gi + off] * len(vals), vals, color="k", s=8, zorder=3)
  floor = records[0].get("byte_floor_ms")
  ax.axhline(floor, color="tab:red", ls="--", label=f"weight byte floor {floor:.3f} ms")
  ax.set_xticks(range(len(groups)), [f"{k}\n{loop}" for k, loop in groups])
  ax.set_ylabel("TPOT (ms), median of pairs; dots: each process")
  ax.set_title(f"{records[0]['model']}: CUDA graphs on vs off ({records[0]['env']['device']})", fontsize=9)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(d, png), dpi=120)
  out += ["", f"![graphs on vs off]({os.path.basename(d)}/{png})", ""]
  return out


def _name(r: dict) -> str:
  """A row's engine/path: its label, else jaxllm's kernel path, else the peer's name."""
  if r.get("label"):
    return r["label"]
  return f"jaxllm {r['kernels']}" if r["kernels"] in ("ffi", "xla") else r["kernels"]


def _weight_note(r: dict) -> str:
  wb = r.get("weight_bytes_per_token")
  return f"{wb / 1e6:.0f} MB" if wb else "-"


def _step_ms(r: dict, q: str) -> str:
  """A record's TPOT percentile per step (schema 2). A schema-1 record has the gaps between tokens, which are
  steps only where a call ran one step (else "-")."""
  v = r.get(f"tpot_step_ms_{q}", r.get(f"tpot_ms_{q}") if r.get("tokens_per_call", 1) == 1 else None)
  return "-" if v is None else f"{v:.3f}"


def section_compare(records: list[dict], d: str, png: str, title: str, intro: str) -> list[str]:
  out = [title, "", intro, "",
         "| engine / path | graphs | loop | TTFT (ms) | TPOT mean / per step p50 / p90 (ms) | decode tok/s | weights read per token | byte floor (ms) |",
         "|---|---|---|---|---|---|---|---|"]
  for r in records:
    on_gpu = r["env"].get("platform") == "gpu"
    graphs = {True: "on", False: "off"}.get(r.get("graphs_requested"), "-") if on_gpu else "-"
    floor = f"{r['byte_floor_ms']:.3f}" if r.get("byte_floor_ms") else "-"
    out.append(f"| {_name(r)} | {graphs} | {r['loop']} | {r['ttft_ms']:.2f} | "
               f"{r['tpot_ms_mean']:.3f} / {_step_ms(r, 'p50')} / {_step_ms(r, 'p90')} | {r['decode_tok_s']:.1f} | "
               f"{_weight_note(r)} | {floor} |")
  plt = _plt()
  fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(records)), 4))
  ax.bar(range(len(records)), [r["decode_tok_s"] for r in records], color="tab:green")
  ax.set_xticks(range(len(records)), [f"{_name(r)}\n{r['loop']}" for r in records],
                fontsize=7, rotation=30, ha="right")
  ax.set_ylabel("decode tok/s (batch 1)")
  ax.set_title(title.lstrip("# "), fontsize=9)
  fig.tight_layout()
  fig.savefig(os.path.join(d, png), dpi=120)
  return out + ["", f"![{title.lstrip('# ')}]({os.path.basename(d)}/{png})", ""]


def section_batch(records: list[dict], d: str, png: str) -> list[str]:
  out = ["## Batched decode", "",
         f"`python -m jaxllm.bench {records[0]['model']} --batch B --kernels both --loop pipelined --repeat 3` for B in "
         f"{', '.join(map(str, BATCHES))} (`batch.jsonl`): B random prompts of 128 tokens, 128 new tokens each.", "",
         "| batch | kernels | TTFT (ms) | TPOT mean / per step p90 (ms) | tok/s per sequence | tok/s total |",
         "|---|---|---|---|---|---|"]
  for r in sorted(records, key=lambda r: (r["kernels"], r["batch"])):
    out.append(f"| {r['batch']} | {r['kernels']} | {r['ttft_ms']:.2f} | {r['tpot_ms_mean']:.3f} / "
               f"{_step_ms(r, 'p90')} | {r['decode_tok_s']:.1f} | {r['decode_tok_s_total']:.0f} |")
  plt = _plt()
  fig, ax = plt.subplots(figsize=(6, 4))
  for k in sorted({r["kernels"] for r in records}):
    rows = sorted((r for r in records if r["kernels"] == k), key=lambda r: r["batch"])
    ax.plot([r["batch"] for r in rows], [r["decode_tok_s_total"] for r in rows], "o-", label=f"{k} total")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("batch")
  ax.set_ylabel("decode tok/s, all sequences")
  ax.legend()
  ax.set_title(f"{records[0]['model']}, pipelined loop", fontsize=9)
  fig.tight_layout()
  fig.savefig(os.path.join(d, png), dpi=120)
  return out + ["", f"![batch]({os.path.basename(d)}/{png})", ""]


def section_kernels(records: list[dict], d: str, png: str) -> list[str]:
  with open(os.path.join(d, "kernels.md")) as f:
    table = f.read().strip()
  out = ["## Kernel microbenchmarks", "", "`python bench/kernels.py --naive` (`kernels.jsonl`, `kernels.md`): "
         "per-call times by the two-length difference of programs of n and 2n calls in one graph, weights "
         "rotated over 256 MB of copies; see the method in bench/kernels.py.", "", table, ""]
  low = [r for r in records
         if r["bench"] == "w8a16_matmul" and r["xla_bf16_dot_us"] < 0.75 * r["bf16_floor_us"]]
  if low:
    out += ["XLA's bf16 dot ran well below its own byte floor (under 3/4 of the bf16 weight bytes at the copy "
            "bandwidth) for " +
            ", ".join(f"{r['shape']} M={r['m']} ({r['xla_bf16_dot_us']:.2f} < {r['bf16_floor_us']:.2f} us)"
                      for r in low) +
            ": there XLA did not run the program's dots one per call, so that column is no per-call time. The "
            "CUDA-graph comparison with cuBLAS (previous section) is the like-for-like one.", ""]
  attn = [r for r in records if r["bench"] == "decode_attention"]
  if attn:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, s_max in zip(axes, sorted({r["s_max"] for r in attn})):
      rows = [r for r in attn if r["s_max"] == s_max]
      ax.plot([r["length"] for r in rows], [r["ours_us"] for r in rows], "o-", label="jaxllm FFI")
      ax.plot([r["length"] for r in rows], [r["xla_masked_us"] for r in rows], "s-", label="XLA masked")
      ax.set_title(f"decode attention, S_max {s_max}", fontsize=9)
      ax.set_xlabel("visible length")
      ax.set_ylabel("us per call")
      ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(d, png), dpi=120)
    out += [f"![attention]({os.path.basename(d)}/{png})", ""]
  return out


def section_gemv(records: list[dict]) -> list[str]:
  """The W8A16 kernel's configurations beside cuBLAS's bf16 GEMM (bench/gemv_sweep.cu, raw CUDA graphs)."""
  out = ["## W8A16 kernel configurations vs cuBLAS bf16 (CUDA graph)", "",
         "`GEMV_SWEEP=1 bash bench/gpu_check.sh` runs `bench/gemv_sweep.cu` (`gemv_sweep.jsonl`): every "
         "configuration of the kernel template in `ffi/w8a16_cuda.cuh`, and cuBLAS's bf16 GEMM of the same shape, "
         "timed as n and 2n launches in one CUDA graph (per call = difference / n), weights rotated over copies "
         "spanning twice the L2; each output checked against a plain reference kernel first. `earlier` is the "
         "previous handler's scheme (a warp per row, int8 -> f32 by conversion instruction). Byte floor: int8 "
         "weight bytes at 4.3 TB/s. Reference points timed the same way, where the sweep has them: an empty "
         "kernel, and the fastest kernel that only reads the int8 weight bytes (`read only`).", "",
         "| shape | M | K -> N | byte floor (us) | empty kernel (us) | read only (us) | cuBLAS bf16 (us) | "
         "earlier (us) | best configuration | best (us) | best / cuBLAS | best GB/s |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for m, _, shape in sorted({(r["m"], r["n"] * r["k"], r["shape"]) for r in records}):
    rows = [r for r in records if r["shape"] == shape and r["m"] == m]
    ref = next((r for r in rows if r["config"] == "cublas_bf16"), None)
    ours = [r for r in rows if r["config"] != "cublas_bf16" and r.get("matmul", True)
            and r.get("rel_err") is not None and r["rel_err"] < 1e-2]
    if not ref or not ours:
      continue
    points = [r for r in records if r["shape"] == shape and not r.get("matmul", True)]   # timed at M = 1
    empty = next((f"{r['us']:.2f}" for r in points if r["config"] == "empty_kernel"), "-")
    reads = [r["us"] for r in points if r["config"].startswith("read_floor")   # weight bytes alone
             and "scaled" not in r["config"] and "_x_" not in r["config"]]
    best = min(ours, key=lambda r: r["us"])
    early = next((f"{r['us']:.2f}" for r in ours if r["config"] == "mt1_tpr32_rows1_u4_i2f"), "-")
    out.append(f"| {shape} | {m} | {best['k']} -> {best['n']} | {best['floor_us']:.2f} | {empty} | "
               f"{f'{min(reads):.2f}' if reads else '-'} | {ref['us']:.2f} | {early} | `{best['config']}` | "
               f"{best['us']:.2f} | {best['us'] / ref['us']:.2f} | {best['gbps']:.0f} |")
  return out + [""]


def section_replay(res: dict) -> list[str]:
  out = ["## Does a replay need a graph update?", "",
         "`python bench/graph_diag.py` (`replay.json`): XLA's own log (`TF_CPP_VMODULE=command_buffer_thunk=3`) "
         "counted per segment, each after a warm-up.", "",
         "| segment | command-buffer executions | updates (re-recordings) | allocations changed per update |",
         "|---|---|---|---|"]
  for name, s in res["segments"].items():
    out.append(f"| {name} | {s['executions']} | {s['updates']} | {s['updated_allocs'] or '-'} |")
  return out + [""]


def _margin(v: float) -> str:
  return f"{v:.4f}" if v >= 1e-4 else f"{v:.1e}"


def section_parity(res: dict) -> list[str]:
  verdict = ("identical" if res["tokens_identical"] else f"first divergence at new token {res['first_divergence']}")
  out = ["## FFI path vs XLA path: same tokens?", "",
         f"`python bench/path_parity.py` (`parity.json`), {res['model']}, seed {res['seed']}, prompt "
         f"{res['prompt_len']} random tokens, {res['new_tokens']} greedy tokens ({res['dtype']} activations): "
         f"**{verdict}**. Teacher-forced over the XLA path's tokens ({res['forced_steps']} decode steps): logits "
         f"relative error mean {res['logits_rel_err_mean']:.2e}, max {res['logits_rel_err_max']:.2e}; top-1 "
         f"agreement {res['top1_agreement']:.1%}; smallest XLA top-2 margin {_margin(res['min_xla_top2_margin'])}."]
  if res["disagreements"]:
    out += ["", "Steps where the top-1 differs (XLA top-2 margin there):", ""]
    out += [f"- step {x['step']}: margin {_margin(x['xla_top2_margin'])}, logits rel. err {x['rel_err']:.2e}"
            for x in res["disagreements"]]
  return out + [""]


def render(target: str, d: str, status: list[dict]) -> str:
  j = functools.partial(os.path.join, d)
  status_of = {s["stage"]: s["status"] for s in status}
  anything = _jsonl(j("ab.jsonl")) or _jsonl(j("cpu.jsonl")) or _jsonl(j("batch.jsonl")) or _jsonl(j("kernels.jsonl"))
  env = anything[0]["env"] if anything else (_json(j("parity.json")) or {}).get("env", {})
  lines = [f"# Benchmark suite: {target.upper()}, {env.get('date', '')[:10]}", "",
           f"Produced by `python bench/suite.py {target} --dir {d}`; every figure below comes from the files in "
           f"`{os.path.basename(d)}/`.", "",
           f"Environment: {env.get('device')} (driver {env.get('driver', '-')}), jax/jaxlib {env.get('jax')}/"
           f"{env.get('jaxlib')}, Python {env.get('python')}, XLA_FLAGS `{env.get('xla_flags') or ''}`, "
           f"commit `{env.get('git_commit')}`.", ""]
  if status:
    if len({s.get("commit") for s in status}) > 1:
      lines += ["The stages ran separately (`--stages`, e.g. one machine call each) at the commits listed, and "
                "this report was rendered from the merged folder (`--render`).", ""]
    lines += ["| stage | status | seconds | commit |", "|---|---|---|---|"]
    lines += [f"| {s['stage']} | {s['status']} | {s['seconds'] or '-'} | `{s.get('commit')}` |" for s in status] + [""]
  if target == "cpu":
    recs = _jsonl(j("cpu.jsonl"))
    if recs:
      lines += section_compare(recs, d, "cpu.png", f"## {recs[0]['model']}: jaxllm vs llama.cpp (CPU)",
                               "jaxllm re-quantizes the file to W8A16; llama.cpp runs the file's own quantization. The "
                               "byte floor uses the bench's copy bandwidth, XLA's own elementwise add, which "
                               "under-reads this machine's memory bandwidth (the FFI matmul reads faster).")
    return "\n".join(lines) + "\n"
  parity, replay = _json(j("parity.json")), _json(j("replay.json"))
  if parity:
    lines += section_parity(parity)
  if replay:
    lines += section_replay(replay)
  ab, peers = _jsonl(j("ab.jsonl")), _jsonl(j("peers.jsonl"))
  if ab:
    lines += section_ab(ab, d, "ab.png")
  if ab or peers:
    ours = []
    for k in ("ffi", "xla"):
      for loop in ("pipelined", "streaming"):
        rows = sorted(_rows(ab, k, loop, True), key=lambda r: r["tpot_ms_mean"])
        if rows:
          r = dict(rows[len(rows) // 2], label=f"jaxllm {k} (median process)")
          ours.append(r)
    lines += section_compare(ours + peers, d, "peers.png", "## jaxllm beside PyTorch (batch 1)",
                             "PyTorch runs the same shapes in bf16 (twice the weight bytes of W8A16) and reads "
                             "every token on the host (streaming); `peers.jsonl`. jaxllm rows: the median "
                             "graphs-on process of the A/B.")
    missing = sorted({"torch-graph", "torch-compile"} - {r["kernels"] for r in peers})
    if missing:
      lines += [f"No record from {', '.join(missing)}: the run failed ({status_of.get('peers', 'not run')}); "
                "`peers.log` holds its output.", ""]
  batch = _jsonl(j("batch.jsonl"))
  if batch:
    lines += section_batch(batch, d, "batch.png")
  gemv = _jsonl(j("gemv_sweep.jsonl"))
  if gemv:
    lines += section_gemv(gemv)
  kernels = _jsonl(j("kernels.jsonl"))
  if kernels and os.path.exists(j("kernels.md")):
    lines += section_kernels(kernels, d, "attention.png")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("target", choices=("gpu", "cpu"))
  p.add_argument("--dir", required=True, help="folder for the files; the report is <dir>.md")
  p.add_argument("--stages", nargs="+", help="run only these stages (default: all)")
  p.add_argument("--pairs", type=int, default=5)
  p.add_argument("--model", help=f"default {GPU_MODEL} (gpu), {CPU_MODEL} (cpu)")
  p.add_argument("--render", action="store_true", help="only rewrite the report from the files present")
  args = p.parse_args(argv)
  d = args.dir.rstrip("/")
  os.makedirs(d, exist_ok=True)
  status_path = os.path.join(d, "stages.json")
  status = {s["stage"]: s for s in (_json(status_path) or [])}
  if not args.render and args.target == "gpu":
    import jax
    if not any(d.platform == "gpu" for d in jax.devices()):
      print("bench/suite.py gpu runs its stages on a GPU, and JAX sees none here: nothing to do (--render "
            "rewrites a report from results already there)", file=sys.stderr)
      return 0
  if not args.render:
    model = args.model or (GPU_MODEL if args.target == "gpu" else CPU_MODEL)
    table = stages(args.target, d, args.pairs, model)
    unknown = set(args.stages or ()) - set(table)
    if unknown:
      raise SystemExit(f"unknown stages {sorted(unknown)}: choose from {sorted(table)}")
    for name, (limit, commands, files) in table.items():
      if args.stages and name not in args.stages:
        continue
      print(f"[suite] {name} ...", file=sys.stderr, flush=True)
      status[name] = run_stage(name, limit, commands, files, d)
      print(f"[suite] {name}: {status[name]['status']} in {status[name]['seconds']} s", file=sys.stderr, flush=True)
      with open(status_path, "w") as f:
        json.dump(list(status.values()), f, indent=1)
  with open(d + ".md", "w") as f:
    f.write(render(args.target, d, list(status.values())))
  print(f"[suite] wrote {d}.md", file=sys.stderr)
  if args.render:
    return 0
  return 0 if all(s["status"] == "ok" for s in status.values()) else 1   # a failed stage fails the run


if __name__ == "__main__":
  sys.exit(main())
