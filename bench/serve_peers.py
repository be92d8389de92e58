"""jaxllm's server beside llama-server (issue 38): the same GGUF, the same load generator, N concurrent streams.

  python bench/serve_peers.py --dir docs/results/<date>-h200-serve --presets qwen2.5-0.5b,qwen2.5-7b \\
      --llama-server llama.cpp/build/bin/llama-server --vocab vocab.gguf --time-limit 540
  python bench/serve_peers.py --dir /tmp/s --presets tiny --concurrency 1,2 --prompt-len 8 --max-tokens 8

For each preset: a GGUF of its shape with random blocks (--type, default Q8_0; bench/peers/random_gguf.py from
--vocab, a tokenizer GGUF), then each server in turn on that file: `python -m jaxllm.serve FILE --max-batch
<most streams> --max-context <prompt + answer>` and, with --llama-server, `llama-server -m FILE -ngl 99 -fa on -np
<most streams> -c <streams x context>`. Each is waited for (GET /health answers 200; at most --start-timeout
seconds, and never past the time limit), loaded by `python -m jaxllm.serve.loadgen` at every --concurrency level
(token-id prompts of --prompt-len, --max-tokens new tokens with ignore_eos: the same work on both), then stopped
(SIGINT, SIGKILL after 15 s). The load generator's records (TTFT, TPOT, inter-token and end-to-end latency
percentiles, output tok/s over all streams) are tagged with the server and preset and appended to
<dir>/serve.jsonl; jaxllm's also carry the XLA compiles its /metrics counted while it served. Records already
in the JSONL (the same server, preset, block type and lengths, with requests completed) are skipped (resume
over several machine calls). Every wait is bounded: a server's start by --start-timeout, a request's reads by
--request-timeout, and with --time-limit S nothing starts past S seconds and what still runs at S is killed; a
server's port must be free before it starts, and it must list the served name (GET /v1/models) to count as
ready, so a server left over from an earlier run is never the one measured; SIGTERM stops the servers this
started. The report (<dir>.md) is written from what finished, with a line for each run that did not. Logs (the servers', the writer's, the load generator's):
<dir>/logs/. The report's check is issue 38's goal: at 32 and 64 streams, jaxllm's output tok/s at least 2x
llama-server's at no worse p99 TPOT; --check exits 1 when a level fails it or lacks records.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
# bench/scaling.py: on the path as this script's folder when run; tests load both from their files (bench/ stays
# off sys.path there: its kernels.py would shadow the `kernels` package transformers imports).
from scaling import Runner, _append, _ints, _presets, read_jsonl  # noqa: E402

SERVERS = ("jaxllm", "llama-server")
GOAL_LEVELS = (32, 64)          # issue 38: at these many streams,
GOAL_RATIO = 2.0                # at least this many times llama-server's output tok/s, at no worse p99 TPOT


def _get(url: str, timeout: float = 2.0) -> tuple[int, str]:
  try:
    with urllib.request.urlopen(url, timeout=timeout) as r:
      return r.status, r.read().decode(errors="replace")
  except urllib.error.HTTPError as e:
    return e.code, ""
  except (OSError, ValueError):
    return 0, ""


def _port_free(port: int) -> bool:
  with socket.socket() as sock:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      sock.bind(("127.0.0.1", port))
    except OSError:
      return False
  return True


def _compiles(metrics: str) -> int | None:
  """jaxllm_xla_compiles_while_serving_total from /metrics text, None if absent."""
  for line in metrics.splitlines():
    if line.startswith("jaxllm_xla_compiles_while_serving_total"):
      return int(float(line.split()[-1]))
  return None


class Server:
  """One server process: started, waited for, stopped; its output in logs/<name>.log."""

  def __init__(self, runner: Runner, name: str, cmd: list[str], port: int):
    self.runner, self.name, self.cmd, self.port = runner, name, cmd, port
    self.url = f"http://127.0.0.1:{port}"
    self.log = open(os.path.join(runner.logs, f"{name}.log"), "w")
    self.log.write("$ " + " ".join(cmd) + "\n")
    self.log.flush()
    print(f"[serve_peers] {name}: {' '.join(cmd)}", file=sys.stderr)
    self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

  def wait_ready(self, timeout: float) -> bool:
    """True once GET /health answers 200 and GET /v1/models lists the served name "m" (this server, not another
    on the port); False (with a note) if the process ends or the time runs out first."""
    left = self.runner.left()
    deadline = time.monotonic() + (timeout if left is None else max(0.0, min(timeout, left)))
    while time.monotonic() < deadline:
      if self.proc.poll() is not None:
        self.runner.notes.append(f"{self.name}: exited with status {self.proc.returncode} before it was ready; "
                                 f"logs/{self.name}.log")
        return False
      if _get(self.url + "/health")[0] == 200:
        status, body = _get(self.url + "/v1/models")
        if status == 200 and '"m"' in body:
          return True
      time.sleep(0.5)
    self.runner.notes.append(f"{self.name}: not ready within {timeout:.0f} s (or the time limit); logs/{self.name}.log")
    return False

  def stop(self) -> None:
    """SIGINT to the server's process group; SIGKILL after 15 s (less when the time limit is nearer)."""
    if self.proc.poll() is None:
      os.killpg(self.proc.pid, signal.SIGINT)
      left = self.runner.left()
      try:
        self.proc.wait(15 if left is None else min(15.0, max(1.0, left)))
      except subprocess.TimeoutExpired:
        os.killpg(self.proc.pid, signal.SIGKILL)
        try:
          self.proc.wait(10)
        except subprocess.TimeoutExpired:
          self.runner.notes.append(f"{self.name}: still there 10 s after SIGKILL (pid {self.proc.pid})")
    self.log.close()


