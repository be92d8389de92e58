"""The scaling study of issue 36: presets x batches, every jaxllm path beside llama.cpp, one table and one plot.

  python bench/scaling.py --dir docs/results/<date>-h200-scaling-run \\
      --llama-bench llama.cpp/build/bin/llama-bench --llama-batched-bench llama.cpp/build/bin/llama-batched-bench \\
      --vocab vocab.gguf --time-limit 540 --check
  python bench/scaling.py --dir /tmp/s --presets tiny --batches 1,2 --prompt-len 16 --decode-len 18 --repeat 1

For each preset (default: qwen2.5-0.5b and every 1B-14B preset) and batch (default 1, 16, 64), one process of
`python -m jaxllm.bench synthetic:<preset> --batch B --kernels auto,ffi-unfused,xla --loop pipelined`. Its
records carry only the path that ran (auto resolves to one), so this script tags each with the path asked for
(`requested_kernels`, by their order) before appending them to <dir>/scaling.jsonl. With --llama-bench and/or
--llama-batched-bench, the preset's GGUFs (random Q8_0 and Q4_0 blocks, bench/peers/random_gguf.py, from
--vocab) are written by a background process while jaxllm runs the preset before, run through
`llama-bench -ngl 99 -fa 1 -p 0 -n N -r R -o jsonl` (batch 1) and `llama-batched-bench -ngl 99 -fa on -npp P
-ntg N -npl <batches>` (every batch), parsed into the same JSONL (label llama.cpp, `peer` the tool), and
deleted unless --keep-gguf (all presets' files at once would overfill a 64 GB disk). --prefill P1,P2 adds, per
preset, the TTFT of one prompt of each length at batch 1 (`jaxllm.bench --prompt-len P --decode-len 18`, records
with `study` "prefill") beside `llama-bench -p P1,P2 -n 0` (P over its tokens per second), as a second table.

Runs already in the JSONL are skipped (resume over several machine calls). --time-limit S: no run starts past
S seconds, and a run still going at S is killed; the report is written from what finished. The report
(<dir>.md, plot <dir>/scaling.png; --render writes only it) has a row per preset and batch: auto's TPOT,
total tok/s, % of the weight-byte floor and peak device memory, the other paths' TPOT, llama.cpp's total tok/s
with auto's ratio to it, and whether auto is within 3% of the best other path (issue 36's acceptance);
--check exits 1 when a row fails or lacks records. Logs: <dir>/logs/.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PRESETS = ("qwen2.5-0.5b", "llama-3.2-1b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "llama-3.1-8b", "qwen3-8b",
           "qwen2.5-14b")
BATCHES = (1, 16, 64)
PATHS = ("auto", "ffi-unfused", "xla")
PEER_TYPES = ("Q8_0", "Q4_0")
TOLERANCE = 0.03                 # auto may be this much slower than the best other path


def _ints(text: str, what: str) -> list[int]:
  try:
    values = [int(v) for v in text.split(",") if v.strip()]
  except ValueError:
    values = []
  if not values or min(values) < 1:
    raise SystemExit(f"error: {what} takes positive integers separated by commas, got {text!r}")
  return values


def _names(text: str) -> list[str]:
  return [v.strip() for v in text.split(",") if v.strip()]


def _presets(text: str) -> list[str]:
  """--presets' names, each one of jaxllm/presets.py's (else a one-line error naming them)."""
  from jaxllm.presets import PRESETS as KNOWN
  names = _names(text)
  bad = [n for n in names if n not in KNOWN]
  if bad or not names:
    raise SystemExit(f"error: unknown preset(s) {bad or names}: choose from {', '.join(sorted(KNOWN))}")
  return names


def read_jsonl(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _append(path: str, records: list[dict]) -> None:
  with open(path, "a") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)


# ---- llama.cpp's outputs --------------------------------------------------------------------------------------

def _peer_record(peer: str, preset: str, qtype: str, batch: int, prompt: int, gen: int, tok_s_total: float,
                 raw: dict) -> dict:
  per_seq = tok_s_total / batch
  return {"schema_version": 2, "label": "llama.cpp", "peer": peer, "kernels": "llama.cpp",
          "model": f"synthetic:{preset}", "preset": preset, "synthetic": True, "quant": qtype, "loop": "llama.cpp",
          "batch": batch, "prompt_len": prompt,
          "decode_len": gen, "tpot_ms_mean": 1e3 / per_seq, "decode_tok_s": per_seq, "decode_tok_s_total": tok_s_total,
          "peak_memory_bytes": None, "raw": raw}


def _json_lines(text: str):
  """The JSON objects among text's lines (llama-bench -o jsonl; other lines, e.g. CUDA's start-up, skipped)."""
  for line in text.splitlines():
    line = line.strip()
    if line.startswith("{"):
      try:
        yield json.loads(line)
      except json.JSONDecodeError:
        continue


def parse_llama_bench(text: str, preset: str, qtype: str) -> list[dict]:
  """Records from `llama-bench -o jsonl` output: its decode tests (n_prompt 0, n_gen > 0), batch 1, tok/s avg_ts."""
  out = []
  for r in _json_lines(text):
    if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0 and "avg_ts" in r:
      raw = {k: r.get(k) for k in ("build_commit", "build_number", "gpu_info", "backends", "model_type", "model_size",
                                   "n_gpu_layers", "flash_attn", "n_gen", "n_depth", "avg_ts", "stddev_ts",
                                   "samples_ts", "test_time")}
      out.append(_peer_record("llama-bench", preset, qtype, 1, 0, r["n_gen"], float(r["avg_ts"]), raw))
  return out


def parse_llama_prefill(text: str, preset: str, qtype: str) -> list[dict]:
  """Records from `llama-bench -o jsonl` output's prompt tests (n_gen 0, n_prompt P > 0): the time to process P
  tokens, ttft_ms = P / avg_ts (peer "llama-bench-prefill", study "prefill")."""
  out = []
  for r in _json_lines(text):
    if r.get("n_gen", 0) == 0 and r.get("n_prompt", 0) > 0 and r.get("avg_ts"):
      raw = {k: r.get(k) for k in ("build_commit", "gpu_info", "model_type", "n_prompt", "n_batch", "n_ubatch",
                                   "flash_attn", "avg_ts", "stddev_ts", "samples_ts")}
      out.append({"schema_version": 2, "label": "llama.cpp", "peer": "llama-bench-prefill", "study": "prefill",
                  "kernels": "llama.cpp", "model": f"synthetic:{preset}", "preset": preset, "synthetic": True,
                  "quant": qtype, "batch": 1, "prompt_len": int(r["n_prompt"]),
                  "ttft_ms": 1e3 * r["n_prompt"] / float(r["avg_ts"]), "raw": raw})
  return out


_BATCHED_COLUMNS = ("pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed")


def parse_batched_bench(text: str, preset: str, qtype: str) -> list[dict]:
  """Records from llama-batched-bench's table (`|    PP |     TG |    B | ... | S_TG t/s | ...`) or its
  `--output-format jsonl` lines: one per row, batch B = pl, total decode tok/s = S_TG (speed_tg)."""
  out = []
  for line in text.splitlines():
    line = line.strip()
    row = None
    if line.startswith("{") and "speed_tg" in line:
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        continue
    elif line.startswith("|"):
      cells = [c.strip() for c in line.strip("|").split("|")]
      try:
        row = dict(zip(_BATCHED_COLUMNS, (float(c) for c in cells))) if len(cells) == 10 else None
      except ValueError:
        continue                   # the header and its rule
    if row:
      raw = {k: row[k] for k in _BATCHED_COLUMNS}
      out.append(_peer_record("llama-batched-bench", preset, qtype, int(row["pl"]), int(row["pp"]), int(row["tg"]),
                              float(row["speed_tg"]), raw))
  return out


# ---- running --------------------------------------------------------------------------------------------------

class Runner:
  """Runs commands in order under the study's time limit, logging each into <dir>/logs/."""

  def __init__(self, d: str, time_limit: float | None, tag: str = "scaling"):
    self.logs, self.tag = os.path.join(d, "logs"), tag
    os.makedirs(self.logs, exist_ok=True)
    self.t0, self.limit, self.notes = time.monotonic(), time_limit, []

  def left(self) -> float | None:
    return None if self.limit is None else self.limit - (time.monotonic() - self.t0)

  def out_of_time(self) -> bool:
    left = self.left()
    return left is not None and left <= 0

  def run(self, name: str, cmd: list[str], stdout_path: str | None = None) -> bool:
    """Runs cmd (stdout into stdout_path, else into the log with stderr); False when it failed or was cut."""
    if self.out_of_time():
      self.notes.append(f"{name}: not started (time limit)")
      return False
    log_path = os.path.join(self.logs, f"{name}.log")
    with open(log_path, "w") as log, open(stdout_path or os.devnull, "w") as so:
      log.write("$ " + " ".join(cmd) + "\n")
      log.flush()
      print(f"[{self.tag}] {name}: {' '.join(cmd)}", file=sys.stderr)
      try:
        rc = subprocess.run(cmd, stdout=so if stdout_path else log, stderr=log, timeout=self.left()).returncode
      except subprocess.TimeoutExpired:
        self.notes.append(f"{name}: cut at the time limit ({self.limit:.0f} s); logs/{name}.log")
        return False
      except OSError as e:
        self.notes.append(f"{name}: could not start ({e})")
        return False
    if rc:
      self.notes.append(f"{name}: exit status {rc}; logs/{name}.log")
    return rc == 0


