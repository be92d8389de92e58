"""The OpenAI protocol at the edge: request bodies validated into jaxllm's terms, responses and errors built.

Bodies are untrusted: each is checked by a strict pydantic model (unknown fields, wrong types and values out
of range are refused with the field named), then turned into what the scheduler takes (prompts of token ids,
SamplingParams, limits). Every refusal is an ApiError carrying OpenAI's error JSON and its HTTP status: 400
for bad parameters, types, JSON and prompts that do not fit the context, 404 for an unknown model, 503 when
the queue is full or the model is loading.

Fields OpenAI defines that this server does not implement yet (suffix, best_of other than n) are refused by
name rather than ignored, so a client never gets output that silently differs from what it asked for.
response_format (both endpoints) becomes the JSON schema the output must follow (response_schema); logit_bias
a {token id: bias} map (logit_biases); tools and tool_choice what the chat template and the answer's reading
take (tool_setup; jaxllm.serve.tools).
"""
from __future__ import annotations

import dataclasses
import json
import re
import secrets
import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from jaxllm.sampling import MAX_LOGIT_BIAS, MAX_TOP_K, SamplingParams, bias_table
from jaxllm.structured import JSON_OBJECT

MAX_N = 16               # choices per request
MAX_STOP = 16            # stop strings per request
MAX_STOP_CHARS = 256     # characters per stop string
MAX_PROMPTS = 64         # prompts in one /v1/completions request
MAX_LOGPROBS = 20        # top_logprobs / logprobs at most (slots.TOP_LOGPROBS)
MAX_TOOLS = 128          # functions in one request's tools


class ApiError(Exception):
  """An error response: OpenAI's {"error": {message, type, param, code}} with an HTTP status."""

  def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
               kind: str | None = None, headers: dict | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers or {}
    self.kind = kind or {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
                         503: "service_unavailable_error"}.get(status, "server_error")

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
  """Unknown fields and wrong types refused; a field given as null takes its default (OpenAI's clients and
  libraries such as LangChain send "stop": null, "max_tokens": null, ...)."""
  model_config = ConfigDict(extra="forbid", strict=True)

  @model_validator(mode="before")
  @classmethod
  def _nulls_are_defaults(cls, data):
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Strict):
  include_usage: bool = False


class TextPart(_Strict):
  type: Literal["text"]
  text: str


class FunctionCall(_Strict):
  name: str
  arguments: str                       # JSON text, as OpenAI sends it


class ToolCall(_Strict):
  id: str | None = None
  type: Literal["function"] = "function"
  function: FunctionCall


class Message(_Strict):
  role: Literal["system", "developer", "user", "assistant", "tool"]
  content: Union[str, list[TextPart], None] = None
  name: str | None = None
  tool_calls: list[ToolCall] | None = None   # an assistant's earlier calls
  tool_call_id: str | None = None            # a tool message: the call it answers


class Function(_Strict):
  name: str
  description: str | None = None
  parameters: dict[str, Any] | None = None   # a JSON schema of the arguments
  strict: bool | None = None


class Tool(_Strict):
  type: Literal["function"]
  function: Function


class NamedFunction(_Strict):
  name: str


class ToolChoice(_Strict):
  type: Literal["function"]
  function: NamedFunction


class _Common(_Strict):
  """Fields both endpoints take."""
  model: str | None = None
  max_tokens: int | None = None
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0                       # vLLM and llama-server's extension: 0 or -1 = off
  min_p: float = 0.0
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repetition_penalty: float = 1.0      # vLLM's name for llama.cpp's repeat penalty
  repeat_penalty: float | None = None  # llama-server's name for it
  repeat_last_n: int | None = None     # llama-server's: the last tokens the penalties look at (the engine's default)
  stop: Union[str, list[str], None] = None
  seed: int | None = None
  n: int = 1
  stream: bool = False
  stream_options: StreamOptions | None = None
  user: str | None = None
  ignore_eos: bool = False             # vLLM's extension
  response_format: dict[str, Any] | None = None   # on /v1/completions too, as vLLM takes it
  # OpenAI's bookkeeping fields: accepted, without effect here.
  store: bool | None = None
  metadata: dict[str, str] | None = None
  service_tier: str | None = None
  logit_bias: dict[str, float] | None = None     # {"token id": bias in [-100, 100]}: logit_biases()


class ChatRequest(_Common):
  messages: list[Message]
  max_completion_tokens: int | None = None
  logprobs: bool = False
  top_logprobs: int | None = None
  tools: list[Tool] | None = None
  tool_choice: Union[Literal["none", "auto", "required"], ToolChoice, None] = None
  parallel_tool_calls: bool | None = None