def _mine(r: dict, args, server: str, preset: str) -> bool:
  """Whether record r is of this server and preset at this run's block type and lengths."""
  return (r.get("server") == server and r.get("preset") == preset and r.get("quant") == args.type
          and r.get("prompt_len") == args.prompt_len and r.get("max_tokens") == args.max_tokens)


def _done(records: list[dict], args, server: str, preset: str, level: int) -> bool:
  return any(_mine(r, args, server, preset) and r.get("concurrency") == level and r.get("completed") for r in records)


def _context(args) -> int:
  return args.prompt_len + args.max_tokens + 16


def server_command(args, server: str, gguf: str, port: int) -> list[str]:
  streams = max(args.concurrency)
  if server == "jaxllm":
    return [sys.executable, "-m", "jaxllm.serve", gguf, "--port", str(port), "--max-batch", str(streams),
            "--max-context", str(_context(args)), "--served-model-name", "m", "--max-waiting",
            str(4 * streams), *args.jaxllm_args]
  return [args.llama_server, "-m", gguf, "--port", str(port), "--host", "127.0.0.1", "-ngl", "99", "-fa", "on",
          "-np", str(streams), "-c", str(streams * _context(args)), "-a", "m", *args.llama_args]


def run_server(runner: Runner, args, jsonl: str, server: str, preset: str, gguf: str, port: int,
               levels: list[int]) -> None:
  """One server on the GGUF, the load generator at each level it lacks (one process a level, so that jaxllm's
  compile counter is read around each), then stopped."""
  name = f"{server}-{preset}"
  if runner.out_of_time():
    runner.notes.append(f"{name}: not started (time limit)")
    return
  if not _port_free(port):
    runner.notes.append(f"{name}: port {port} is taken (a server left from an earlier run?); not started")
    return
  s = Server(runner, name, server_command(args, server, gguf, port), port)
  try:
    if not s.wait_ready(args.start_timeout):
      return
    for level in levels:
      before = _compiles(_get(s.url + "/metrics")[1]) if server == "jaxllm" else None
      out = os.path.join(runner.logs, f"load-{name}-c{level}.jsonl")
      if os.path.exists(out):
        os.remove(out)
      runner.run(f"load-{name}-c{level}", [sys.executable, "-m", "jaxllm.serve.loadgen", s.url, "--concurrency",
                                           str(level), "--prompt-len", str(args.prompt_len), "--max-tokens",
                                           str(args.max_tokens), "--model", "m", "--vocab", str(args.prompt_vocab),
                                           "--timeout", str(args.request_timeout), "--json", out])
      records = read_jsonl(out)
      compiled = None
      if server == "jaxllm":
        metrics = _get(s.url + "/metrics")[1]
        with open(os.path.join(runner.logs, f"metrics-{preset}-c{level}.txt"), "w") as f:
          f.write(metrics)
        after = _compiles(metrics)
        compiled = None if before is None or after is None else after - before
      for r in records:
        r.update(server=server, preset=preset, quant=args.type, label=f"serve {server} {preset}")
        if server == "jaxllm":
          r["compiles_while_loaded"] = compiled
      _append(jsonl, records)
  finally:
    s.stop()


