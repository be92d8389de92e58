"""The OpenAI-compatible server (jaxllm.serve) on loopback, driven by the official openai client.

One server of the tiny model (4 slots, 256-token context, prefill chunks of 32 so prompts span chunks) runs in
this process (uvicorn on a thread); a second Engine on the same weights runs each request alone, the
reference every greedy or seeded output must equal. Helpers here are imported by test_serve_*.py too.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import random

import numpy as np

import openai
import pytest

from tiny import write_tiny_model
import dataclasses
import socket
import threading
import time

import uvicorn

from jaxllm import Engine, GGUFFile, SamplingParams, Tokenizer
from jaxllm.serve.app import ServerState, create_app
from jaxllm.serve.scheduler import Scheduler
from jaxllm.weights import load_weights

# The module's tests share a costly module fixture: under xdist one worker runs them all, setting it up once
# (bench/gpu_check.sh runs --dist loadgroup).
pytestmark = pytest.mark.xdist_group("serve")


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@dataclasses.dataclass
class Served:
  url: str                 # http://127.0.0.1:PORT
  scheduler: Scheduler
  alone: Engine            # the same model in its own Engine: the reference a request run alone gives
  tokenizer: Tokenizer
  server: uvicorn.Server
  thread: threading.Thread

  def reference(self, ids, max_tokens, params=SamplingParams(), seed=0, stop=()):
    """What Engine.generate gives for this request alone: (text, finish reason as OpenAI names it)."""
    r = self.alone.generate(ids, max_tokens, params, seed=seed, stop=stop)
    return r.text, {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}[r.finish_reason]

  def chat_ids(self, messages):
    return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages))

  def stop(self):
    self.server.should_exit = True
    self.thread.join(30)


def serve(path: str, **kwargs) -> Served:
  """serve_model() of a model file, its weights as load_weights gives them."""
  gf = GGUFFile(path)
  return serve_model(gf.config, load_weights(gf, progress=False), Tokenizer(gf.metadata, source=str(path)), **kwargs)


def serve_model(config, weights, tok, slots: int = 4, max_context: int = 256, prefill_chunk: int = 32,
                max_waiting: int = 64, name: str = "tiny", wide_top_k: bool = False, admit_group: int | None = None,
                **engine_args) -> Served:
  engine = Engine(config, weights, tok, max_context=max_context, prefill_chunk=prefill_chunk, **engine_args)
  alone = Engine(config, weights, tok, max_context=max_context, prefill_chunk=prefill_chunk, **engine_args)
  scheduler = Scheduler(engine, slots=slots, max_waiting=max_waiting, wide_top_k=wide_top_k, admit_group=admit_group)
  scheduler.start()
  scheduler.metrics.ready()
  port = free_port()
  server = uvicorn.Server(uvicorn.Config(create_app(ServerState(name, scheduler)), host="127.0.0.1", port=port,
                                         log_level="warning", timeout_graceful_shutdown=2))
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  deadline = time.monotonic() + 30
  while not server.started:
    if time.monotonic() > deadline or not thread.is_alive():
      raise RuntimeError("the test server did not start")
    time.sleep(0.02)
  return Served(f"http://127.0.0.1:{port}", scheduler, alone, tok, server, thread)


def metric(text: str, name: str, default: float | None = None) -> float:
  """A sample's value from Prometheus text (name with its labels, as written); `default` where it is absent
  (a labelled counter appears once counted), else KeyError."""
  for line in text.splitlines():
    if line.startswith(name + " "):
      return float(line.split()[-1])
  if default is None:
    raise KeyError(name)
  return default


def post(url: str, path: str, body, raw: bool = False, method: str = "POST"):
  """(status, headers, decoded JSON or text) of one request with the standard library's client."""
  host, port = url.removeprefix("http://").split(":")
  conn = http.client.HTTPConnection(host, int(port), timeout=60)
  data = body if raw else (None if body is None else json.dumps(body))
  conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
  resp = conn.getresponse()
  text = resp.read().decode()
  conn.close()
  try:
    return resp.status, dict(resp.getheaders()), json.loads(text)
  except ValueError:
    return resp.status, dict(resp.getheaders()), text


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  # admit_group 2: two prompts whose last chunks fit 16 tokens are admitted in one call (tests/test_admit.py)
  s = serve(write_tiny_model(tmp_path_factory.mktemp("serve") / "tiny.gguf", "qwen2", context=256), wide_top_k=True,
            admit_group=2)
  yield s
  s.stop()


