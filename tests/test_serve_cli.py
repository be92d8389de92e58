"""`python -m jaxllm.serve` as a user runs it: a subprocess on loopback that answers 503 while loading, serves,
and on SIGTERM finishes the stream in flight and exits; bad arguments and a model that fails to load end it with
one line and status 1."""
import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from test_serve import free_port
from tiny import write_tiny_model


def _get(url: str):
  try:
    with urllib.request.urlopen(url, timeout=10) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())
  except (urllib.error.URLError, ConnectionError):
    return None, None


def _serve(*args, **env):
  return subprocess.Popen([sys.executable, "-m", "jaxllm.serve", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=dict(os.environ, JAXLLM_CPU_THREADS="1", **env))


def test_serves_after_loading_and_stops_on_sigterm(tmp_path):
  """... with the API key from JAXLLM_API_KEY: /health answers without it, a completion needs it."""
  path = write_tiny_model(tmp_path / "tiny.gguf", "llama")
  port = free_port()
  proc = _serve(path, "--port", str(port), "--max-batch", "2", "--max-context", "512", "--prefill-chunk", "16",
                "--no-compile-cache", "--shutdown-timeout", "60", JAXLLM_API_KEY="k3y")
  key = {"Authorization": "Bearer k3y"}
  url = f"http://127.0.0.1:{port}"
  try:
    seen, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:
      status, body = _get(url + "/health")
      if status is not None and (not seen or seen[-1] != status):
        seen.append(status)
      if status == 200:
        break
      assert proc.poll() is None, proc.communicate()
      time.sleep(0.05)
    assert seen == [503, 200], seen               # loading, then ready (the port is bound before the model loads)
    body = json.dumps({"prompt": "hi", "max_tokens": 3}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
      urllib.request.urlopen(req, timeout=30)
      raise AssertionError("a completion without the API key was served")
    except urllib.error.HTTPError as e:
      assert e.code == 401 and json.loads(e.read())["error"]["code"] == "invalid_api_key"
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json", **key})
    with urllib.request.urlopen(req, timeout=30) as r:
      answer = json.loads(r.read())
    assert answer["model"] == "tiny" and answer["usage"]["completion_tokens"] >= 1
    # SIGTERM while a stream runs (12 choices of 500 tokens on 2 slots: seconds): the server stops taking
    # requests, lets the stream finish, then exits.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 500, "ignore_eos": True,
                                                        "temperature": 0, "stream": True, "n": 12}), headers=key)
    resp = conn.getresponse()
    assert resp.read(6) == b"data: "
    proc.send_signal(signal.SIGTERM)
    rest = resp.read().decode()
    conn.close()
    assert rest.rstrip().endswith("data: [DONE]") and rest.count('"finish_reason": "length"') == 12
    out, err = proc.communicate(timeout=30)
    assert proc.returncode in (0, -signal.SIGTERM), err     # uvicorn re-raises the signal once it has shut down
    assert "Traceback" not in err and "serving" in err
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.communicate()