def write_gguf(runner: Runner, args, preset: str) -> str | None:
  path = os.path.join(args.gguf_dir or os.path.join(args.dir, "gguf"), f"{preset}-{args.type}.gguf")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  if not os.path.exists(path):
    if runner.run(f"gguf-{preset}", [sys.executable, os.path.join(HERE, "peers", "random_gguf.py"), "model", preset,
                                     args.vocab, path + ".part", "--type", args.type]):
      os.replace(path + ".part", path)
  if not os.path.exists(path):
    runner.notes.append(f"{preset}: no GGUF (logs/gguf-{preset}.log)")
    return None
  return path


def run_study(args) -> list[str]:
  jsonl = os.path.join(args.dir, "serve.jsonl")
  runner = Runner(args.dir, args.time_limit, "serve_peers")
  servers = [s for s in SERVERS if s == "jaxllm" or args.llama_server]
  for preset in args.presets:
    todo = {s: [n for n in args.concurrency if not _done(read_jsonl(jsonl), args, s, preset, n)] for s in servers}
    todo = {s: levels for s, levels in todo.items() if levels}
    if not todo:
      continue
    gguf = write_gguf(runner, args, preset)
    if gguf is None:
      continue
    for server, levels in todo.items():
      run_server(runner, args, jsonl, server, preset, gguf, args.port + SERVERS.index(server), levels)
    if not args.keep_gguf:
      os.remove(gguf)
  return runner.notes


# ---- report ---------------------------------------------------------------------------------------------------

def _rec(records: list[dict], server: str, preset: str, level: int) -> dict | None:
  """The last record of this server, preset and level (a resumed run's newer one wins)."""
  found = [r for r in records if r.get("server") == server and r.get("preset") == preset
           and r.get("concurrency") == level]
  return found[-1] if found else None


def _ratio(ours: dict | None, peer: dict | None) -> float | None:
  if not ours or not peer or not peer.get("output_tok_s"):
    return None
  return ours["output_tok_s"] / peer["output_tok_s"]


def _ms(v) -> str:
  return "-" if v is None else f"{v:.1f}"


def check_lines(records: list[dict], presets: list[str], levels: list[int]) -> tuple[list[str], bool]:
  lines, ok = [], True
  for preset in presets:
    for level in [n for n in GOAL_LEVELS if n in levels]:
      ours, peer = _rec(records, "jaxllm", preset, level), _rec(records, "llama-server", preset, level)
      ratio = _ratio(ours, peer)
      if ratio is None or ours.get("error_count") or peer.get("error_count"):
        lines.append(f"- {preset} at {level} streams: MISSING (jaxllm: {'yes' if ours else 'no'}, llama-server: "
                     f"{'yes' if peer else 'no'}, or a level with failed requests or no tokens)")
        ok = False
        continue
      good = ratio >= GOAL_RATIO and (ours["tpot_ms_p99"] or 0) <= (peer["tpot_ms_p99"] or 0)
      ok &= good
      lines.append(f"- {preset} at {level} streams: {'ok' if good else 'FAIL'}: {ratio:.2f}x llama-server's output "
                   f"tok/s (goal {GOAL_RATIO:.0f}x); p99 TPOT {_ms(ours['tpot_ms_p99'])} ms against "
                   f"{_ms(peer['tpot_ms_p99'])} ms")
  return lines, ok