@pytest.fixture(scope="module")
def client(served):
  return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)


def test_chat_and_completions_with_the_openai_client(served, client):
  messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "the weather?"}]
  ids = served.chat_ids(messages)
  want, reason = served.reference(ids, 12)
  r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
  assert r.object == "chat.completion" and r.model == "tiny" and len(r.choices) == 1
  assert r.choices[0].message.role == "assistant"
  assert (r.choices[0].message.content, r.choices[0].finish_reason) == (want, reason)
  assert (r.usage.prompt_tokens, r.usage.total_tokens) == (len(ids), len(ids) + r.usage.completion_tokens)
  assert 1 <= r.usage.completion_tokens <= 12

  stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True,
                                          stream_options={"include_usage": True})
  chunks = list(stream)
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reason
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
  assert len({c.id for c in chunks}) == 1

  prompt = "The quick brown fox"
  pids = served.tokenizer.encode(prompt)
  want, reason = served.reference(pids, 20)
  r = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
  assert (r.object, r.choices[0].text, r.choices[0].finish_reason) == ("text_completion", want, reason)
  assert r.usage.prompt_tokens == len(pids)
  text = "".join(c.choices[0].text for c in client.completions.create(model="tiny", prompt=pids, max_tokens=20,
                                                                      temperature=0, stream=True))
  assert text == want
  echoed = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, echo=True)
  assert echoed.choices[0].text == prompt + want


def test_nulls_take_defaults(served):
  """Clients send optional fields as null (LangChain's "stop": null, "max_tokens": null): defaults apply."""
  body = {"model": None, "messages": [{"role": "user", "content": "hi", "name": None}], "max_tokens": 4, "stop": None,
          "temperature": 0, "top_p": None, "seed": None, "n": None, "stream": None, "logprobs": None, "user": None,
          "metadata": None, "store": False}
  status, _, answer = post(served.url, "/v1/chat/completions", body)
  assert status == 200, answer
  assert len(answer["choices"]) == 1 and answer["usage"]["completion_tokens"] >= 1
  parts = dict(body, messages=[{"role": "user", "content": [{"type": "text", "text": "h"},
                                                            {"type": "text", "text": "i"}]}])
  assert post(served.url, "/v1/chat/completions", parts)[2]["choices"] == answer["choices"]


def test_raw_stream_ends_with_done_and_usage(served):
  """The SSE bytes: data lines only, a usage chunk with no choices, then [DONE]."""
  host, port = served.url.removeprefix("http://").split(":")
  conn = http.client.HTTPConnection(host, int(port), timeout=60)
  conn.request("POST", "/v1/completions", json.dumps({"prompt": "ab", "max_tokens": 5, "temperature": 0, "stream": True,
                                                      "stream_options": {"include_usage": True}}))
  resp = conn.getresponse()
  assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
  events = [e for e in resp.read().decode().split("\n\n") if e]
  conn.close()
  assert all(e.startswith("data: ") for e in events)
  assert events[-1] == "data: [DONE]"
  last = json.loads(events[-2][6:])
  assert last["choices"] == [] and last["usage"]["prompt_tokens"] == 2
  assert all(json.loads(e[6:])["usage"] is None for e in events[:-2])


def test_sampling_settings_n_and_stop(served, client):
  """Seeded sampling with n choices: choice i equals the request run alone with seed + i; a stop string cuts
  the text before it."""
  prompt = "Once upon a time"
  ids = served.tokenizer.encode(prompt)
  window = {"repeat_last_n": 16} if "repeat_last_n" in {f.name for f in dataclasses.fields(SamplingParams)} else {}
  params = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.05, repeat_penalty=1.1,
                          presence_penalty=0.2, frequency_penalty=0.1, **window)
  r = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, n=3, seed=7, temperature=0.9, top_p=0.9,
                                presence_penalty=0.2, frequency_penalty=0.1,
                                extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, **window})
  assert [c.index for c in r.choices] == [0, 1, 2]
  for i, c in enumerate(r.choices):
    assert c.text == served.reference(ids, 16, params, seed=7 + i)[0]
  assert len({c.text for c in r.choices}) > 1          # different seeds, different texts

  full, _ = served.reference(ids, 30)
  stop = full[10:13]
  cut = full[:full.index(stop)]
  r = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0, stop=[stop, "\x00never"])
  assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")


