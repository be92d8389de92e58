"""The HTTP layer: a Starlette app serving the OpenAI API over a Scheduler, and nothing else.

Endpoints: POST /v1/chat/completions, /v1/completions, /tokenize, /detokenize; GET /v1/models, /health (503
while the model loads, 200 once it serves), /metrics (Prometheus text). A request is read (at most MAX_BODY
bytes), decoded, validated (jaxllm.serve.protocol), its prompt rendered and tokenized on a worker thread, then
submitted to the scheduler as one scheduler Request per choice; events come back from the engine thread
through an asyncio queue and leave as one JSON response or as server-sent events in OpenAI's chunk format,
ending with `data: [DONE]`. A client that disconnects cancels its requests, which frees their slots. Who may
call it (an API key, browsers' origins): jaxllm.serve.access.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import sys
import threading
import time
import traceback
from typing import Callable, Sequence

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxllm.serve import access
from jaxllm.serve import protocol as P
from jaxllm.serve import tools as T
from jaxllm.serve.scheduler import Delta, Done, QueueFull, Request, Scheduler

MAX_BODY = 16 * 2**20     # bytes of a request body
LOADING_RETRY = 5         # Retry-After (seconds) while the model loads
DISCONNECT_CHECK = 0.5    # seconds between checks that the client of a plain (not streamed) request is still there


class ServerState:
  """What the app serves: the scheduler once loading has ended (None before), the model's name."""

  def __init__(self, model: str, scheduler: Scheduler | None = None):
    self.model = model
    self.scheduler = scheduler
    self.load_error: str | None = None
    self.created = P.now()

  @property
  def ready(self) -> Scheduler:
    if self.scheduler is None:
      status = f"the model failed to load: {self.load_error}" if self.load_error else "the model is loading"
      raise P.ApiError(503, status, headers={"Retry-After": str(LOADING_RETRY)})
    return self.scheduler


def _error_response(e: P.ApiError) -> JSONResponse:
  return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _json_body(request: HttpRequest):
  size, parts = 0, []
  async for part in request.stream():
    size += len(part)
    if size > MAX_BODY:
      raise P.ApiError(413, f"the request body is larger than {MAX_BODY} bytes")
    parts.append(part)
  try:
    return json.loads(b"".join(parts))
  except (ValueError, RecursionError) as e:
    raise P.ApiError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None


def _sse(data) -> str:
  return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


# ---- generation ----------------------------------------------------------------------------------

class _Job:
  """One HTTP generation request: its scheduler requests (one per prompt and choice) and their events."""

  def __init__(self, scheduler: Scheduler, prompts: list[list[int]], limits: list[int], req, params, seed, stop,
               grammar=None, bias: dict[int, float] | None = None):
    self.scheduler = scheduler
    self.events: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    self.requests = []
    self.prompt_tokens = sum(len(p) for p in prompts)
    self.logprobs, prompt_logprobs = P.logprobs_wanted(req)
    for pi, (prompt, limit) in enumerate(zip(prompts, limits)):
      for j, s in enumerate(P.seeds(seed, req.n)):
        emit = functools.partial(_mailbox(loop).put, self.events, pi * req.n + j)
        constraint = None if grammar is None else grammar.constraint()     # one matcher per choice
        self.requests.append(Request(prompt, limit, emit, params, s, stop, req.ignore_eos, self.logprobs,
                                     prompt_logprobs, constraint, bias))
    self.done: dict[int, Done] = {}

  def submit(self) -> None:
    for i, r in enumerate(self.requests):
      try:
        self.scheduler.submit(r)
      except (QueueFull, RuntimeError) as e:       # the queue is full, or the server is shutting down
        for earlier in self.requests[:i]:
          self.scheduler.cancel(earlier)
        if isinstance(e, QueueFull):
          self.scheduler.metrics.rejected += 1
          raise P.ApiError(503, str(e), headers={"Retry-After": str(e.retry_after)}) from None
        raise P.ApiError(503, str(e)) from None

  def cancel(self) -> None:
    for i, r in enumerate(self.requests):
      if i not in self.done:
        self.scheduler.cancel(r)

  async def next(self) -> tuple[int, Delta | Done]:
    index, event = await self.events.get()
    if isinstance(event, Done):
      self.done[index] = event
    return index, event

  @property
  def finished(self) -> bool:
    return len(self.done) == len(self.requests)

  def usage(self) -> dict:
    return P.usage(self.prompt_tokens, sum(d.completion_tokens for d in self.done.values()))