class CompletionRequest(_Common):
  prompt: Union[str, list[int], list[str], list[list[int]]]
  echo: bool = False
  logprobs: int | None = None
  suffix: str | None = None
  best_of: int | None = None


class TokenizeRequest(_Strict):
  model: str | None = None
  prompt: str | None = None            # vLLM's name
  content: str | None = None           # llama-server's name
  messages: list[Message] | None = None
  add_special_tokens: bool = True
  add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
  model: str | None = None
  tokens: list[int]


def parse(model: type[BaseModel], body: Any) -> BaseModel:
  """The request model of a decoded JSON body, or ApiError 400 naming the first bad field."""
  if not isinstance(body, dict):
    raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
  try:
    return model.model_validate(body)
  except ValidationError as e:
    err = e.errors()[0]
    where = ".".join(str(x) for x in err["loc"]) or None
    if err["type"] == "extra_forbidden":
      message = f"unknown field {where!r}: this server does not take it"
    elif err["type"] == "missing":
      message = f"{where!r} is required"
    else:
      message = f"{where}: {err['msg']} (got {_short(err.get('input'))})"
    raise ApiError(400, message, param=where) from None


def _short(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 80 else text[:77] + "..."


def check_model(name: str | None, served: str) -> None:
  if name is not None and name != served:
    raise ApiError(404, f"the model {name!r} does not exist: this server serves {served!r}", param="model",
                   code="model_not_found")


def _refuse(field: str, why: str = "is not supported by this server yet") -> None:
  raise ApiError(400, f"{field} {why}", param=field)


def check_supported(req: _Common) -> None:
  """Refuses the OpenAI fields this server does not implement, by name."""
  if isinstance(req, ChatRequest):
    if req.top_logprobs is not None and not req.logprobs:
      raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
  else:
    if req.suffix:
      _refuse("suffix")
    if req.best_of is not None and req.best_of != req.n:
      _refuse("best_of", "other than n is not supported by this server")
  top = req.top_logprobs if isinstance(req, ChatRequest) else req.logprobs
  if top is not None and not 0 <= top <= MAX_LOGPROBS:
    name = "top_logprobs" if isinstance(req, ChatRequest) else "logprobs"
    raise ApiError(400, f"{name} must be in [0, {MAX_LOGPROBS}], got {top}", param=name)
  if not 1 <= req.n <= MAX_N:
    raise ApiError(400, f"n must be in [1, {MAX_N}], got {req.n}", param="n")


def response_schema(req: _Common) -> dict | None:
  """The JSON schema that response_format asks the output to follow: None for {"type": "text"} (or none given),
  any JSON object for {"type": "json_object"}, json_schema.schema for {"type": "json_schema", "json_schema":
  {"name", "schema", "strict", "description"}}; anything else is a 400 saying what was expected. (Whether the
  schema is one the grammar library enforces is checked when it is compiled.)"""
  rf = req.response_format
  if rf is None:
    return None

  def bad(message: str) -> None:
    raise ApiError(400, f"response_format{message}", param="response_format")
  kind = rf.get("type")
  allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
  if kind not in allowed:
    bad(f".type must be 'text', 'json_object' or 'json_schema', got {_short(kind)}")
  if set(rf) - allowed[kind]:
    bad(f" of type {kind!r} takes only {sorted(allowed[kind])}, got {sorted(rf)}")
  if kind == "text":
    return None
  if kind == "json_object":
    return JSON_OBJECT
  spec = rf.get("json_schema")
  if not isinstance(spec, dict):
    bad(f".json_schema must be an object {{name, schema, strict}}, got {_short(spec)}")
  if set(spec) - {"name", "schema", "strict", "description"}:
    bad(f".json_schema takes name, schema, strict and description, got {sorted(spec)}")
  if not isinstance(spec.get("name", ""), str) or not isinstance(spec.get("strict", False), (bool, type(None))):
    bad(f".json_schema: name must be a string and strict a boolean, got {_short(spec.get('name'))} and "
        f"{_short(spec.get('strict'))}")
  if not isinstance(spec.get("schema"), dict):
    bad(f".json_schema.schema must be a JSON schema (an object), got {_short(spec.get('schema'))}")
  return spec["schema"]


FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")     # OpenAI's rule for a function's name


def tool_setup(req: ChatRequest) -> tuple[list[dict] | None, str | tuple[str, str] | None]:
  """(the tools as the chat template takes them, or None; the choice: None for no tools or "none", "auto",
  "required" or ("function", its name) for a named function, kept apart from the keywords: a function may be
  called "auto"). tool_choice "none" gives the template no tools and reads no calls."""
  choice = req.tool_choice
  if isinstance(choice, ToolChoice):
    choice = ("function", choice.function.name)
  if not req.tools:
    if choice not in (None, "none"):
      what = f"naming the function {choice[1]!r}" if isinstance(choice, tuple) else repr(choice)
      raise ApiError(400, f"tool_choice {what} needs tools: none are given", param="tool_choice")
    return None, None
  if len(req.tools) > MAX_TOOLS:
    raise ApiError(400, f"tools takes at most {MAX_TOOLS} functions, got {len(req.tools)}", param="tools")
  names = [t.function.name for t in req.tools]
  if len(set(names)) != len(names):
    raise ApiError(400, f"tools must name each function once, got {_short(names)}", param="tools")
  for tool in req.tools:
    fn = tool.function
    if not FUNCTION_NAME.fullmatch(fn.name):
      raise ApiError(400, f"a function's name must be 1 to 64 letters, digits, '_' or '-', got {_short(fn.name)}",
                     param="tools")
    if fn.parameters is not None and fn.parameters.get("type", "object") != "object":
      raise ApiError(400, f"function {fn.name!r}: parameters must be an object's schema (type 'object'), got type "
                          f"{_short(fn.parameters.get('type'))}", param="tools")
  if choice == "none":
    return None, None
  choice = choice or "auto"
  if isinstance(choice, tuple) and choice[1] not in names:
    raise ApiError(400, f"tool_choice names the function {choice[1]!r}, which is not among tools {_short(names)}",
                   param="tool_choice")
  if choice != "auto" and req.response_format is not None and req.response_format.get("type") != "text":
    raise ApiError(400, "tool_choice 'required' or a named function constrains the output; it cannot be "
                        "combined with response_format", param="tool_choice")
  return [t.model_dump(exclude_none=True) for t in req.tools], choice


def sampling(req: _Common, wide_top_k: bool = False,
             vocab_size: int | None = None) -> tuple[SamplingParams, int | None, list[str]]:
  """The request's SamplingParams (the engine's checks, as 400s), its seed and its stop strings. wide_top_k:
  whether the server compiled the wide step (--wide-top-k), which a top_k above MAX_TOP_K needs; a top_k of
  at least vocab_size keeps every token: no top-k (the wide step would sort for nothing)."""
  repeat = req.repeat_penalty if req.repeat_penalty is not None else req.repetition_penalty
  top_k = 0 if req.top_k == -1 or (vocab_size is not None and req.top_k >= vocab_size) else req.top_k
  extra = {}
  if req.repeat_last_n is not None:
    if "repeat_last_n" not in {f.name for f in dataclasses.fields(SamplingParams)}:
      _refuse("repeat_last_n", "is not supported by this engine's sampler")
    extra["repeat_last_n"] = req.repeat_last_n
  try:
    params = SamplingParams(temperature=req.temperature, top_k=top_k, top_p=req.top_p, min_p=req.min_p,
                            repeat_penalty=repeat, presence_penalty=req.presence_penalty,
                            frequency_penalty=req.frequency_penalty, **extra)
  except ValueError as e:
    raise ApiError(400, str(e), param=str(e).split(" ")[0]) from None
  if params.wide_top_k and not wide_top_k:          # sampling with a top_k beyond the candidates
    raise ApiError(400, f"top_k must be in [0, {MAX_TOP_K}] on this server when sampling (0 or -1 = off), got "
                        f"{req.top_k}; a server started with --wide-top-k takes more", param="top_k")
  if req.seed is not None and not 0 <= req.seed < 2 ** 63 - MAX_N:
    raise ApiError(400, f"seed must be an integer in [0, 2^63 - {MAX_N}), got {req.seed}", param="seed")
  stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
  if len(stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stop):
    raise ApiError(400, f"stop takes at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters",
                   param="stop")
  return params, req.seed, stop


def logit_biases(req: _Common, vocab_size: int) -> dict[int, float] | None:
  """logit_bias as {token id: bias}: keys are token ids written as decimal strings (OpenAI's JSON), each once;
  the ids, biases and their count as the device's table takes them (sampling.bias_table: at most
  MAX_LOGIT_BIAS, ids in [0, vocab_size), biases in [-100, 100]). None when none is given."""
  if not req.logit_bias:
    return None
  if len(req.logit_bias) > MAX_LOGIT_BIAS:     # before reading the keys: a 16 MiB body holds a million of them
    raise ApiError(400, f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(req.logit_bias)}",
                   param="logit_bias")
  out: dict[int, float] = {}
  for key, bias in req.logit_bias.items():
    token = int(key) if 1 <= len(key) <= 10 and key.isascii() and key.isdigit() else None   # past int()'s limit
    if token is None:
      raise ApiError(400, f"logit_bias keys must be token ids in [0, {vocab_size}) written as strings, got "
                          f"{_short(key)}", param="logit_bias")
    if token in out:
      raise ApiError(400, f"logit_bias gives token {token} twice ({_short(key)})", param="logit_bias")
    out[token] = bias
  try:
    bias_table([out], 1, vocab_size)
  except ValueError as e:
    raise ApiError(400, f"logit_bias: {e}", param="logit_bias") from None
  return {token: float(bias) for token, bias in out.items()}


