"""A load generator for OpenAI-compatible servers: `python -m jaxllm.serve.loadgen URL [options]`.

N concurrent clients stream `/v1/completions` requests, each a prompt of token ids (so its length is exact,
whatever the tokenizer) and `ignore_eos` with `max_tokens` (so is its answer's), against jaxllm's server or any
other that takes them (llama-server, vLLM). Per concurrency level it reports, as one JSON line: TTFT, TPOT (a
request's time after its first token over its other tokens), inter-chunk latency (ITL: the gaps between
streamed chunks; a server that sends K tokens a chunk shows K-token gaps) and end-to-end latency (mean, p50,
p90, p99, in ms), request and token throughput, and the errors. The HTTP client is asyncio streams and
nothing else, so the generator costs little beside the server it measures.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import random
import sys
import time
from typing import Sequence
from urllib.parse import urlsplit

SCHEMA = "serve-load-1"


@dataclasses.dataclass
class Result:
  ok: bool
  ttft: float = 0.0                                          # seconds to the first chunk with text
  e2e: float = 0.0
  chunk_times: list[float] = dataclasses.field(default_factory=list)
  prompt_tokens: int = 0
  completion_tokens: int = 0
  error: str = ""


async def _request(host: str, port: int, path: str, body: dict, timeout: float) -> Result:
  """One streamed request over a new connection: its timings from the server-sent events."""
  t0 = time.perf_counter()
  result = Result(ok=False)
  try:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
  except (OSError, asyncio.TimeoutError) as e:
    result.error = f"connect: {e}"
    return result
  data = json.dumps(body).encode()
  writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
               f"Accept: text/event-stream\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
  try:
    await writer.drain()
    status = (await asyncio.wait_for(reader.readline(), timeout)).decode().split()
    headers = {}
    while (line := (await asyncio.wait_for(reader.readline(), timeout)).decode().strip()):
      key, _, value = line.partition(":")
      headers[key.strip().lower()] = value.strip()
    if len(status) < 2 or status[1] != "200":
      result.error = f"HTTP {' '.join(status[1:])}: {(await reader.read(500)).decode(errors='replace')}"
      return result
    chunked = headers.get("transfer-encoding", "").lower() == "chunked"
    buffer = b""
    done = False
    while not done:
      if chunked:
        size = int((await asyncio.wait_for(reader.readline(), timeout)).split(b";")[0], 16)
        if size == 0:
          break
        piece = await asyncio.wait_for(reader.readexactly(size + 2), timeout)
        buffer += piece[:-2]
      else:
        piece = await asyncio.wait_for(reader.read(65536), timeout)
        if not piece:
          break
        buffer += piece
      while b"\n\n" in buffer:
        event, buffer = buffer.split(b"\n\n", 1)
        if event.startswith(b":") or not event.strip():
          continue                                         # an SSE comment (llama-server's keep-alive ping)
        payload = event.decode().removeprefix("data:").strip()
        if payload == "[DONE]":
          done = True
          break
        msg = json.loads(payload)
        if "error" in msg:
          result.error = str(msg["error"].get("message", msg["error"]))[:300]
          return result
        now = time.perf_counter() - t0
        if msg.get("choices") and msg["choices"][0].get("text"):
          if not result.chunk_times:
            result.ttft = now
          result.chunk_times.append(now)
        if msg.get("usage"):
          result.prompt_tokens = msg["usage"].get("prompt_tokens", 0)
          result.completion_tokens = msg["usage"].get("completion_tokens", 0)
    result.e2e = time.perf_counter() - t0
    result.ok = bool(result.chunk_times)
    if not result.ok:
      result.error = "no text streamed"
  except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
    result.error = f"{type(e).__name__}: {e}"[:300]
  finally:
    writer.close()
  return result


def _stats(name: str, values: Sequence[float]) -> dict:
  """mean, p50, p90, p99 of values (seconds) in ms; None where there are none."""
  if not values:
    return {f"{name}_ms_{k}": None for k in ("mean", "p50", "p90", "p99")}
  v = sorted(values)

  def pct(p):
    return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))] * 1e3
  return {f"{name}_ms_mean": sum(v) / len(v) * 1e3, f"{name}_ms_p50": pct(50), f"{name}_ms_p90": pct(90),
          f"{name}_ms_p99": pct(99)}


async def run_level(url: str, concurrency: int, requests: int, prompt_len: int, max_tokens: int, model: str | None,
                    vary: float = 0.0, seed: int = 0, vocab: int = 256, timeout: float = 300.0) -> dict:
  """One concurrency level: `requests` requests over `concurrency` clients; the report as a dict."""
  parts = urlsplit(url)
  host, port = parts.hostname or "127.0.0.1", parts.port or 80
  rng = random.Random(seed)
  specs = []
  for _ in range(requests):
    p = max(1, round(prompt_len * (1 + rng.uniform(-vary, vary))))
    m = max(1, round(max_tokens * (1 + rng.uniform(-vary, vary))))
    body = {"prompt": [rng.randrange(vocab) for _ in range(p)], "max_tokens": m, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if model:
      body["model"] = model
    specs.append(body)
  queue: asyncio.Queue = asyncio.Queue()
  for s in specs:
    queue.put_nowait(s)
  results: list[Result] = []

  async def client():
    while not queue.empty():
      results.append(await _request(host, port, "/v1/completions", queue.get_nowait(), timeout))
  t0 = time.perf_counter()
  await asyncio.gather(*(client() for _ in range(concurrency)))
  wall = time.perf_counter() - t0
  ok = [r for r in results if r.ok]
  tpot = [(r.e2e - r.ttft) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
  itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
  out_tokens = sum(r.completion_tokens for r in ok)
  in_tokens = sum(r.prompt_tokens for r in ok)
  report = {"schema": SCHEMA, "url": url, "model": model, "concurrency": concurrency, "requests": requests,
            "prompt_len": prompt_len, "max_tokens": max_tokens, "vary": vary, "completed": len(ok),
            "errors": [r.error for r in results if not r.ok][:5], "error_count": len(results) - len(ok),
            "wall_s": wall, "req_s": len(ok) / wall, "output_tok_s": out_tokens / wall,
            "total_tok_s": (in_tokens + out_tokens) / wall, "output_tokens": out_tokens, "prompt_tokens": in_tokens}
  for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", tpot), ("itl", itl), ("e2e", [r.e2e for r in ok])):
    report.update(_stats(name, values))
  report["env"] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": platform.node(),
                   "python": platform.python_version()}
  return report


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jaxllm.serve.loadgen", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
  p.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
  p.add_argument("--concurrency", "-c", default="1,8", help="concurrent clients, a comma-separated list (default 1,8)")
  p.add_argument("--requests", "-n", type=int, default=None, help="requests per level (default 4 x concurrency)")
  p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
  p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate per request (default 128)")
  p.add_argument("--vary", type=float, default=0.0,
                 help="vary both lengths uniformly by up to this fraction (0.5: 50%%-150%%; default 0: fixed)")
  p.add_argument("--model", default=None, help="the model name to send (default: none)")
  p.add_argument("--vocab", type=int, default=256, help="prompt token ids are drawn from [0, VOCAB) (default 256)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--timeout", type=float, default=300.0, help="seconds a read may wait (default 300)")
  p.add_argument("--json", metavar="FILE", help="append the JSON lines to FILE too")
  return p


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  try:
    levels = [int(c) for c in args.concurrency.split(",")]
  except ValueError:
    raise SystemExit(f"error: --concurrency takes integers separated by commas, got {args.concurrency!r}") from None
  bad = [(n, v) for n, v in (("concurrency", min(levels)), ("prompt-len", args.prompt_len),
                             ("max-tokens", args.max_tokens), ("vocab", args.vocab)) if v < 1]
  if bad or (args.requests is not None and args.requests < 1) or not 0 <= args.vary < 1:
    raise SystemExit("error: --concurrency, --requests, --prompt-len, --max-tokens and --vocab must be >= 1, "
                     "--vary in [0, 1)")
  failed = False
  for level in levels:
    report = asyncio.run(run_level(args.url, level, args.requests or 4 * level, args.prompt_len, args.max_tokens,
                                   args.model, args.vary, args.seed, args.vocab, args.timeout))
    line = json.dumps(report)
    print(line, flush=True)
    if args.json:
      with open(args.json, "a") as f:
        f.write(line + "\n")
    print(f"[loadgen] concurrency {level}: {report['completed']}/{report['requests']} ok, "
          f"{report['output_tok_s']:.1f} output tok/s, TTFT p50 {report['ttft_ms_p50'] or 0:.0f} ms, "
          f"TPOT p50 {report['tpot_ms_p50'] or 0:.1f} ms p99 {report['tpot_ms_p99'] or 0:.1f} ms", file=sys.stderr)
    failed |= report["error_count"] > 0
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
