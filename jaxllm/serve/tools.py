"""OpenAI tool calling: the tools in the prompt, the calls in the answer, and the grammar that forces a call.

The tools reach the model through the GGUF's chat template (its `tools` variable, as HF transformers'
apply_chat_template passes them: Tokenizer.apply_chat_template(..., tools=)); the template decides how the model
is told to call them. Two call formats
are read back, the two families' templates ask for:

  "hermes"  <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call> blocks, any number, text around them
            (Qwen2.5, Hermes, and the templates that copy them: a template that mentions <tool_call>);
  "json"    the whole answer one JSON object {"name": ..., "parameters" or "arguments": {...}} (Llama 3.1).

Both are read from every answer (a "json" answer is one whose first character is "{"); a call counts only when
its JSON parses, its name is one of the request's tools and its arguments are an object. Anything else (a
block whose JSON does not parse, an unknown name) stays in the content as the model wrote it, never an error.

ToolStream reads an answer as it streams: text goes out as it comes, except a tail that may be the start of
"<tool_call>" (held until the next text says), a block until it closes (then a call, or its text), and an
answer that starts with "{" (held to the end, then a call or its text). parse() is ToolStream over a whole
answer, so streamed and whole answers agree.

grammar() is the Lark grammar (llguidance's, a %json rule per function's parameters) of one call in the family's
format, for tool_choice "required" or a named function: the output then is such a call, whatever the weights.
"""
from __future__ import annotations

import json
import math
import re
import secrets
from typing import Iterable

from jaxllm.structured import WHITESPACE

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def family(chat_template: str | None) -> str:
  """The call format a chat template asks for: "hermes" where it mentions <tool_call>, else "json"."""
  return "hermes" if chat_template and OPEN in chat_template else "json"


def new_call(name: str, arguments: dict) -> dict:
  """A tool call as OpenAI returns it: arguments as JSON text (ASCII, finite numbers only), a fresh id.
  ValueError where the arguments have no such text (a lone surrogate, NaN or an infinity)."""
  text = json.dumps(arguments, ensure_ascii=True, allow_nan=False)
  return {"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": {"name": name, "arguments": text}}


def _no_constant(name: str):
  raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
  value = float(text)
  if not math.isfinite(value):            # 1e999 reads as inf
    raise ValueError(f"{text} is not a finite number")
  return value


def _json(text: str):
  """Strict JSON: NaN, Infinity and numbers past a double's range refused (ValueError)."""
  return json.loads(text, parse_constant=_no_constant, parse_float=_finite)


def read_call(text: str, names: frozenset[str]) -> dict | None:
  """The call a JSON text holds ({"name", "arguments" or "parameters"}), or None where it holds none."""
  try:
    obj = _json(text)
    if not isinstance(obj, dict):
      return None
    name = obj.get("name")
    if not isinstance(name, str) or name not in names:
      return None
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    if isinstance(args, str):          # some models write the arguments as a JSON string
      args = _json(args)
    return new_call(name, args) if isinstance(args, dict) else None
  except (ValueError, RecursionError):
    return None


def _held(text: str) -> int:
  """How many of text's last characters may be the start of OPEN."""
  for n in range(min(len(text), len(OPEN) - 1), 0, -1):
    if OPEN.startswith(text[-n:]):
      return n
  return 0


_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")
_SLACK = 16     # JSON cut short fails within this many characters of its end ("-Infinit", "\\u12", "1e-"), or
                # as an "Unterminated string": a failure before them stays whatever follows


def _block_end(text: str, final: bool) -> int | None:
  """Where the block that text starts with (OPEN) ends: the index past its CLOSE, or None where it does not end
  in text. Its JSON (an object after OPEN and whitespace) is read with raw_decode: whitespace and CLOSE after
  it end the block, whatever its strings hold; where it does not parse, or something else follows it, the first
  CLOSE does (the block then stays content). Not final (more text may come): None also while that text may
  still decide."""
  start = _WS.match(text, len(OPEN)).end()
  if text.startswith("{", start):
    try:
      _, end = _DECODER.raw_decode(text, start)
    except json.JSONDecodeError as e:
      if not final and (e.pos >= len(text) - _SLACK or e.msg.startswith("Unterminated string")):
        return None
    except RecursionError:
      pass
    else:
      after = _WS.match(text, end).end()
      if text.startswith(CLOSE, after):
        return after + len(CLOSE)
      if not final and len(text) - after < len(CLOSE) and CLOSE.startswith(text[after:]):
        return None
  end = text.find(CLOSE, len(OPEN))
  return None if end < 0 else end + len(CLOSE)