def report(records: list[dict], presets: list[str], levels: list[int], notes: list[str]) -> tuple[str, bool]:
  env = next((r["env"] for r in records if r.get("env")), {})
  lines = ["# jaxllm's server beside llama-server", "",
           f"The same GGUF and load generator for both ({env.get('date', 'n/a')}, host {env.get('host', 'n/a')}). "
           "Output tok/s counts the generated tokens of every stream over the level's wall time; TTFT and TPOT "
           "in ms (TPOT: a request's time after its first token over its other tokens).", ""]
  head = ["preset", "streams", "jaxllm tok/s", "TTFT p50 / p99", "TPOT p50 / p99", "compiles",
          "llama-server tok/s", "TTFT p50 / p99", "TPOT p50 / p99", "jaxllm / llama-server"]
  lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for preset in presets:
    for level in levels:
      ours, peer = _rec(records, "jaxllm", preset, level), _rec(records, "llama-server", preset, level)
      cells = [preset, str(level)]
      for r in (ours, peer):
        if r:
          cells += [f"{r['output_tok_s']:,.0f}" + (f" ({r['error_count']} failed)" if r.get("error_count") else ""),
                    f"{_ms(r['ttft_ms_p50'])} / {_ms(r['ttft_ms_p99'])}",
                    f"{_ms(r['tpot_ms_p50'])} / {_ms(r['tpot_ms_p99'])}"]
        else:
          cells += ["-"] * 3
        if r is ours:
          c = ours.get("compiles_while_loaded") if ours else None
          cells.append("-" if c is None else str(c))
      ratio = _ratio(ours, peer)
      cells.append("-" if ratio is None else f"{ratio:.2f}x")
      lines.append("| " + " | ".join(cells) + " |")
  checks, ok = check_lines(records, presets, levels)
  if checks:
    lines += ["", f"Check (issue 38: at {' and '.join(map(str, GOAL_LEVELS))} streams, at least {GOAL_RATIO:.0f}x "
              "llama-server's output tok/s at no worse p99 TPOT):", ""] + checks
  if notes:
    lines += ["", "Notes (runs that did not finish, what is missing):", ""] + [f"- {n}" for n in notes]
  return "\n".join(lines) + "\n", ok


def build_parser():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--dir", required=True, help="the study's folder (JSONL, logs); the report is <dir>.md")
  p.add_argument("--presets", default="qwen2.5-0.5b,qwen2.5-7b", help="comma list of jaxllm/presets.py names")
  p.add_argument("--concurrency", default="1,8,32,64", help="concurrent streams, comma list")
  p.add_argument("--prompt-len", type=int, default=128)
  p.add_argument("--max-tokens", type=int, default=128)
  p.add_argument("--type", default="Q8_0", choices=("Q8_0", "Q4_0", "Q4_K"), help="the GGUF's block type")
  p.add_argument("--vocab", help="tokenizer GGUF the files are written from (random_gguf.py vocab)")
  p.add_argument("--prompt-vocab", type=int, default=32000, help="prompt token ids are drawn below this")
  p.add_argument("--llama-server", metavar="PATH", help="llama.cpp's llama-server binary (none: jaxllm only)")
  p.add_argument("--jaxllm-args", default="", help="more arguments for python -m jaxllm.serve, one string")
  p.add_argument("--llama-args", default="", help="more arguments for llama-server, one string")
  p.add_argument("--port", type=int, default=8400, help="jaxllm's port; llama-server takes the next")
  p.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server may take to be ready")
  p.add_argument("--request-timeout", type=float, default=120.0, help="seconds a request's read may wait")
  p.add_argument("--gguf-dir", help="where the GGUFs are written (default <dir>/gguf)")
  p.add_argument("--keep-gguf", action="store_true", help="keep each preset's GGUF after its servers ran")
  p.add_argument("--time-limit", type=float, help="seconds: nothing starts past it, what runs at it is killed")
  p.add_argument("--render", action="store_true", help="only write the report from the JSONL")
  p.add_argument("--check", action="store_true", help="exit 1 unless every goal level passes")
  return p


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  args.presets, args.concurrency = _presets(args.presets), _ints(args.concurrency, "--concurrency")
  args.jaxllm_args, args.llama_args = args.jaxllm_args.split(), args.llama_args.split()
  if min(args.prompt_len, args.max_tokens, args.prompt_vocab) < 1:
    raise SystemExit("error: --prompt-len, --max-tokens and --prompt-vocab must be at least 1")
  if not args.render:
    if args.llama_server:
      found = shutil.which(args.llama_server)
      if not found:
        raise SystemExit(f"error: --llama-server {args.llama_server!r} is not an executable file (nor on PATH)")
      args.llama_server = found
    if not (args.vocab and os.path.isfile(args.vocab)):
      raise SystemExit(f"error: the GGUFs need --vocab FILE (random_gguf.py vocab MODEL FILE), got {args.vocab!r}")
  try:
    os.makedirs(args.dir, exist_ok=True)
  except OSError as e:
    raise SystemExit(f"error: cannot make --dir {args.dir!r}: {e}") from None
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # the servers' finally blocks stop them
  notes = [] if args.render else run_study(args)
  text, ok = report(read_jsonl(os.path.join(args.dir, "serve.jsonl")), args.presets, args.concurrency, notes)
  with open(os.path.normpath(args.dir) + ".md", "w") as f:
    f.write(text)
  print(text, file=sys.stderr)
  return 1 if args.check and not ok else 0


if __name__ == "__main__":
  sys.exit(main())