def _jaxllm_done(records: list[dict], preset: str, batch: int, paths: list[str]) -> bool:
  have = {r.get("requested_kernels") for r in records
          if r.get("label") != "llama.cpp" and r.get("model") == f"synthetic:{preset}" and r.get("batch") == batch}
  return set(paths) <= have


def _bench(runner: Runner, name: str, preset: str, args: list[str]) -> list[dict] | None:
  """`python -m jaxllm.bench synthetic:<preset> --loop pipelined ARGS` as run `name`: its records, or None when it
  failed or was cut."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "out.jsonl")
    cmd = [sys.executable, "-m", "jaxllm.bench", f"synthetic:{preset}", "--loop", "pipelined", *args, "--out", out]
    return read_jsonl(out) if runner.run(name, cmd) else None


def run_jaxllm(runner: Runner, jsonl: str, preset: str, batch: int, paths: list[str], bench_args: list[str]) -> None:
  records = _bench(runner, f"{preset}-b{batch}", preset, ["--batch", str(batch), "--kernels", ",".join(paths),
                                                          "--label", f"scaling {preset} b{batch}", *bench_args])
  if records is not None and len(records) != len(paths):
    runner.notes.append(f"{preset}-b{batch}: {len(records)} records for {len(paths)} paths; none kept")
    return
  for path, rec in zip(paths, records or []):   # jaxllm.bench writes one record a path, in --kernels order
    rec["requested_kernels"], rec["preset"] = path, preset
  _append(jsonl, records or [])


def _prefill_done(records: list[dict], preset: str, prompt: int) -> bool:
  return any(r.get("study") == "prefill" and r.get("label") != "llama.cpp" and r.get("preset") == preset
             and r.get("prompt_len") == prompt for r in records)


def run_jaxllm_prefill(runner: Runner, jsonl: str, preset: str, prompt: int, repeat: int) -> None:
  """TTFT of one prompt of `prompt` tokens at batch 1 on the default path (chunked flash prefill)."""
  records = _bench(runner, f"{preset}-prefill-{prompt}", preset,
                   ["--batch", "1", "--kernels", "auto", "--prompt-len", str(prompt), "--decode-len", "18",
                    "--repeat", str(repeat), "--label", f"prefill {preset} p{prompt}"]) or []
  for rec in records:
    rec["study"], rec["preset"] = "prefill", preset
  _append(jsonl, records)


def _gguf_path(gdir: str, preset: str, qtype: str) -> str:
  return os.path.join(gdir, f"{preset}-{qtype}.gguf")


def _write_ggufs(runner: Runner, gdir: str, preset: str, vocab: str, types: list[str]) -> threading.Thread:
  """Writes the preset's GGUFs in the background (one process a file), returning the thread doing it."""
  def work():
    for t in types:
      path = _gguf_path(gdir, preset, t)
      if not os.path.exists(path):
        runner.run(f"gguf-{preset}-{t}", [sys.executable, os.path.join(HERE, "peers", "random_gguf.py"), "model",
                                          preset, vocab, path + ".part", "--type", t])
        if os.path.exists(path + ".part"):
          os.replace(path + ".part", path)
  thread = threading.Thread(target=work, daemon=True)
  thread.start()
  return thread