def logprobs_wanted(req: _Common) -> tuple[int | None, bool]:
  """(alternatives per token, or None for no logprobs; whether the prompt's are wanted too: echo)."""
  if isinstance(req, ChatRequest):
    if not req.logprobs:
      return None, False
    return req.top_logprobs or 0, False
  return req.logprobs, req.logprobs is not None and req.echo


def seeds(seed: int | None, n: int) -> list[int]:
  """One seed per choice: seed + i, or random ones when none is given."""
  base = secrets.randbelow(2 ** 62) if seed is None else seed
  return [base + i for i in range(n)]


def max_new_tokens(req: _Common, prompt_len: int, max_context: int) -> int:
  """New tokens at most for a prompt: what the request asks (refused when the prompt and it do not fit the
  context, as OpenAI and vLLM refuse), else the rest of the context."""
  asked = req.max_completion_tokens if isinstance(req, ChatRequest) and req.max_completion_tokens is not None \
      else req.max_tokens
  name = "max_completion_tokens" if isinstance(req, ChatRequest) and req.max_completion_tokens is not None \
      else "max_tokens"
  if prompt_len >= max_context:
    raise ApiError(400, f"the prompt has {prompt_len} tokens but this server's context holds {max_context} "
                        "(--max-context): shorten it", param="messages" if isinstance(req, ChatRequest) else "prompt",
                   code="context_length_exceeded")
  if asked is None:
    return max_context - prompt_len
  echo = isinstance(req, CompletionRequest) and req.echo
  if asked < 1 and not (asked == 0 and echo):
    raise ApiError(400, f"{name} must be at least 1 (0 only with echo: the prompt scored, nothing generated), "
                        f"got {asked}", param=name)
  if prompt_len + asked > max_context:
    raise ApiError(400, f"this server's context holds {max_context} tokens; the prompt has {prompt_len} and "
                        f"{name} asks for {asked} more ({prompt_len + asked} > {max_context}): ask for at most "
                        f"{max_context - prompt_len}", param=name, code="context_length_exceeded")
  return asked