class _Mailbox:
  """Hands events from the engine thread to one event loop's queues. The loop is woken once for whatever is
  posted before it runs (one self-pipe write a batch, not one a token: at 64 streams a decode call posts 64
  events); each queue gets its events in the order posted."""

  def __init__(self, loop: asyncio.AbstractEventLoop):
    self.loop, self._lock = loop, threading.Lock()
    self._items: list[tuple[asyncio.Queue, tuple]] = []
    self._scheduled = False

  def put(self, events: asyncio.Queue, index: int, event) -> None:
    with self._lock:
      self._items.append((events, (index, event)))
      if self._scheduled:
        return
      self._scheduled = True
    with contextlib.suppress(RuntimeError):       # the event loop has closed (shutdown): nobody is listening
      self.loop.call_soon_threadsafe(self._drain)

  def _drain(self) -> None:
    with self._lock:
      items, self._items, self._scheduled = self._items, [], False
    for events, item in items:
      events.put_nowait(item)


_BOX: list[_Mailbox] = []        # the mailbox of the loop that last made a job (a server runs one loop)


def _mailbox(loop: asyncio.AbstractEventLoop) -> _Mailbox:
  """The running loop's mailbox (called on that loop). A job keeps the one it was made with, so jobs of
  another loop (tests run one loop per client) still reach their own."""
  if not _BOX or _BOX[0].loop is not loop:
    _BOX[:] = [_Mailbox(loop)]
  return _BOX[0]


class _Logprobs:
  """OpenAI's logprobs shapes from Delta events: chat's {"content": [{token, logprob, bytes, top_logprobs}]},
  completions' {tokens, token_logprobs, top_logprobs, text_offset} (the prompt's first, with echo)."""

  def __init__(self, kind: str, tokenizer, offset: int = 0):
    self.kind, self.tok, self.offset = kind, tokenizer, offset

  def _text(self, token: int) -> tuple[str, list[int]]:
    raw = self.tok.token_bytes(token)
    return raw.decode("utf-8", "replace"), list(raw)

  def _entry(self, token: int, lp: float) -> dict:
    text, raw = self._text(token)
    return {"token": text, "logprob": lp, "bytes": raw}

  def of(self, ids: list[int], scores: list, first: int | None = None) -> dict:
    """The logprobs of ids (scores one per id; with `first`, a prompt's first token without a score before)."""
    if self.kind == "chat":
      return {"content": [dict(self._entry(t, lp), top_logprobs=[self._entry(a, v) for a, v in top])
                          for t, (lp, top) in zip(ids, scores)]}
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    rows = ([(first, None, None)] if first is not None else []) + [(t, lp, top) for t, (lp, top) in zip(ids, scores)]
    for token, lp, top in rows:
      text = self._text(token)[0]
      out["tokens"].append(text)
      out["token_logprobs"].append(lp)
      out["top_logprobs"].append(None if top is None else {self._text(t)[0]: v for t, v in top})
      out["text_offset"].append(self.offset)
      self.offset += len(text)
    return out

  @staticmethod
  def join(parts: list[dict]) -> dict | None:
    if not parts:
      return None
    out = {k: [] for k in parts[0]}
    for part in parts:
      for k, v in part.items():
        out[k] += v
    return out


def _failure(done: Done) -> P.ApiError:
  if done.finish_reason == "cancelled":
    return P.ApiError(503, done.error or "the request was cancelled")
  return P.ApiError(500, done.error or "generation failed", kind="server_error")