def test_top_k_beyond_the_candidates_needs_the_wide_programs(tmp_path):
  """A sampled top_k above MAX_TOP_K is a 400 naming --wide-top-k on a server without the wide programs (greedy,
  it is not: top_k does not matter), and the scheduler refuses such a request itself; a server with them takes it
  (test_concurrent_streams_each_equal_to_alone_without_compiling draws with it)."""
  from jaxllm.sampling import MAX_TOP_K
  from jaxllm.serve.protocol import ApiError, CompletionRequest, sampling
  from jaxllm.serve.scheduler import Request
  wide = {"prompt": "x", "top_k": MAX_TOP_K + 1, "temperature": 0.7}
  with pytest.raises(ApiError) as e:
    sampling(CompletionRequest.model_validate(wide))
  assert e.value.status == 400 and e.value.param == "top_k" and "--wide-top-k" in str(e.value)
  assert sampling(CompletionRequest.model_validate(wide), wide_top_k=True)[0].top_k == MAX_TOP_K + 1
  assert sampling(CompletionRequest.model_validate(dict(wide, temperature=0)))[0].greedy
  for k in (MAX_TOP_K + 1, 2 ** 31):                  # at least the vocabulary: every token, no wide step needed
    assert sampling(CompletionRequest.model_validate(dict(wide, top_k=k)), vocab_size=MAX_TOP_K + 1)[0].top_k == 0
  gf = GGUFFile(write_tiny_model(tmp_path / "tiny.gguf", "qwen2", context=256))
  scheduler = Scheduler(Engine(gf.config, load_weights(gf, progress=False), None, max_context=64), slots=2)
  with pytest.raises(ValueError, match="wide_top_k=True"):
    scheduler.submit(Request([1, 2], 4, lambda e: None, SamplingParams(temperature=0.7, top_k=MAX_TOP_K + 1)))


def _load_requests(served, count: int, seed: int = 0):
  """Mixed requests: chat and completions, prompts of 1-140 tokens (up to 5 prefill chunks), 1-40 new tokens,
  greedy and seeded sampling, a few with a top_k above the candidates (200 of the tiny model's 262 tokens: the
  wide step); each with the text it must give (run alone)."""
  rng = random.Random(seed)
  out = []
  for i in range(count):
    text = "".join(rng.choice("abcdefgh ijk the") for _ in range(rng.randint(1, 140)))
    max_tokens = rng.randint(1, 40)
    sampled, wide = i % 4 == 3, i % 8 == 5
    params = SamplingParams(temperature=0.8, top_p=0.95) if sampled else SamplingParams()
    kw = {"temperature": 0.8, "top_p": 0.95, "seed": 1000 + i} if sampled else {"temperature": 0}
    if wide:
      sampled, params = True, SamplingParams(temperature=1.5, top_k=200)
      kw = {"temperature": 1.5, "seed": 1000 + i, "extra_body": {"top_k": 200}}
    if i % 2:
      messages = [{"role": "user", "content": text}]
      ids = served.chat_ids(messages)
      kw["messages"] = messages
    else:
      ids = served.tokenizer.encode(text)
      kw["prompt"] = text
    want = served.reference(ids, max_tokens, params, seed=1000 + i if sampled else 0)
    out.append((kw, max_tokens, want))
  return out