class ToolStream:
  """Reads one answer's text as it streams: feed(text) and finish() return what may go out now, in order:
  strings (content) and calls (new_call's dicts). `calls` counts the calls so far. parallel=False: the calls
  after the first are dropped (neither calls nor content). Each piece costs its own length (and a block's text
  is read again only when a CLOSE arrives in it, or it has doubled since), not the answer's so far."""

  def __init__(self, names: Iterable[str], parallel: bool = True):
    self.names = frozenset(names)
    self.parallel = parallel
    self.calls = 0
    self._text = ""              # outside a block: a tail that may begin OPEN
    self._parts: list[str] = []  # held text in pieces: leading whitespace, a JSON answer, or a block from its OPEN
    self._started = False        # a character other than whitespace seen
    self._json = False           # the answer starts with "{": held to the end
    self._in_block = False
    self._new_block()

  def _new_block(self) -> None:
    self._parts, self._size, self._tail = [], 0, ""
    self._read_at, self._reads, self._closed = 0, 0, False    # _size at the last read, reads, a CLOSE seen

  def feed(self, text: str) -> list:
    if not self._started:
      if not text.strip():
        self._parts.append(text)
        return []
      self._started = True
      text, self._parts = "".join(self._parts) + text, []
      self._json = text.lstrip().startswith("{")
    if self._json:
      self._parts.append(text)
      return []
    return self._run(text, final=False)

  def finish(self) -> list:
    """What is left at the end of the answer: a held JSON answer as a call or text, an unclosed block as a
    call (when it holds a whole one) or text, a held tail as text."""
    if not self._started:
      rest, self._parts = "".join(self._parts), []
      return [rest] if rest else []
    if self._json:
      self._json = False
      rest, self._parts = "".join(self._parts), []
      call = read_call(rest.strip(), self.names)
      if call is not None:
        self.calls += 1
        return [call]
      return self._run(rest, final=True)
    return self._run("", final=True)

  def _run(self, text: str, final: bool) -> list:
    out = []
    while True:
      if self._in_block:
        end = self._grow(text, final)
        if end is None and not final:
          return out
        block = self._parts[0]
        end = len(block) if end is None else end
        out.append(self._block(block[:end]))
        text, self._in_block = block[end:], False
        self._new_block()
        if final and not text:
          return out
      text, self._text = self._text + text, ""
      at = text.find(OPEN)
      if at < 0:
        keep = len(text) if final else len(text) - _held(text)
        if keep:
          out.append(text[:keep])
        self._text = text[keep:]
        return out
      if at:
        out.append(text[:at])
      text, self._in_block = text[at:], True

  def _grow(self, text: str, final: bool) -> int | None:
    """Adds text to the block; _block_end of it where it is worth reading (then _parts holds it joined)."""
    seen = CLOSE in self._tail + text
    self._tail = (self._tail + text)[1 - len(CLOSE):]
    self._parts.append(text)
    self._size += len(text)
    self._closed |= seen
    if not (final or (seen and self._reads < 8) or (self._closed and self._size >= 2 * self._read_at)):
      return None
    self._parts = ["".join(self._parts)]
    self._read_at, self._reads = self._size, self._reads + 1
    return _block_end(self._parts[0], final)

  def _block(self, block: str):
    body = block[len(OPEN):]
    call = read_call((body[:-len(CLOSE)] if body.endswith(CLOSE) else body).strip(), self.names)
    if call is None:
      return block
    if self.calls and not self.parallel:
      return ""
    self.calls += 1
    return call


def parse(text: str, names: Iterable[str], parallel: bool = True) -> tuple[str | None, list[dict]]:
  """(content, calls) of a whole answer. With calls, content is the text around them stripped (None when
  there is none); without, the answer as it is. parallel=False: only the first call."""
  stream = ToolStream(names, parallel)
  parts = stream.feed(text) + stream.finish()
  calls = [p for p in parts if isinstance(p, dict)]
  content = "".join(p for p in parts if isinstance(p, str))
  if calls:
    content = content.strip() or None
  return content, calls


def deltas(call: dict, index: int) -> list[dict]:
  """A call as OpenAI streams it: a delta with its index, id, type and name, then one with its arguments."""
  fn = call["function"]
  return [{"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                           "function": {"name": fn["name"], "arguments": ""}}]},
          {"tool_calls": [{"index": index, "function": {"arguments": fn["arguments"]}}]}]


def grammar(tools: list[dict], choice: str | tuple[str, str], fmt: str) -> str:
  """The Lark grammar of one call in format `fmt` ("hermes" or "json") to the function ("function", name)
  names, or to any of `tools` for "required": {"name": its name, "arguments" ("parameters" for "json"): JSON
  that its parameters' schema validates}. Each function's parameters are their own %json rule, so each schema
  is its own root: its "$ref"s ("#", "#/$defs/...", "#/definitions/...") point into it alone. Names are
  OpenAI's (protocol.tool_setup): letters, digits, "_" and "-", safe in a Lark string."""
  key = "arguments" if fmt == "hermes" else "parameters"
  rules = []
  for tool in tools:
    fn = tool["function"]
    if choice != "required" and ("function", fn["name"]) != choice:
      continue
    schema = dict(fn.get("parameters") or {"type": "object"})
    schema["x-guidance"] = {"whitespace_pattern": WHITESPACE}
    i = len(rules)
    rules.append(f'call_{i}: "{{\\"name\\": \\"{fn["name"]}\\", \\"{key}\\": " args_{i} "}}"\n'
                 f"args_{i}: %json {json.dumps(schema)}\n")
  call = "call: " + " | ".join(f"call_{i}" for i in range(len(rules))) + "\n" + "".join(rules)
  if fmt == "hermes":
    return f'start: "{OPEN}\\n" call "\\n{CLOSE}"\n' + call
  return "start: call\n" + call