def run_peers(runner: Runner, args, jsonl: str, preset: str, qtype: str, gguf: str, done: list[dict]) -> None:
  def have(peer, batch):
    return any(r.get("peer") == peer and r.get("preset") == preset and r.get("quant") == qtype and r["batch"] == batch
               for r in done)
  if not os.path.exists(gguf):
    runner.notes.append(f"llama.cpp {preset} {qtype}: no GGUF (see logs/gguf-{preset}-{qtype}.log)")
    return
  gen, reps = str(args.decode_len), str(args.repeat)
  if args.llama_bench and 1 in args.batches and not have("llama-bench", 1):
    out = os.path.join(runner.logs, f"llama-bench-{preset}-{qtype}.jsonl")
    if runner.run(f"llama-bench-{preset}-{qtype}", [args.llama_bench, "-m", gguf, "-ngl", "99", "-fa", "1", "-p", "0",
                                                    "-n", gen, "-r", reps, "-o", "jsonl"], out):
      with open(out) as f:
        _append(jsonl, parse_llama_bench(f.read(), preset, qtype))
  prompts = [p for p in args.prefill if not any(r.get("peer") == "llama-bench-prefill" and r.get("preset") == preset
                                                and r.get("quant") == qtype and r.get("prompt_len") == p for r in done)]
  if args.llama_bench and prompts:
    out = os.path.join(runner.logs, f"llama-bench-prefill-{preset}-{qtype}.jsonl")
    if runner.run(f"llama-bench-prefill-{preset}-{qtype}",
                  [args.llama_bench, "-m", gguf, "-ngl", "99", "-fa", "1", "-p", ",".join(map(str, prompts)), "-n", "0",
                   "-r", reps, "-o", "jsonl"], out):
      with open(out) as f:
        _append(jsonl, [r for r in parse_llama_prefill(f.read(), preset, qtype) if r["prompt_len"] in prompts])
  todo = [b for b in args.batches if not have("llama-batched-bench", b)]
  if args.llama_batched_bench and todo:
    out = os.path.join(runner.logs, f"llama-batched-bench-{preset}-{qtype}.txt")
    ctx = max(todo) * (args.prompt_len + args.decode_len) + 64
    if runner.run(f"llama-batched-bench-{preset}-{qtype}",
                  [args.llama_batched_bench, "-m", gguf, "-ngl", "99", "-fa", "on", "-c", str(ctx), "-b", "2048",
                   "-ub", "512", "-npp", str(args.prompt_len), "-ntg", gen, "-npl", ",".join(map(str, todo))], out):
      with open(out) as f:
        _append(jsonl, [r for r in parse_batched_bench(f.read(), preset, qtype) if r["batch"] in todo])