def test_concurrent_streams_each_equal_to_alone_without_compiling(served):
  """24 concurrent streaming requests on 4 slots (the rest queue): every one completes, with the text and
  finish reason it has alone, none lost or duplicated; the scheduler compiles nothing while serving."""
  cases = _load_requests(served, 24)
  before = post(served.url, "/metrics", None, method="GET")[2]
  client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)

  async def one(kw, max_tokens):
    if "messages" in kw:
      stream = await client.chat.completions.create(model="tiny", max_tokens=max_tokens, stream=True, **kw)
      parts = [(c.id, c.choices[0].delta.content or "", c.choices[0].finish_reason) async for c in stream]
    else:
      stream = await client.completions.create(model="tiny", max_tokens=max_tokens, stream=True, **kw)
      parts = [(c.id, c.choices[0].text, c.choices[0].finish_reason) async for c in stream]
    return {p[0] for p in parts}, "".join(p[1] for p in parts), [p[2] for p in parts if p[2]]

  async def run():
    return await asyncio.gather(*(one(kw, m) for kw, m, _ in cases))
  results = asyncio.run(run())
  after = post(served.url, "/metrics", None, method="GET")[2]
  ids = set()
  for (kw, _, (text, reason)), (rid, got, reasons) in zip(cases, results):
    assert len(rid) == 1 and not rid & ids
    ids |= rid
    assert (got, reasons) == (text, [reason]), kw
  compiles = "jaxllm_xla_compiles_while_serving_total"
  assert metric(after, compiles) == metric(before, compiles)
  assert metric(after, 'jaxllm_decode_calls_total{rows="4"}') > metric(before, 'jaxllm_decode_calls_total{rows="4"}', 0)
  assert metric(after, "jaxllm_kv_slots_used") == 0 and metric(after, "jaxllm_requests_waiting") == 0


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/chat/completions", b'{"messages": [', 400, None),                                  # malformed JSON
    ("/v1/chat/completions", b'[1, 2]', 400, None),                                          # not an object
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temprature": 0}, 400, "temprature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": "8"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10 ** 9}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_k": -2}, 400, "top_k"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 100}, 400, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     400, "response_format"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("/v1/completions", {"prompt": "x" * 300}, 400, "prompt"),                                 # longer than the context
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/v1/nothing", {}, 404, None),
])
def test_bad_requests_get_openai_errors(served, path, body, status, param):
  got, headers, answer = post(served.url, path, body, raw=isinstance(body, bytes))
  assert got == status, answer
  err = answer["error"]
  assert isinstance(err["message"], str) and err["message"] and "Traceback" not in err["message"]
  assert err["type"] and err["param"] == param


def test_server_healthy_after_errors_and_a_client_gone_mid_stream(served, client, monkeypatch):
  """A client that reads one chunk and hangs up: its request is cancelled and its slot freed; the server goes on.
  (Each decode call is slowed to 50 ms here, so the request cannot end on its own first.)"""
  decode = served.scheduler.programs.decode

  def slow(*args):
    time.sleep(0.05)
    return decode(*args)
  monkeypatch.setattr(served.scheduler.programs, "decode", slow)
  host, port = served.url.removeprefix("http://").split(":")
  metrics = post(served.url, "/metrics", None, method="GET")[2]
  cancelled = metric(metrics, 'jaxllm_requests_total{finish_reason="cancelled"}', 0)
  conn = http.client.HTTPConnection(host, int(port), timeout=60)
  conn.request("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 250, "stream": True,
                                                      "ignore_eos": True, "temperature": 0}))
  resp = conn.getresponse()
  assert resp.status == 200 and resp.read(6) == b"data: "
  conn.sock.shutdown(2)
  conn.close()
  deadline = time.monotonic() + 20
  while True:   # cancelled, and its slot freed (the count and the slot change apart: wait for both)
    metrics = post(served.url, "/metrics", None, method="GET")[2]
    gone = metric(metrics, 'jaxllm_requests_total{finish_reason="cancelled"}', 0) == cancelled + 1
    if gone and metric(metrics, "jaxllm_kv_slots_used") == 0:
      break
    assert time.monotonic() < deadline, ("the request of a client that hung up was not cancelled" if not gone else
                                         "the slot of a cancelled request was not freed")
    time.sleep(0.05)
  # A client of a plain (not streamed) request that hangs up before its answer: cancelled too.
  conn = http.client.HTTPConnection(host, int(port), timeout=60)
  conn.request("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 250, "ignore_eos": True}))
  time.sleep(0.3)
  conn.sock.shutdown(2)
  conn.close()
  deadline = time.monotonic() + 20
  while metric(post(served.url, "/metrics", None, method="GET")[2],
               'jaxllm_requests_total{finish_reason="cancelled"}', 0) != cancelled + 2:
    assert time.monotonic() < deadline, "the plain request of a client that hung up was not cancelled"
    time.sleep(0.05)
  assert post(served.url, "/health", None, method="GET")[:1] == (200,)
  r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "still there?"}], max_tokens=4)
  assert r.choices[0].finish_reason in ("length", "stop")


