"""bench/serve_peers.py, the server comparison of issue 38: one whole run on the tiny preset (jaxllm's server for
real, llama-server as a stand-in that streams as llama-server does), a peer that never gets ready (bounded), the
report's goal check on made-up records, and bad arguments."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_scaling import _module, random_gguf
from tiny import write_tiny_model

ROOT = Path(__file__).resolve().parent.parent
serve_peers = _module(ROOT / "bench" / "serve_peers.py")

# A stand-in for llama-server: /health and /v1/models (the -a alias), then /v1/completions streamed as
# llama-server streams it (an SSE comment, a chunk a token, the last chunk with finish_reason and usage, then
# [DONE]). It writes its arguments and pid first. SLEEP > 0: never ready (sleeps first).
FAKE = '''#!{python}
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = sys.argv[1:]
with open("{argv_file}", "w") as f: json.dump({{"args": args, "pid": os.getpid()}}, f)
time.sleep({sleep})
class H(BaseHTTPRequestHandler):
  def log_message(self, *a): pass
  def do_GET(self):
    models = {{"data": [{{"id": args[args.index("-a") + 1]}}]}}
    body = {{"/health": {{}}, "/v1/models": models}}.get(self.path)
    self.send_response(200 if body is not None else 404); self.end_headers(); self.wfile.write(json.dumps(body).encode())
  def do_POST(self):
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
    n = body["max_tokens"]
    self.wfile.write(b": ping\\n\\n")          # llama-server's keep-alive comment (sent after 30 s of silence)
    for i in range(n):
      self.wfile.write(b"data: " + json.dumps({{"choices": [{{"text": "a", "index": 0, "finish_reason": None}}]}}).encode() + b"\\n\\n")
      self.wfile.flush(); time.sleep(0.002)
    last = {{"choices": [{{"text": "", "index": 0, "finish_reason": "length"}}],
            "usage": {{"prompt_tokens": len(body["prompt"]), "completion_tokens": n, "total_tokens": n + len(body["prompt"])}}}}
    self.wfile.write(b"data: " + json.dumps(last).encode() + b"\\n\\ndata: [DONE]\\n\\n")
ThreadingHTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), H).serve_forever()
'''


def _fake(path: Path, sleep: float = 0) -> str:
  path.write_text(FAKE.format(python=sys.executable, sleep=sleep, argv_file=path.with_suffix(".argv")))
  path.chmod(0o755)
  return str(path)


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
  d = tmp_path_factory.mktemp("vocab")
  random_gguf.main(["vocab", write_tiny_model(d / "tiny.gguf", "llama"), str(d / "vocab.gguf")])
  return str(d / "vocab.gguf")


def _argv(d, vocab, port, *more):
  return [sys.executable, str(ROOT / "bench/serve_peers.py"), "--dir", str(d), "--presets", "tiny", "--concurrency",
          "1,2", "--prompt-len", "8", "--max-tokens", "6", "--prompt-vocab", "200", "--vocab", vocab,
          "--port", str(port), *more]


def _gone(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return True
  return False


def test_both_servers_on_the_tiny_preset(vocab, tmp_path):
  """jaxllm's server and the stand-in each serve every level; the records carry server, preset and jaxllm's
  compile count (0: nothing compiled while it served); the report has both sides and their ratio; the GGUF is
  removed after; run again, nothing runs (resume)."""
  d = tmp_path / "run"
  fake = _fake(tmp_path / "llama-server")
  argv = _argv(d, vocab, 18431, "--llama-server", fake)
  proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  recs = serve_peers.read_jsonl(str(d / "serve.jsonl"))
  got = sorted((r["server"], r["concurrency"], r["completed"], r["error_count"]) for r in recs)
  assert got == [("jaxllm", 1, 4, 0), ("jaxllm", 2, 8, 0), ("llama-server", 1, 4, 0), ("llama-server", 2, 8, 0)]
  assert all(r["preset"] == "tiny" and r["quant"] == "Q8_0" and r["output_tokens"] == 6 * r["completed"]
             for r in recs)
  assert [r["compiles_while_loaded"] for r in recs if r["server"] == "jaxllm"] == [0, 0]
  started = json.loads((tmp_path / "llama-server.argv").read_text())
  peer_args = started["args"]
  assert _gone(started["pid"])                                  # stopped after its load
  assert peer_args[peer_args.index("-np") + 1] == "2" and peer_args[peer_args.index("-c") + 1] == str(2 * (8 + 6 + 16))
  text = (tmp_path / "run.md").read_text()
  assert "| tiny | 2 | " in text and text.count("x |") == 2, text
  assert not list((d / "gguf").iterdir())
  again = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert again.returncode == 0 and "[serve_peers] " not in again.stderr
  assert len(serve_peers.read_jsonl(str(d / "serve.jsonl"))) == 4


def _level(server, level, tok_s, p99, preset="p"):
  return {"server": server, "preset": preset, "concurrency": level, "output_tok_s": tok_s, "error_count": 0,
          "ttft_ms_p50": 10.0, "ttft_ms_p99": 20.0, "tpot_ms_p50": p99 / 2, "tpot_ms_p99": p99}


def test_a_server_that_never_gets_ready_is_waited_for_a_bounded_time(vocab, tmp_path):
  d = tmp_path / "slow"
  fake = _fake(tmp_path / "llama-server", sleep=600)
  (d / "serve.jsonl").parent.mkdir()
  done = [dict(_level("jaxllm", c, 100.0, 1.0, "tiny"), quant="Q8_0", prompt_len=8, max_tokens=6, completed=4)
          for c in (1, 2)]                                     # jaxllm's side done already: only the peer runs
  (d / "serve.jsonl").write_text("".join(json.dumps(r) + "\n" for r in done))
  t0 = time.monotonic()
  proc = subprocess.run(_argv(d, vocab, 18433, "--llama-server", fake, "--start-timeout", "3"), capture_output=True,
                        text=True, cwd=ROOT, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert time.monotonic() - t0 < 60
  text = (tmp_path / "slow.md").read_text()
  assert "- llama-server-tiny: not ready within 3 s (or the time limit); logs/llama-server-tiny.log" in text
  assert "[serve_peers] jaxllm-tiny" not in proc.stderr
  assert _gone(json.loads((tmp_path / "llama-server.argv").read_text())["pid"])


def test_a_taken_port_is_not_mistaken_for_the_server(vocab, tmp_path):
  """Something already answers on the peer's port (a server left from an earlier run): the peer is not started,
  and nothing is measured against what answers there."""
  import socket
  d = tmp_path / "taken"
  d.mkdir()
  done = [dict(_level("jaxllm", c, 100.0, 1.0, "tiny"), quant="Q8_0", prompt_len=8, max_tokens=6, completed=4)
          for c in (1, 2)]
  (d / "serve.jsonl").write_text("".join(json.dumps(r) + "\n" for r in done))
  with socket.socket() as held:
    held.bind(("127.0.0.1", 18436))
    held.listen()
    proc = subprocess.run(_argv(d, vocab, 18435, "--llama-server", _fake(tmp_path / "llama-server")),
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "- llama-server-tiny: port 18436 is taken" in (tmp_path / "taken.md").read_text()
  assert not (tmp_path / "llama-server.argv").exists()


def test_goal_check_on_made_up_records():
  recs = [_level("jaxllm", 32, 2000, 9.0), _level("llama-server", 32, 1000, 9.5),     # 2.0x, p99 lower: ok
          _level("jaxllm", 64, 3000, 12.0), _level("llama-server", 64, 1600, 11.0)]   # 1.9x, p99 higher: fails
  text, ok = serve_peers.report(recs, ["p"], [1, 32, 64], [])
  assert not ok
  assert "- p at 32 streams: ok: 2.00x llama-server's output tok/s (goal 2x); p99 TPOT 9.0 ms against 9.5 ms" in text
  assert "- p at 64 streams: FAIL: 1.88x" in text and "| p | 1 | - |" in text
  text, ok = serve_peers.report(recs[:2] + [_level("jaxllm", 64, 3400, 10.0), recs[3]], ["p"], [32, 64], [])
  assert ok and "FAIL" not in text
  text, ok = serve_peers.report(recs[:2] + [_level("jaxllm", 64, 3400, 11.5), recs[3]], ["p"], [32, 64], [])
  assert not ok and "- p at 64 streams: FAIL: 2.12x" in text                         # 2.1x, but p99 TPOT worse
  zero = [_level("jaxllm", 32, 2000, 9.0), dict(_level("llama-server", 32, 0.0, 9.5), error_count=4)]
  text, ok = serve_peers.report(zero, ["p"], [32], [])                                  # no division by zero
  assert not ok and "- p at 32 streams: MISSING" in text and "| p | 32 | 2,000 |" in text
  assert not serve_peers.report(recs[:1], ["p"], [32], [])[1]                           # the peer missing


@pytest.mark.parametrize("more, says", [
    (["--presets", "nope"], "unknown preset"),
    (["--concurrency", "0"], "--concurrency takes positive integers"),
    (["--llama-server", "/nonexistent"], "is not an executable file"),
    (["--vocab", "/nonexistent"], "the GGUFs need --vocab FILE"),
])
def test_bad_arguments_are_one_line(vocab, tmp_path, more, says):
  proc = subprocess.run(_argv(tmp_path / "bad", vocab, 18438) + more, capture_output=True, text=True, cwd=ROOT, timeout=60)
  assert proc.returncode != 0 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