def _peers_done(done: list[dict], args, preset: str, qtype: str) -> bool:
  have = {(r.get("peer"), r["prompt_len"] if r.get("study") == "prefill" else r["batch"]) for r in done
          if r.get("preset") == preset and r.get("quant") == qtype}
  need = ({("llama-bench", 1)} if args.llama_bench and 1 in args.batches else set()) | \
      ({("llama-bench-prefill", p) for p in args.prefill} if args.llama_bench else set()) | \
      ({("llama-batched-bench", b) for b in args.batches} if args.llama_batched_bench else set())
  return need <= have


def run_study(args) -> list[str]:
  """Runs what the JSONL lacks; returns notes on runs that failed or did not start."""
  jsonl = os.path.join(args.dir, "scaling.jsonl")
  runner = Runner(args.dir, args.time_limit)
  peers = bool(args.llama_bench or args.llama_batched_bench)
  gdir = args.gguf_dir or os.path.join(args.dir, "gguf")
  if peers:
    os.makedirs(gdir, exist_ok=True)
  writers: dict[str, threading.Thread] = {}

  def start_writer(preset):
    done = read_jsonl(jsonl)
    types = [t for t in args.peer_types if not _peers_done(done, args, preset, t)]
    if peers and types and preset not in writers:
      writers[preset] = _write_ggufs(runner, gdir, preset, args.vocab, types)

  for i, preset in enumerate(args.presets):
    start_writer(preset)
    for batch in args.batches:
      if not _jaxllm_done(read_jsonl(jsonl), preset, batch, args.kernels):
        run_jaxllm(runner, jsonl, preset, batch, args.kernels, args.bench_args)
    for prompt in args.prefill:
      if not _prefill_done(read_jsonl(jsonl), preset, prompt):
        run_jaxllm_prefill(runner, jsonl, preset, prompt, args.repeat)
    if i + 1 < len(args.presets):
      start_writer(args.presets[i + 1])      # the next preset's files are written while this one's peers run
    if peers and preset in writers:
      writers[preset].join(runner.left())
      for t in args.peer_types:
        gguf = _gguf_path(gdir, preset, t)
        if not _peers_done(read_jsonl(jsonl), args, preset, t):
          run_peers(runner, args, jsonl, preset, t, gguf, read_jsonl(jsonl))
        if not args.keep_gguf and os.path.exists(gguf):
          os.remove(gguf)
  return runner.notes