def test_queue_full_is_503_with_retry_after(served, monkeypatch):
  """Past max_waiting queued requests beyond the free slots, a request is refused at once with 503."""
  monkeypatch.setattr(served.scheduler, "max_waiting", -served.scheduler.slots)   # no room at all
  status, headers, answer = post(served.url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
  assert status == 503 and int(headers["retry-after"]) >= 1 and "busy" in answer["error"]["message"]


def test_queue_full_counts_the_requests_beyond_the_free_slots(served, monkeypatch):
  """Queued requests up to the free slots are about to take them: the refusal counts only those beyond."""
  s = served.scheduler
  monkeypatch.setattr(s, "max_waiting", 1)
  monkeypatch.setattr(s, "_queued", s._free_slots() + 1)      # each free slot about to be taken, one more waiting
  status, _, answer = post(served.url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
  assert status == 503 and answer["error"]["message"] == (
      "the server is busy: 1 request is already waiting for a slot (at most 1); retry later")


def test_prefix_reuse_continues_from_a_slot(served, client):
  """A second turn of a chat starts from the slot holding the first turn: only the new tokens are prefilled,
  and the answer is the one the whole prompt gives alone."""
  system = {"role": "system", "content": "a long shared system prompt " * 3}
  first = [system, {"role": "user", "content": "question one"}]
  r1 = client.chat.completions.create(model="tiny", messages=first, max_tokens=6, temperature=0)
  second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                    {"role": "user", "content": "and two"}]
  before = metric(post(served.url, "/metrics", None, method="GET")[2], "jaxllm_prompt_tokens_reused_total")
  r2 = client.chat.completions.create(model="tiny", messages=second, max_tokens=8, temperature=0)
  reused = metric(post(served.url, "/metrics", None, method="GET")[2], "jaxllm_prompt_tokens_reused_total") - before
  assert reused >= len(served.chat_ids(first))
  assert r2.choices[0].message.content == served.reference(served.chat_ids(second), 8)[0]


def test_tokenize_models_health_metrics(served):
  status, _, t = post(served.url, "/tokenize", {"prompt": "hello there"})
  assert status == 200 and t["tokens"] == served.tokenizer.encode("hello there") and t["count"] == len(t["tokens"])
  status, _, d = post(served.url, "/detokenize", {"tokens": t["tokens"]})
  assert status == 200 and d["prompt"] == "hello there"
  messages = [{"role": "user", "content": "hi"}]
  assert post(served.url, "/tokenize", {"messages": messages})[2]["tokens"] == served.chat_ids(messages)
  status, _, m = post(served.url, "/v1/models", None, method="GET")
  assert status == 200 and m["data"][0]["id"] == "tiny" and m["data"][0]["max_model_len"] == 256
  assert post(served.url, "/health", None, method="GET")[:1] == (200,)
  text = post(served.url, "/metrics", None, method="GET")[2]
  for name in ("jaxllm_requests_running", "jaxllm_requests_waiting", "jaxllm_kv_slots_used", "jaxllm_kv_slots_total",
               "jaxllm_prompt_tokens_total", "jaxllm_generation_tokens_total",
               'jaxllm_time_to_first_token_seconds_bucket{le="+Inf"}', "jaxllm_time_per_output_token_seconds_count"):
    metric(text, name)
  assert metric(text, "jaxllm_kv_slots_total") == 4


def test_a_request_alone_decodes_one_row(served, client):
  """Busy slots stay packed: one request at a time runs the 1-row decode program, not the 4-row one."""
  def calls():
    text = post(served.url, "/metrics", None, method="GET")[2]
    return {rows: metric(text, f'jaxllm_decode_calls_total{{rows="{rows}"}}', 0) for rows in (1, 2, 4)}
  before = calls()
  for prompt in ("one", "two", "three"):
    client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0,
                              extra_body={"ignore_eos": True})
  after = calls()
  assert after[1] - before[1] >= 3 and after[2] == before[2] and after[4] == before[4]


def _same_sum(got: float, want: float):
  """Summed log-probabilities from two paths: to f32 rounding on the CPU, to bf16 activations' (the GPU's
  default dtype) relative to their size elsewhere (one H200 run: -342.958 against -343.084)."""
  from jaxllm.load import default_dtype
  f32 = np.dtype(default_dtype()) == np.float32
  assert got == (pytest.approx(want, abs=2e-2) if f32 else pytest.approx(want, rel=2e-3)), (got, want)