def check_ids(ids: list[int], vocab_size: int) -> None:
  """A prompt's token ids: at least one, each in the vocabulary."""
  if not ids:
    raise ApiError(400, "the prompt is empty: give at least one token", param="prompt")
  bad = [t for t in ids if not 0 <= t < vocab_size]
  if bad:
    raise ApiError(400, f"prompt token ids must be in [0, {vocab_size}), got {bad[:5]}", param="prompt")


def chat_messages(req: ChatRequest | TokenizeRequest) -> list[dict]:
  """The messages as the chat template takes them: {"role", "content"} with the text parts joined, and where
  given "name", "tool_call_id" and "tool_calls" ({"id", "type", "function": {"name", "arguments"}}, the
  arguments decoded from their JSON text where it holds an object, as vLLM passes them: templates write them
  with tojson)."""
  if not req.messages:
    raise ApiError(400, "messages must hold at least one message", param="messages")
  out = []
  for m in req.messages:
    content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
    message = {"role": m.role, "content": content}
    for key in ("name", "tool_call_id"):
      if getattr(m, key) is not None:
        message[key] = getattr(m, key)
    if m.tool_calls:
      message["tool_calls"] = [{"id": c.id, "type": c.type, "function": {"name": c.function.name,
                                                                         "arguments": _arguments(c.function)}}
                               for c in m.tool_calls]
    out.append(message)
  return out


def _arguments(fn: FunctionCall) -> Any:
  try:
    value = json.loads(fn.arguments)
  except (ValueError, RecursionError):
    return fn.arguments
  return value if isinstance(value, dict) else fn.arguments


# ---- responses ---------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
  return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


def chunk(kind: str, rid: str, model: str, created: int, choices: list, usage_: dict | None = None,
          include_usage: bool = False) -> dict:
  """A streamed chunk: chat.completion.chunk (choices of deltas) or text_completion (choices of texts)."""
  out = {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion", "created": created,
         "model": model, "choices": choices}
  if include_usage:
    out["usage"] = usage_
  return out


def now() -> int:
  return int(time.time())