# ---- report ---------------------------------------------------------------------------------------------------

def check_rows(records: list[dict], presets: list[str], batches: list[int]) -> list[dict]:
  """Per preset and batch: auto's record, the best other path, and whether auto's TPOT is within TOLERANCE of it
  (status "ok", "slower", or "missing" where auto or every other path has no record)."""
  rows = []
  for preset in presets:
    for batch in batches:
      ours = {r["requested_kernels"]: r for r in records if r.get("requested_kernels") and r.get("preset") == preset
              and r["batch"] == batch}
      auto = ours.get("auto")
      others = [r for k, r in ours.items() if k != "auto"]
      best = min(others, key=lambda r: r["tpot_ms_mean"]) if others else None
      if auto is None or best is None:
        status = "missing"
      else:
        status = "ok" if auto["tpot_ms_mean"] <= (1 + TOLERANCE) * best["tpot_ms_mean"] else "slower"
      rows.append({"preset": preset, "batch": batch, "paths": ours, "auto": auto, "best": best, "status": status})
  return rows


def _peer_for(records: list[dict], preset: str, batch: int, qtype: str) -> dict | None:
  """llama.cpp's record: llama-bench at batch 1 where it ran, else llama-batched-bench."""
  found = {r["peer"]: r for r in records if r.get("label") == "llama.cpp" and r.get("preset") == preset
           and r.get("quant") == qtype and r["batch"] == batch}
  return found.get("llama-bench") if batch == 1 and "llama-bench" in found else found.get("llama-batched-bench")


def _check_line(row: dict) -> str:
  head = f"{row['preset']} batch {row['batch']}"
  if row["status"] == "missing":
    others = len(row["paths"]) - bool(row["auto"])
    return f"- {head}: MISSING (auto: {'yes' if row['auto'] else 'no'}, other paths: {others})"
  a, b = row["auto"], row["best"]
  word = "ok" if row["status"] == "ok" else "FAIL"
  return (f"- {head}: {word}: auto ({a['kernels']}) {a['tpot_ms_mean']:.3f} ms against {b['requested_kernels']} "
          f"{b['tpot_ms_mean']:.3f} ms ({a['tpot_ms_mean'] / b['tpot_ms_mean'] - 1:+.1%}; allowed +{TOLERANCE:.0%})")