def _reference_logprob(served, prompt: list[int], continuation: list[int]) -> float:
  """The summed log-probability of a continuation, from jaxllm.scoring on the XLA path (shares no serving code)."""
  from jaxllm import continuation_logprobs
  tokens = np.asarray([prompt + continuation], np.int32)
  return float(continuation_logprobs(served.alone.config, served.alone.weights, tokens, np.asarray([len(prompt)]),
                                     np.asarray([tokens.shape[1]]))[0])


def test_logprobs_of_new_tokens_and_of_an_echoed_prompt(served, client):
  messages = [{"role": "user", "content": "tell me something"}]
  ids = served.chat_ids(messages)
  r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, logprobs=True,
                                     top_logprobs=3, extra_body={"ignore_eos": True})
  content = r.choices[0].logprobs.content
  assert len(content) == r.usage.completion_tokens == 10
  new = []
  for entry in content:
    tops = [t.logprob for t in entry.top_logprobs]
    assert len(tops) == 3 and tops == sorted(tops, reverse=True)
    assert entry.top_logprobs[0].token == entry.token and entry.logprob == pytest.approx(tops[0])   # greedy
    new.append(bytes(entry.bytes))
  new_ids = served.alone.generate(ids, 10, ignore_eos=True).ids           # the same tokens (greedy)
  assert [served.tokenizer.token_bytes(t) for t in new_ids] == new
  _same_sum(sum(e.logprob for e in content), _reference_logprob(served, ids, new_ids))

  prompt = served.tokenizer.encode("Once upon a time, in a land far away")
  r = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=2)
  lp = r.choices[0].logprobs
  assert r.usage.completion_tokens == 0 and r.choices[0].text == served.tokenizer.decode(prompt)
  assert len(lp.token_logprobs) == len(prompt) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
  assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
  _same_sum(sum(lp.token_logprobs[1:]), _reference_logprob(served, prompt[:1], prompt[1:]))

  streamed = [c.choices[0].logprobs for c in client.completions.create(
      model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=1, stream=True,
      extra_body={"ignore_eos": True}) if c.choices[0].logprobs]
  plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=1,
                                    extra_body={"ignore_eos": True}).choices[0].logprobs
  assert [x for part in streamed for x in part.token_logprobs] == pytest.approx(plain.token_logprobs)
  assert len(plain.token_logprobs) == 12


def test_load_generator(served, capsys):
  """jaxllm.serve.loadgen against the server: every request completes with exactly its tokens, and the report
  holds the latency percentiles and throughputs."""
  from jaxllm.serve import loadgen
  assert loadgen.main([served.url, "--concurrency", "2,6", "--requests", "12", "--prompt-len", "20",
                       "--max-tokens", "9", "--vocab", "250"]) == 0
  lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
  assert [r["concurrency"] for r in lines] == [2, 6]
  for r in lines:
    assert (r["completed"], r["error_count"], r["output_tokens"], r["prompt_tokens"]) == (12, 0, 12 * 9, 12 * 20)
    for name in ("ttft", "tpot", "itl", "e2e"):
      assert 0 <= r[f"{name}_ms_p50"] <= r[f"{name}_ms_p90"] <= r[f"{name}_ms_p99"]
    assert r["output_tok_s"] > 0 and r["ttft_ms_p50"] <= r["e2e_ms_p50"]
  bad = asyncio.run(loadgen.run_level(served.url, 2, 2, 5, 3, "not-the-model"))
  assert bad["completed"] == 0 and "does not exist" in bad["errors"][0]


def test_a_failed_program_ends_its_requests_and_the_server_goes_on(served, client, monkeypatch):
  """A device program that raises: the requests in flight end with a 500 (or an error event in a stream), the
  slots' state is made anew, and the next request is answered as alone."""
  decode = served.scheduler.programs.decode
  calls = []

  def failing(*args):
    calls.append(args)
    if len(calls) == 1:
      raise RuntimeError("injected device failure")
    return decode(*args)
  monkeypatch.setattr(served.scheduler.programs, "decode", failing)
  status, _, answer = post(served.url, "/v1/completions", {"prompt": "abc", "max_tokens": 20, "temperature": 0})
  assert status == 500 and "injected device failure" in answer["error"]["message"]
  ids = served.tokenizer.encode("abc")
  r = client.completions.create(model="tiny", prompt="abc", max_tokens=20, temperature=0)
  assert (r.choices[0].text, r.choices[0].finish_reason) == served.reference(ids, 20)
  assert post(served.url, "/health", None, method="GET")[0] == 200