async def _generate(http: HttpRequest, state: ServerState, req, kind: str, prompts: list[list[int]],
                    echo: list[str] | None = None, tools: list[dict] | None = None,
                    choice: str | tuple[str, str] | None = None) -> Response:
  """tools, choice: the chat request's (protocol.tool_setup): answers are read for calls to them; a choice
  other than "auto" constrains the output to one call (tools.grammar). parallel_tool_calls false: the first
  call only."""
  scheduler = state.ready
  params, seed, stop = P.sampling(req, wide_top_k=scheduler.programs.wide_top_k,
                                  vocab_size=scheduler.engine.config.vocab_size)
  if req.stream_options is not None and not req.stream:
    raise P.ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
  limits = [P.max_new_tokens(req, len(p), scheduler.engine.max_context) for p in prompts]
  bias = P.logit_biases(req, scheduler.engine.config.vocab_size)
  if tools and choice != "auto":
    lark = T.grammar(tools, choice, T.family(scheduler.tokenizer.chat_template))
    grammar = await _grammar(scheduler, lark, "tools", scheduler.grammars and scheduler.grammars.lark)
  else:
    grammar = await _grammar(scheduler, P.response_schema(req))
  job = _Job(scheduler, prompts, limits, req, params, seed, stop, grammar, bias)
  job.submit()
  rid = P.new_id("chatcmpl" if kind == "chat" else "cmpl")
  names = [t["function"]["name"] for t in tools] if tools else None
  parallel = getattr(req, "parallel_tool_calls", None) is not False
  if req.stream:
    include = bool(req.stream_options and req.stream_options.include_usage)
    return StreamingResponse(_stream(job, kind, rid, state.model, req.n, include, echo, scheduler.tokenizer, names,
                                     parallel),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
  texts = {i: (echo[i // req.n] if echo else "") for i in range(len(job.requests))}
  scored = {i: _Logprobs(kind, scheduler.tokenizer) for i in range(len(job.requests))}
  logprobs: dict[int, list[dict]] = {i: [] for i in range(len(job.requests))}
  checked = time.monotonic()
  try:
    while not job.finished:
      if time.monotonic() - checked > DISCONNECT_CHECK:   # the client may have gone while events kept coming
        checked = time.monotonic()
        if await http.is_disconnected():
          return Response(status_code=499)
      try:
        index, event = await asyncio.wait_for(job.next(), timeout=DISCONNECT_CHECK)
      except asyncio.TimeoutError:
        continue
      if isinstance(event, Delta):
        texts[index] += event.text
        if event.prompt_logprobs is not None:
          p = job.requests[index].prompt
          logprobs[index].append(scored[index].of(p[1:], event.prompt_logprobs, first=p[0]))
        if event.logprobs is not None:
          logprobs[index].append(scored[index].of(event.ids, event.logprobs))
  finally:
    job.cancel()
  failed = [d for d in job.done.values() if d.finish_reason in ("error", "cancelled")]
  if failed:
    raise _failure(failed[0])
  body = {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion", "created": P.now(),
          "model": state.model, "choices": [], "usage": job.usage()}
  for i in range(len(job.requests)):
    choice = {"index": i, "finish_reason": job.done[i].finish_reason,
              "logprobs": _Logprobs.join(logprobs[i]) if job.logprobs is not None else None}
    if kind == "chat":
      choice["message"] = {"role": "assistant", "content": texts[i]}
      calls = T.parse(texts[i], names, parallel) if names else (None, [])
      if calls[1]:
        choice["message"] = {"role": "assistant", "content": calls[0], "tool_calls": calls[1]}
        choice["finish_reason"] = "tool_calls"
    else:
      choice["text"] = texts[i]
    body["choices"].append(choice)
  return JSONResponse(body)


async def _stream(job: _Job, kind: str, rid: str, model: str, n: int, include_usage: bool, echo: list[str] | None,
                  tokenizer, names: list[str] | None = None, parallel: bool = True):
  """names: the tools' (chat with tools): each choice's text goes through a tools.ToolStream, calls out as
  tool_calls deltas (the first only where not parallel)."""
  created = P.now()
  scored = {i: _Logprobs(kind, tokenizer) for i in range(len(job.requests))}
  calls = {i: T.ToolStream(names, parallel) for i in range(len(job.requests))} if names else None

  def piece(index: int, text: str | dict | None, finish: str | None = None, logprobs: dict | None = None,
            role: bool = False) -> str:
    if kind == "chat":
      delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
      delta = text if isinstance(text, dict) else delta
      choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
      choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    return _sse(P.chunk(kind, rid, model, created, [choice], None, include_usage))
  try:
    for i in range(len(job.requests)):
      if kind == "chat":
        yield piece(i, "", role=True)
      elif echo and echo[i // n]:
        yield piece(i, echo[i // n])
    while not job.finished:
      index, event = await job.next()
      if isinstance(event, Delta):
        logprobs = None
        if event.prompt_logprobs is not None:
          p = job.requests[index].prompt
          logprobs = scored[index].of(p[1:], event.prompt_logprobs, first=p[0])
        if event.logprobs is not None:
          logprobs = scored[index].of(event.ids, event.logprobs)
        if calls is not None:
          for part in _tool_parts(calls[index], calls[index].feed(event.text)):
            yield piece(index, part)
          if logprobs is not None:
            yield piece(index, "", logprobs=logprobs)
        elif event.text or logprobs is not None:
          yield piece(index, event.text, logprobs=logprobs)
      elif event.finish_reason in ("error", "cancelled"):
        yield _sse(_failure(event).body())
      else:
        finish = event.finish_reason
        if calls is not None:
          for part in _tool_parts(calls[index], calls[index].finish()):
            yield piece(index, part)
          finish = "tool_calls" if calls[index].calls else finish
        yield piece(index, None, finish)
    if include_usage:
      yield _sse(P.chunk(kind, rid, model, created, [], job.usage(), True))
    yield "data: [DONE]\n\n"
  finally:
    job.cancel()


def _tool_parts(stream: T.ToolStream, parts: list) -> list[str | dict]:
  """A ToolStream's output as stream pieces: text, or each call's deltas (numbered in the order they came)."""
  out, first = [], stream.calls - sum(isinstance(p, dict) for p in parts)
  for part in parts:
    if isinstance(part, dict):
      out += T.deltas(part, first)
      first += 1
    elif part:
      out.append(part)
  return out


async def _tokens(fn: Callable, *args):
  """Runs a tokenizer or chat-template call on a worker thread; its ValueError (a template's refusal, text
  that is not Unicode) is a 400."""
  try:
    return await anyio.to_thread.run_sync(functools.partial(fn, *args))
  except ValueError as e:
    raise P.ApiError(400, str(e)) from None


async def _grammar(scheduler: Scheduler, schema, field: str = "response_format", compile=None):
  """The compiled grammar of a response_format's schema (or of `compile`'s source: the tools' call grammar), on
  a worker thread: llguidance compiles it in milliseconds, a large schema in more; None for none. One it
  cannot enforce is a 400 saying why."""
  if schema is None:
    return None
  if scheduler.grammars is None:
    raise P.ApiError(400, f"{field}: structured output is not available on this server: "
                          f"{scheduler.grammars_error}", param=field)
  try:
    return await anyio.to_thread.run_sync(compile or scheduler.grammars.json_schema, schema)
  except ValueError as e:
    raise P.ApiError(400, f"{field}: {e}", param=field) from None


def _chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools=None) -> list[int]:
  return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt, tools=tools))


# ---- endpoints -------------------------------------------------------------------------------------

def create_app(state: ServerState, loader: Callable[[], Scheduler] | None = None,
               api_key: str | None = None, allowed_origins: Sequence[str] = ()) -> Starlette:
  """The app. loader, when given, builds the scheduler on a thread at start-up (GET /health answers 503 until it
  returns); the scheduler is stopped at shutdown, ending the requests in flight. api_key: required of every
  request outside access.OPEN_PATHS (None or "": none). allowed_origins: the web origins ("*": any) whose pages may
  call the API from a browser (CORS)."""

  async def chat(http: HttpRequest) -> Response:
    req = P.parse(P.ChatRequest, await _json_body(http))
    P.check_model(req.model, state.model)
    P.check_supported(req)
    tools, choice = P.tool_setup(req)
    scheduler = state.ready
    ids = await _tokens(_chat_ids, scheduler.tokenizer, P.chat_messages(req), True, tools)
    return await _generate(http, state, req, "chat", [ids], tools=tools, choice=choice)

  async def completions(http: HttpRequest) -> Response:
    req = P.parse(P.CompletionRequest, await _json_body(http))
    P.check_model(req.model, state.model)
    P.check_supported(req)
    scheduler = state.ready
    tok = scheduler.tokenizer
    raw = req.prompt
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
      raw = [raw]
    if not raw or len(raw) > P.MAX_PROMPTS:
      raise P.ApiError(400, f"prompt must hold 1 to {P.MAX_PROMPTS} prompts", param="prompt")
    prompts = []
    for p in raw:
      ids = await _tokens(tok.encode, p) if isinstance(p, str) else list(p)
      P.check_ids(ids, scheduler.engine.config.vocab_size)
      prompts.append(ids)
    echo = [p if isinstance(p, str) else tok.decode(p) for p in raw] if req.echo else None
    return await _generate(http, state, req, "completion", prompts, echo)

  async def models(http: HttpRequest) -> Response:
    data = {"id": state.model, "object": "model", "created": state.created, "owned_by": "jaxllm"}
    if state.scheduler is not None:
      data["max_model_len"] = state.scheduler.engine.max_context
    return JSONResponse({"object": "list", "data": [data]})

  async def health(http: HttpRequest) -> Response:
    if state.scheduler is None:
      status = "error" if state.load_error else "loading"
      return JSONResponse({"status": status, "error": state.load_error}, status_code=503,
                          headers={"Retry-After": str(LOADING_RETRY)})
    return JSONResponse({"status": "ok", "slots": state.scheduler.slots})

  async def metrics(http: HttpRequest) -> Response:
    text = state.scheduler.metrics.render() if state.scheduler is not None else ""
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

  async def tokenize(http: HttpRequest) -> Response:
    req = P.parse(P.TokenizeRequest, await _json_body(http))
    P.check_model(req.model, state.model)
    tok = state.ready.tokenizer
    given = [x for x in (req.prompt, req.content, req.messages) if x is not None]
    if len(given) != 1:
      raise P.ApiError(400, "give exactly one of prompt, content (text) or messages (a chat)")
    if req.messages is not None:
      ids = await _tokens(_chat_ids, tok, P.chat_messages(req), req.add_generation_prompt)
    else:
      ids = await _tokens(tok.encode, given[0], None if req.add_special_tokens else False)
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": state.ready.engine.max_context})

  async def detokenize(http: HttpRequest) -> Response:
    req = P.parse(P.DetokenizeRequest, await _json_body(http))
    P.check_model(req.model, state.model)
    tok = state.ready.tokenizer
    bad = [t for t in req.tokens if not 0 <= t < tok.vocab_size]
    if bad:
      raise P.ApiError(400, f"tokens must be ids in [0, {tok.vocab_size}), got {bad[:5]}", param="tokens")
    text = tok.decode(req.tokens)
    return JSONResponse({"prompt": text, "content": text})

  async def api_error(http: HttpRequest, exc: P.ApiError) -> Response:
    return _error_response(exc)

  async def http_error(http: HttpRequest, exc: HTTPException) -> Response:
    return _error_response(P.ApiError(exc.status_code, f"{http.method} {http.url.path}: {exc.detail}",
                                      kind="invalid_request_error"))

  async def crash(http: HttpRequest, exc: Exception) -> Response:
    traceback.print_exception(exc, file=sys.stderr)
    return _error_response(P.ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error"))

  @contextlib.asynccontextmanager
  async def lifespan(app):
    thread = None
    if loader is not None and state.scheduler is None:
      def load():
        try:
          state.scheduler = loader()
        except Exception as e:  # reported by /health and every endpoint, and on stderr in one line
          state.load_error = str(e).splitlines()[0] if isinstance(e, (ValueError, OSError)) else \
              f"{type(e).__name__}: {e}".splitlines()[0]
          print(f"[jaxllm] error: {state.load_error}", file=sys.stderr, flush=True)
      thread = threading.Thread(target=load, name="jaxllm-load", daemon=True)
      thread.start()
    try:
      yield
    finally:
      if state.scheduler is not None:
        await anyio.to_thread.run_sync(state.scheduler.stop)

  routes = [Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"])]
  return Starlette(routes=routes, lifespan=lifespan, middleware=access.middleware(api_key, allowed_origins),
                   exception_handlers={P.ApiError: api_error, HTTPException: http_error, Exception: crash})