def _prefill_lines(records: list[dict], presets: list[str], prompts: list[int], types: list[str]) -> list[str]:
  """The prefill table: per preset and prompt length, jaxllm's TTFT and llama-bench's prompt time."""
  def find(preset, prompt, peer):
    got = [r for r in records if r.get("study") == "prefill" and r.get("preset") == preset
           and r.get("prompt_len") == prompt and (r.get("label") == "llama.cpp") == (peer is not None)
           and (peer is None or r.get("quant") == peer)]
    return got[-1] if got else None
  head = ["preset", "prompt", "jaxllm TTFT (ms)", *[f"llama.cpp {t} (ms; it / jaxllm)" for t in types]]
  lines = ["", "Prefill at batch 1: the time to the first token of one prompt (jaxllm: the default path, chunked "
           "flash prefill, median of the timed requests; llama.cpp: llama-bench's prompt test, -p P -n 0, P over "
           "its tokens per second).", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for preset in presets:
    for prompt in prompts:
      ours = find(preset, prompt, None)
      cells = [preset, str(prompt), f"{ours['ttft_ms']:.1f}" if ours else "-"]
      for t in types:
        peer = find(preset, prompt, t)
        cells.append("-" if not peer else f"{peer['ttft_ms']:.1f}" +
                     (f" ({peer['ttft_ms'] / ours['ttft_ms']:.2f}x)" if ours else ""))
      lines.append("| " + " | ".join(cells) + " |")
  return lines


def report(records: list[dict], presets: list[str], batches: list[int], paths: list[str], types: list[str],
           title: str, png: str | None, notes: list[str], prefill: list[int] = ()) -> tuple[str, bool]:
  """The markdown report and whether every row passed the check."""
  rows = check_rows(records, presets, batches)
  others = [p for p in paths if p != "auto"]
  env = next((r["env"] for r in records if r.get("env")), {})
  lines = [f"# {title}", "", f"Device: {env.get('device', 'n/a')} ({env.get('platform', 'n/a')}), jaxllm commit "
           f"{env.get('git_commit', 'n/a')}, jax {env.get('jax', 'n/a')}. TPOT is a decode step of the whole batch "
           "(ms); total tok/s counts every row; % of floor is the weight-byte floor (weights read once at the "
           "measured copy bandwidth) over auto's TPOT; llama.cpp: total decode tok/s (llama-bench at batch 1, "
           "llama-batched-bench's S_TG above), with auto's total over it.", ""]
  head = ["preset", "batch", "auto: TPOT (ms)", "total tok/s", "% of floor", "peak device (GB)",
          *[f"{p} TPOT" for p in others], *[f"llama.cpp {t} tok/s (auto / it)" for t in types], "auto within 3%"]
  lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for row in rows:
    a = row["auto"]
    cells = [row["preset"], str(row["batch"])]
    if a:
      floor = a.get("byte_floor_ms")
      peak = a.get("peak_memory_bytes")
      cells += [f"{a['tpot_ms_mean']:.3f} ({a['kernels']})", f"{a['decode_tok_s_total']:,.0f}",
                f"{100 * floor / a['tpot_ms_mean']:.0f}%" if floor else "n/a",
                f"{peak / 1e9:.2f}" if peak else "n/a"]
    else:
      cells += ["-"] * 4
    cells += [f"{row['paths'][p]['tpot_ms_mean']:.3f}" if p in row["paths"] else "-" for p in others]
    for t in types:
      peer = _peer_for(records, row["preset"], row["batch"], t)
      if peer and a:
        cells.append(f"{peer['decode_tok_s_total']:,.0f} ({a['decode_tok_s_total'] / peer['decode_tok_s_total']:.2f}x)")
      else:
        cells.append(f"{peer['decode_tok_s_total']:,.0f}" if peer else "-")
    cells.append({"ok": "yes", "slower": "**no**", "missing": "-"}[row["status"]])
    lines.append("| " + " | ".join(cells) + " |")
  if prefill:
    lines += _prefill_lines(records, presets, list(prefill), types)
  lines += ["", "Check (issue 36: auto at most 3% slower than the best other path):", ""]
  lines += [_check_line(row) for row in rows]
  if notes:
    lines += ["", "Notes (runs that did not finish, what is missing):", ""] + [f"- {n}" for n in notes]
  if png:
    lines += ["", f"![tok/s against batch]({png})"]
  return "\n".join(lines) + "\n", all(row["status"] == "ok" for row in rows)


def plot(records: list[dict], presets: list[str], batches: list[int], paths: list[str], types: list[str],
         path: str) -> None:
  """Total tok/s against batch, a panel per preset: each jaxllm path, llama.cpp per block type dashed."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  cols = min(4, len(presets))
  fig, axes = plt.subplots(-(-len(presets) // cols), cols, figsize=(4 * cols, 3.2 * -(-len(presets) // cols)),
                           squeeze=False)
  for ax, preset in zip(axes.flat, presets):
    series = [(p, [r for r in records if r.get("preset") == preset and r.get("requested_kernels") == p], "o-")
              for p in paths]
    series += [(f"llama.cpp {t}", [q for q in (_peer_for(records, preset, b, t) for b in batches) if q], "s--")
               for t in types]
    for label, recs, style in series:
      pts = sorted((r["batch"], r["decode_tok_s_total"]) for r in recs if r["batch"] in batches)
      if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_title(preset, fontsize=9)
    ax.set_xlabel("batch")
    ax.set_ylabel("total decode tok/s")
    ax.legend(fontsize=6)
  for ax in list(axes.flat)[len(presets):]:
    ax.axis("off")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def write_report(args, notes: list[str]) -> bool:
  records = read_jsonl(os.path.join(args.dir, "scaling.jsonl"))
  base = os.path.basename(os.path.normpath(args.dir))
  try:
    plot(records, args.presets, args.batches, args.kernels, args.peer_types, os.path.join(args.dir, "scaling.png"))
    png = f"{base}/scaling.png"
  except ImportError as e:                   # the table still gets written
    notes, png = notes + [f"no plot: {e}"], None
  text, ok = report(records, args.presets, args.batches, args.kernels, args.peer_types,
                    "jaxllm over presets and batches, beside llama.cpp", png, notes, args.prefill)
  with open(os.path.normpath(args.dir) + ".md", "w") as f:
    f.write(text)
  print(text, file=sys.stderr)
  return ok


def build_parser():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--dir", required=True, help="the study's folder (JSONL, logs, plot); the report is <dir>.md")
  p.add_argument("--presets", default=",".join(PRESETS), help="comma list of jaxllm/presets.py names")
  p.add_argument("--batches", default=",".join(map(str, BATCHES)))
  p.add_argument("--kernels", default=",".join(PATHS), help="jaxllm paths, auto first (default auto,ffi-unfused,xla)")
  p.add_argument("--prompt-len", type=int, default=128)
  p.add_argument("--decode-len", type=int, default=128)
  p.add_argument("--repeat", type=int, default=3, help="timed requests per jaxllm path; llama-bench -r")
  p.add_argument("--prefill", default="", help="prompt lengths whose TTFT is measured at batch 1 (e.g. 2048,8192; "
                 "llama-bench -p beside it); default none")
  p.add_argument("--llama-bench", metavar="PATH", help="llama.cpp's llama-bench binary (batch 1)")
  p.add_argument("--llama-batched-bench", metavar="PATH", help="llama.cpp's llama-batched-bench binary")
  p.add_argument("--vocab", help="tokenizer GGUF for the peers' files (random_gguf.py vocab)")
  p.add_argument("--peer-types", default=",".join(PEER_TYPES), help="block types of the peers' GGUFs")
  p.add_argument("--gguf-dir", help="where the peers' GGUFs are written (default <dir>/gguf)")
  p.add_argument("--keep-gguf", action="store_true", help="keep each preset's GGUFs after its peers ran")
  p.add_argument("--time-limit", type=float, help="seconds: no run starts past it, a run going at it is killed")
  p.add_argument("--render", action="store_true", help="only write the report from the JSONL")
  p.add_argument("--check", action="store_true", help="exit 1 unless auto is within 3%% on every row")
  return p


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  args.presets, args.batches = _presets(args.presets), _ints(args.batches, "--batches")
  args.kernels, args.peer_types = _names(args.kernels), _names(args.peer_types)
  args.prefill = _ints(args.prefill, "--prefill") if args.prefill.strip() else []
  # auto first: a process's peak device memory only grows, so the first path's record holds its own peak
  if not args.kernels or args.kernels[0] != "auto" or len(set(args.kernels)) != len(args.kernels):
    raise SystemExit(f"error: --kernels must list auto first and each path once, got {','.join(args.kernels)!r}")
  bad_types = [t for t in args.peer_types if t not in ("Q8_0", "Q4_0", "Q4_K")]
  if bad_types:
    raise SystemExit(f"error: --peer-types takes Q8_0, Q4_0, Q4_K; got {bad_types}")
  for name in ("llama_bench", "llama_batched_bench"):
    binary = getattr(args, name)
    if binary and not args.render and not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
      raise SystemExit(f"error: --{name.replace('_', '-')} {binary!r} is not an executable file")
  peers = args.llama_bench or args.llama_batched_bench
  if peers and not args.render and not (args.vocab and os.path.isfile(args.vocab)):
    raise SystemExit(f"error: the llama.cpp peers need --vocab FILE (random_gguf.py vocab MODEL FILE), got "
                     f"{args.vocab!r}")
  args.bench_args = ["--prompt-len", str(args.prompt_len), "--decode-len", str(args.decode_len), "--repeat",
                     str(args.repeat)]
  try:
    os.makedirs(args.dir, exist_ok=True)
  except OSError as e:
    raise SystemExit(f"error: cannot make --dir {args.dir!r}: {e}") from None
  notes = [] if args.render else run_study(args)
  ok = write_report(args, notes)
  return 1 if args.check and not ok else 0


if __name__ == "__main__":
  sys.exit(main())