def test_an_api_key_is_required_where_set():
  """With an API key, every endpoint but /health and /metrics is a 401 in OpenAI's shape (the official client's
  AuthenticationError) unless the request carries 'Authorization: Bearer <key>'; without one, none is asked."""
  from starlette.testclient import TestClient
  with TestClient(create_app(ServerState("tiny"), api_key="s3cret")) as http:
    assert http.get("/health").status_code == 503                 # answered (no model loaded here), no key needed
    assert http.get("/metrics").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}, {"X-Api-Key": "s3cret"}):
      for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                           ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/nothing")):
        r = http.request(method, path, headers=headers, json={"prompt": "x"} if method == "POST" else None)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (headers, path)
        assert r.json()["error"]["code"] == "invalid_api_key" and "Authorization: Bearer" in r.json()["error"]["message"]
    assert http.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).json()["data"][0]["id"] == "tiny"
    assert http.get("/v1/models", headers={"Authorization": "bearer s3cret"}).status_code == 200   # any case
    from starlette.websockets import WebSocketDisconnect
    with pytest.raises(WebSocketDisconnect) as closed:
      with http.websocket_connect("/v1/models") as ws:
        ws.receive_text()
    assert closed.value.code == 1008
    wrong = openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=http, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
      wrong.models.list()
    right = openai.OpenAI(base_url="http://testserver/v1", api_key="s3cret", http_client=http, max_retries=0)
    assert [m.id for m in right.models.list().data] == ["tiny"]
  with TestClient(create_app(ServerState("tiny"))) as http:
    assert http.get("/v1/models").status_code == 200


def test_allowed_origins_answer_browsers_before_the_key():
  """--allowed-origin: a browser's preflight from an allowed origin is answered (it carries no key, so before the
  key check) and the API's answers name the origin; another origin gets neither; without the option no answer
  carries CORS headers."""
  from starlette.testclient import TestClient
  preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
  app = create_app(ServerState("tiny"), api_key="s3cret", allowed_origins=["https://ui.example"])
  with TestClient(app) as http:
    r = http.options("/v1/chat/completions", headers={"Origin": "https://ui.example", **preflight})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = http.get("/v1/models", headers={"Origin": "https://ui.example", "Authorization": "Bearer s3cret"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
    r = http.get("/v1/models", headers={"Origin": "https://ui.example"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://ui.example"  # readable
    r = http.options("/v1/chat/completions", headers={"Origin": "https://evil.example", **preflight})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = http.get("/v1/models", headers={"Origin": "https://evil.example", "Authorization": "Bearer s3cret"})
    assert "access-control-allow-origin" not in r.headers
  with TestClient(create_app(ServerState("tiny"))) as http:
    r = http.get("/v1/models", headers={"Origin": "https://ui.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    assert http.options("/v1/models", headers={"Origin": "https://ui.example", **preflight}).status_code == 405


def test_wide_top_k_with_logit_biases_batched_as_alone(served):
  """Sampled top_k above the candidates beside logit biases (the masked wide program) and beside greedy and
  narrow rows: with a bias of 0 the ids are Engine.generate's (the wide step, not the candidates), a banned
  token is never drawn, a forced one always is, and each request's ids in one batch are its ids alone; nothing
  compiles."""
  from test_serve_tools import _run
  prompt = served.tokenizer.encode("hello there")
  wide = SamplingParams(temperature=1.5, top_k=200)
  free = served.alone.generate(prompt, 8, wide, seed=7, ignore_eos=True).ids     # _run's seed
  before = post(served.url, "/metrics", None, method="GET")[2]                    # after the reference's compiles
  banned = {free[0]: -100.0, free[1]: -100.0}
  cases = [(prompt, 8, wide, banned), (prompt, 8, wide, {5: 0.0}), (prompt, 8, SamplingParams(), {7: 100.0}),
           (prompt, 8, SamplingParams(temperature=0.9, top_k=40), None), (prompt, 8, wide, {9: 100.0})]
  alone = [_run(served, [c])[0] for c in cases]
  assert not set(banned) & set(alone[0]) and alone[1] == free and alone[2] == [7] * 8 and alone[4] == [9] * 8
  assert _run(served, cases) == alone
  after = post(served.url, "/metrics", None, method="GET")[2]
  compiles = "jaxllm_xla_compiles_while_serving_total"
  assert metric(after, compiles) == metric(before, compiles)