def test_bad_arguments_and_a_broken_model_exit_1(tmp_path):
  r = subprocess.run([sys.executable, "-m", "jaxllm.serve", str(tmp_path / "missing.gguf")], capture_output=True,
                     text=True, timeout=60)
  assert r.returncode == 1 and r.stderr.strip().startswith("error:") and "neither a file" in r.stderr
  r = subprocess.run([sys.executable, "-m", "jaxllm.serve", "--max-batch", "0"], capture_output=True, text=True,
                     timeout=60)
  assert r.returncode == 1 and "--max-batch must be >= 1" in r.stderr
  r = subprocess.run([sys.executable, "-m", "jaxllm.serve", "--admit-group", "0"], capture_output=True, text=True,
                     timeout=60)
  assert r.returncode == 1 and "--admit-group must be >= 1, got 0" in r.stderr, r.stderr
  for key in ("", " ", "k\u00e9y", "a b"):
    r = subprocess.run([sys.executable, "-m", "jaxllm.serve", "--api-key", key], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "--api-key (or JAXLLM_API_KEY) must be printable ASCII" in r.stderr, (key, r.stderr)
  broken = tmp_path / "broken.gguf"
  broken.write_bytes(b"GGUF" + b"\0" * 64)
  proc = _serve(str(broken), "--port", str(free_port()))
  out, err = proc.communicate(timeout=60)
  assert proc.returncode == 1, err
  assert "Traceback" not in err and "[jaxllm] error:" in err
  # --chat-template: a file that cannot be read ends it before the model loads; a template that cannot render a
  # chat, once the model has loaded (the file alone cannot show it): one line each, status 1.
  tiny = write_tiny_model(tmp_path / "tiny.gguf", "qwen2")
  r = subprocess.run([sys.executable, "-m", "jaxllm.serve", str(tiny), "--chat-template", str(tmp_path / "none.jinja")],
                     capture_output=True, text=True, timeout=60)
  assert r.returncode == 1 and r.stderr.startswith("error: --chat-template: cannot read chat template file"), r.stderr
  template = tmp_path / "broken.jinja"
  template.write_text("{% if %}", encoding="utf-8")
  proc = _serve(str(tiny), "--port", str(free_port()), "--chat-template", str(template))
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 1 and "Traceback" not in err, err
  assert f"[jaxllm] error: --chat-template: {str(template)!r}: " in err and "TemplateSyntaxError" in err, err


def test_startup_says_when_the_matmul_autotune_timed(tmp_path, monkeypatch, capsys):
  """The compile stage's line names the GPU autotune's timing, as generate's does (the timing itself needs a GPU:
  here Programs._tune is made to report 9.04 s; its file read, under half a second, is not mentioned)."""
  from jaxllm.programs import Programs
  from jaxllm.serve.cli import build_parser, make_loader
  path = write_tiny_model(tmp_path / "tiny.gguf", "llama")
  args = build_parser().parse_args([path, "--max-batch", "1", "--max-context", "64", "--prefill-chunk", "16",
                                    "--no-compile-cache"])
  args.template = None                       # what main() reads from --chat-template (none given)
  for seconds, note in ((9.04, " (with 9.0 s timing the matmul kernels on this GPU, once: kept in the cache; "
                                "JAXLLM_AUTOTUNE=0 skips it)\n"), (0.2, " s\n")):
    def timed(self, seconds=seconds):
      self._tuned, self.tune_seconds = True, seconds
    monkeypatch.setattr(Programs, "_tune", timed)
    scheduler = make_loader(args, path)()
    scheduler.stop()
    line = next(l for l in capsys.readouterr().err.splitlines(keepends=True) if l.startswith("[jaxllm] compile 1 slots: "))
    assert line.endswith(note), line


def test_sigterm_past_the_shutdown_timeout_ends_streams_with_an_error_event(tmp_path):
  """A stream longer than --shutdown-timeout: it ends with the error event ("the server is shutting down") and
  [DONE], not cut mid-response, and the server exits without a traceback."""
  path = write_tiny_model(tmp_path / "tiny.gguf", "llama", context=4096)
  port = free_port()
  proc = _serve(path, "--port", str(port), "--max-batch", "2", "--max-context", "4096", "--prefill-chunk", "16",
                "--tokens-per-call", "1", "--no-compile-cache", "--shutdown-timeout", "2")
  url = f"http://127.0.0.1:{port}"
  try:
    deadline = time.monotonic() + 120
    while _get(url + "/health")[0] != 200:
      assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
      time.sleep(0.05)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 4000, "ignore_eos": True,
                                                        "temperature": 0, "stream": True, "n": 16}))
    resp = conn.getresponse()
    assert resp.read(6) == b"data: "
    proc.send_signal(signal.SIGTERM)
    rest = resp.read().decode()           # raises IncompleteRead where the stream is cut without its end
    conn.close()
    assert rest.count('"finish_reason": "length"') < 16, "the stream finished within the timeout: nothing cut"
    events = [line[6:] for line in rest.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "the server is shutting down" in json.loads(events[-2])["error"]["message"]
    out, err = proc.communicate(timeout=30)
    assert proc.returncode in (0, -signal.SIGTERM), err
    assert "Traceback" not in err and "Cancel" not in err, err
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.communicate()

