"""Tool calling and logit_bias on the server (jaxllm.serve.tools, protocol, the slots' biases).

Unit tests read fixed model answers (the call formats, streamed in every split); the server tests run the tiny
random model with a short Qwen-like tools template, where tool_choice "required" or a named function must
still give a valid call (the grammar forces it) and logit_bias must force or ban tokens, batched or alone.
"""
from __future__ import annotations

import json
import queue
import random

import jsonschema
import openai
import pytest

from jaxllm import GGUFFile, SamplingParams, Tokenizer
from jaxllm.serve import tools as T
from jaxllm.serve.scheduler import Delta, Done, Request
from jaxllm.weights import load_weights
from test_chat_template import QWEN25, _tokenizer
from test_serve import metric, post, serve_model
from tiny import write_tiny_model

# The module's tests share a costly module fixture: under xdist one worker runs them all, setting it up once
# (bench/gpu_check.sh runs --dist loadgroup).
pytestmark = pytest.mark.xdist_group("serve_tools")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
NAMES = ["get_weather", "get_time"]
# Qwen2.5's tools part, short (the tiny model's tokens are bytes: the real template's system text is ~700).
TEMPLATE = ("{%- if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
            "Call as <tool_call></tool_call><|im_end|>\n{% endif %}"
            "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
            "{%- for c in m.tool_calls or [] %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
            "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
            "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HISTORY = [{"role": "user", "content": "Weather?"},
           {"role": "assistant", "content": None,
            "tool_calls": [{"id": "call_1", "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
           {"role": "user", "content": "And?"}]


# ---- the prompt ------------------------------------------------------------------------------------

def test_qwen25_template_renders_tools_calls_and_tool_results():
  from jaxllm.serve.protocol import ChatRequest, chat_messages
  messages = chat_messages(ChatRequest.model_validate({"messages": HISTORY}))
  tok = _tokenizer(**{"tokenizer.chat_template": QWEN25})    # tests/tiny.py's vocabulary, Qwen2.5's template
  text = tok.apply_chat_template(messages, tools=TOOLS)
  listed = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]      # one tool a line, as tojson writes it
  assert [json.loads(line) for line in listed.splitlines()] == TOOLS
  assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>' in text
  assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
  assert text.endswith("<|im_start|>assistant\n")
  assert "# Tools" not in tok.apply_chat_template(messages)
  assert "# Tools" not in tok.apply_chat_template(messages, tools=[])
  assert T.family(QWEN25) == "hermes" and T.family("{{ messages }}") == "json"


# ---- reading answers ---------------------------------------------------------------------------------

def _calls(calls):
  return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


ANSWERS = [   # (a model's answer, the content and the calls read from it)
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>', None,
     [("get_time", {"zone": "UTC"})]),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n<tool_call>\n'
     '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>', None,
     [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "days": 1})]),
    ('Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>', "Let me look.",
     [("get_time", {"zone": "CET"})]),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": \n</tool_call>',       # malformed JSON: content
     '<tool_call>\n{"name": "get_time", "arguments": {"zone": \n</tool_call>', []),
    ('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',              # not one of the tools
     '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', []),
    ('{"name": "get_weather", "parameters": {"city": "Rome", "days": 3}}', None,    # Llama 3.1's
     [("get_weather", {"city": "Rome", "days": 3})]),
    (' {"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}', None, [("get_time", {"zone": "UTC"})]),
    ('{"name": "get_time"', '{"name": "get_time"', []),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}', None,       # unclosed at the end
     [("get_time", {"zone": "UTC"})]),
    ("a < b and <tool", "a < b and <tool", []),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "</tool_call>"}}\n</tool_call>', None,  # CLOSE in JSON
     [("get_time", {"zone": "</tool_call>"})]),
    ('<tool_call>{"name": "get_time", "arguments": {"zone": "a</tool_call>b"}}</tool_call> <tool_call>\n'
     '{"name": "get_time", "arguments": {"zone": 5 </tool_call>\n',                # the second broken: content
     '<tool_call>\n{"name": "get_time", "arguments": {"zone": 5 </tool_call>',
     [("get_time", {"zone": "a</tool_call>b"})]),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": \n</tool_call> then <tool_call>\n'   # broken, then a call
     '{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>', '<tool_call>\n{"name": "get_time", '
     '"arguments": {"zone": \n</tool_call> then', [("get_time", {"zone": "UTC"})]),
    ('<tool_call>{"name": "get_time", "arguments": {}} junk</tool_call> after', # JSON, then not CLOSE: content
     '<tool_call>{"name": "get_time", "arguments": {}} junk</tool_call> after', []),
    ('<tool_call>{"name": "get_time", "arguments": {"zone": "</tool_call> x', # never ends: first CLOSE, content
     '<tool_call>{"name": "get_time", "arguments": {"zone": "</tool_call> x', []),
    ("plain text", "plain text", []),
]


@pytest.mark.parametrize("text, content, calls", ANSWERS)
def test_parse_answers(text, content, calls):
  got_content, got = T.parse(text, NAMES)
  assert got_content == content and _calls(got) == calls
  assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got)
  assert len({c["id"] for c in got}) == len(got)


NOT_CALLS = [   # answers whose JSON is no call: each stays content, whole or streamed, never an error
    '<tool_call>\n{"name": ["get_time"], "arguments": {}}\n</tool_call>',        # a name that is not a string
    '{"name": {"get_time": 1}, "arguments": {}}',
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": NaN}}\n</tool_call>',          # not JSON
    '{"name": "get_time", "arguments": {"zone": Infinity}}',
    '{"name": "get_time", "arguments": {"zone": -Infinity}}',
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1e999}}\n</tool_call>',        # past a double
    '{"name": "get_time", "arguments": "{\\"zone\\": NaN}"}',
]


@pytest.mark.parametrize("text", NOT_CALLS)
def test_answers_that_hold_no_call_stay_content(text):
  assert T.parse(text, NAMES) == (text, [])
  stream = T.ToolStream(NAMES)
  assert "".join(stream.feed(text[:9]) + stream.feed(text[9:]) + stream.finish()) == text


def test_call_arguments_go_out_as_ascii_json():
  """Arguments are re-emitted as ASCII JSON text: a lone surrogate the model escaped stays an escape (the
  response encodes as UTF-8), numbers stay finite."""
  _, calls = T.parse('{"name": "get_time", "arguments": {"zone": "\u00e9\\u00e9 \\ud83d\\ude00", "n": 1.5e300}}',
                     NAMES)
  text = calls[0]["function"]["arguments"]
  assert text.isascii() and json.loads(text) == {"zone": "\u00e9\u00e9 \U0001F600", "n": 1.5e300}
  _, calls = T.parse('<tool_call>\n{"name": "get_time", "arguments": {"zone": "\\ud800"}}\n</tool_call>', NAMES)
  assert calls[0]["function"]["arguments"].encode() and json.loads(calls[0]["function"]["arguments"]) == {"zone": "\ud800"}


def test_streamed_answers_assemble_to_the_whole_answers_reading():
  """Every answer of test_parse_answers, cut into random pieces and fed to a ToolStream: the content streamed
  never holds call markup, and content and calls equal parse()'s of the whole."""
  rng = random.Random(0)
  answers = [a[0] for a in ANSWERS]
  answers.append('Hi <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call> bye')
  for text in answers:
    want_content, want = T.parse(text, NAMES)
    for _ in range(30):
      cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
      stream, parts = T.ToolStream(NAMES), []
      for a, b in zip([0] + cuts, cuts + [len(text)]):
        parts += stream.feed(text[a:b])
      parts += stream.finish()
      content = "".join(p for p in parts if isinstance(p, str))
      calls = [p for p in parts if isinstance(p, dict)]
      assert _calls(calls) == _calls(want) and stream.calls == len(want), (text, cuts)
      assert (content.strip() or None if want else content) == want_content, (text, cuts)
      if want and T.OPEN not in (want_content or ""):       # no call's markup goes out as content
        assert T.OPEN not in content and '"name"' not in content


def test_a_long_block_streams_in_linear_work(monkeypatch):
  """80k pieces of 4 characters in one block (and a block whose strings hold 20k CLOSE tags): the block's text
  is read again only when a CLOSE arrives or it has doubled, so the characters read stay a few times the text's
  (searching the whole held block on every piece was quadratic: 3.4 s on the event loop)."""
  read = []
  block_end = T._block_end
  monkeypatch.setattr(T, "_block_end", lambda text, final: read.append(len(text)) or block_end(text, final))
  for zone in ["abcd" * 80_000, T.CLOSE * 20_000]:
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "' + zone + '"}}\n</tool_call>'
    read.clear()
    stream = T.ToolStream(NAMES)
    parts = [p for i in range(0, len(text), 4) for p in stream.feed(text[i:i + 4])] + stream.finish()
    assert len(parts) == 1 and json.loads(parts[0]["function"]["arguments"]) == {"zone": zone}
    assert sum(read) <= 4 * len(text), (len(read), sum(read), len(text))


def test_parallel_tool_calls_false_keeps_the_first_call():
  """parallel_tool_calls false: the first call only; the later call blocks are dropped (not content), streamed
  or not; text around them and blocks that are not calls stay."""
  text = ('A <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call> B <tool_call>\n'
          '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call> <tool_call>x</tool_call>')
  content, calls = T.parse(text, NAMES, parallel=False)
  assert _calls(calls) == [("get_time", {"zone": "UTC"})] and content == "A  B  <tool_call>x</tool_call>"
  assert len(T.parse(text, NAMES)[1]) == 2
  stream = T.ToolStream(NAMES, parallel=False)
  parts = [p for i in range(0, len(text), 3) for p in stream.feed(text[i:i + 3])] + stream.finish()
  assert stream.calls == 1 and _calls([p for p in parts if isinstance(p, dict)]) == _calls(calls)
  assert "".join(p for p in parts if isinstance(p, str)).strip() == content


def test_tool_setup_checks_names_and_parameters_and_keeps_a_named_choice_apart():
  """Function names follow OpenAI's ^[a-zA-Z0-9_-]{1,64}$, parameters are an object's schema (both 400s on
  tools); a function called "auto" (or "none", "required") named by tool_choice is that function, forced."""
  from jaxllm.serve.protocol import ApiError, ChatRequest, tool_setup

  def setup(tools, choice=None):
    return tool_setup(ChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                                  "tool_choice": choice}))

  def fn(name, parameters=None):
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}
  for tools in [[fn('a"b')], [fn("a\nb")], [fn("<tool_call>")], [fn("")], [fn("x" * 65)], [fn("é")],
                [fn("f", {"type": "array"})], [fn("f", {"type": ["object", "null"]})]]:
    with pytest.raises(ApiError) as e:
      setup(tools)
    assert e.value.status == 400 and e.value.param == "tools", tools
  assert setup([fn("x" * 64), fn("a-B_9", {"properties": {}})])[1] == "auto"
  keywords = [fn("auto", {"type": "object", "properties": {"a": {"const": 1}}}), fn("required"), fn("none")]
  for name in ["auto", "required", "none"]:
    tools, choice = setup(keywords, {"type": "function", "function": {"name": name}})
    assert choice == ("function", name) and len(tools) == 3
    lark = T.grammar(tools, choice, "json")
    assert f'{{\\"name\\": \\"{name}\\", ' in lark and "call_0:" in lark and "call_1" not in lark
  assert setup(keywords, "auto")[1] == "auto" and setup(keywords, "none") == (None, None)


# ---- the server ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
  gf = GGUFFile(write_tiny_model(tmp_path_factory.mktemp("tools") / "tiny.gguf", "qwen2", context=1024))
  tok = Tokenizer(dict(gf.metadata, **{"tokenizer.chat_template": TEMPLATE}), source="tiny-tools")
  s = serve_model(gf.config, load_weights(gf, progress=False), tok, max_context=1024, prefill_chunk=64)
  yield s
  s.stop()


@pytest.fixture(scope="module")
def client(served):
  return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)


def _streamed_calls(stream) -> tuple[list[dict], str, list]:
  """OpenAI's streamed tool_calls deltas assembled as a client does (by index), the content, the finishes."""
  calls, content, finishes = {}, "", []
  for chunk in stream:
    choice = chunk.choices[0]
    content += choice.delta.content or ""
    for d in choice.delta.tool_calls or []:
      call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
      call["id"] = d.id or call["id"]
      call["name"] += (d.function.name or "") if d.function else ""
      call["arguments"] += (d.function.arguments or "") if d.function else ""
    if choice.finish_reason:
      finishes.append(choice.finish_reason)
  return [calls[i] for i in sorted(calls)], content, finishes


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choice_forces_a_valid_call(served, client, choice):
  """The random model under tool_choice "required" or a named function answers with a call whose arguments
  validate against the function's schema, finish_reason "tool_calls", streamed or not; the prompt is the
  template's rendering with the tools and the history's calls and results."""
  before = post(served.url, "/metrics", None, method="GET")[2]
  schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
  want = NAMES if choice == "required" else ["get_weather"]
  from jaxllm.serve.protocol import ChatRequest, chat_messages
  prompt = served.tokenizer.encode(served.tokenizer.apply_chat_template(chat_messages(ChatRequest.model_validate(
      {"messages": HISTORY})), tools=TOOLS))
  for seed in range(3):
    kw = dict(model="tiny", messages=HISTORY, tools=TOOLS, tool_choice=choice, max_tokens=250, temperature=1.0,
              seed=seed)
    reply = client.chat.completions.create(**kw)
    c = reply.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in want
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert reply.usage.prompt_tokens == len(prompt)
    calls, content, finishes = _streamed_calls(client.chat.completions.create(stream=True, **kw))
    assert content == "" and finishes == ["tool_calls"] and len(calls) == 1
    assert (calls[0]["name"], json.loads(calls[0]["arguments"])) == \
        (call.function.name, json.loads(call.function.arguments))       # the same seed: the same call
  after = post(served.url, "/metrics", None, method="GET")[2]
  compiles = "jaxllm_xla_compiles_while_serving_total"
  assert metric(after, compiles) == metric(before, compiles)


def test_each_tools_schema_is_its_own_root(served):
  """Two tools whose $defs share a name each keep their own; "#" points at the tool's parameters (a recursive
  schema), "#/definitions/..." is read: the call grammar accepts each tool's own arguments and refuses the
  other's (lifting every $defs to one root let the second overwrite the first)."""
  loc = {"$defs": {"Loc": {"enum": ["x"]}}, "type": "object", "properties": {"at": {"$ref": "#/$defs/Loc"}},
         "required": ["at"], "additionalProperties": False}
  tools = [{"type": "function", "function": {"name": "a", "parameters": loc}},
           {"type": "function", "function": {"name": "b", "parameters": dict(loc, **{"$defs": {"Loc": {"enum": ["y"]}}})}},
           {"type": "function", "function": {"name": "tree", "parameters": {
               "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
               "additionalProperties": False}}},
           {"type": "function", "function": {"name": "old", "parameters": {
               "definitions": {"N": {"type": "integer", "minimum": 3}}, "type": "object",
               "properties": {"n": {"$ref": "#/definitions/N"}}, "required": ["n"], "additionalProperties": False}}}]
  grammar = served.scheduler.grammars.lark(T.grammar(tools, "required", "hermes"))

  def accepts(call):
    c = grammar.constraint()
    for t in served.tokenizer.encode(f"{T.OPEN}\n{call}\n{T.CLOSE}", add_bos=False):
      c.advance(t)
    return c.error is None and c.complete
  assert accepts('{"name": "a", "arguments": {"at": "x"}}') and accepts('{"name": "b", "arguments": {"at": "y"}}')
  assert not accepts('{"name": "a", "arguments": {"at": "y"}}') and not accepts('{"name": "b", "arguments": {"at": "x"}}')
  assert accepts('{"name": "tree", "arguments": {"kids": [{"kids": [{}]}, {}]}}')
  assert not accepts('{"name": "tree", "arguments": {"kids": [{"leaf": 1}]}}')
  assert accepts('{"name": "old", "arguments": {"n": 4}}') and not accepts('{"name": "old", "arguments": {"n": 2}}')


def test_tool_requests_refused_with_reasons(served):
  msg = [{"role": "user", "content": "x"}]
  for body, param in [({"tool_choice": "required"}, "tool_choice"),
                      ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                       "tool_choice"),
                      ({"tools": TOOLS + TOOLS[:1]}, "tools"),
                      ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
                        "tool_choice": "required"}, "tools"),
                      ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
                       "tool_choice")]:
    status, _, answer = post(served.url, "/v1/chat/completions", dict(messages=msg, max_tokens=4, **body))
    assert status == 400 and answer["error"]["param"] == param, answer


def test_tool_choice_none_and_auto_on_plain_text(served, client):
  """tool_choice "none" renders no tools; "auto" leaves an answer without calls as content, finish as usual."""
  msg = [{"role": "user", "content": "Hi"}]
  none = client.chat.completions.create(model="tiny", messages=msg, tools=TOOLS, tool_choice="none", max_tokens=4,
                                        temperature=0)
  plain = client.chat.completions.create(model="tiny", messages=msg, max_tokens=4, temperature=0)
  assert none.usage.prompt_tokens == plain.usage.prompt_tokens and none.choices[0].message.content == \
      plain.choices[0].message.content
  auto = client.chat.completions.create(model="tiny", messages=msg, tools=TOOLS, max_tokens=4, temperature=0)
  assert auto.usage.prompt_tokens > plain.usage.prompt_tokens
  assert auto.choices[0].message.tool_calls is None and auto.choices[0].finish_reason == "length"


def test_parallel_tool_calls_reaches_the_readers(served, client, monkeypatch):
  """parallel_tool_calls false reaches the ToolStream that reads the answer, whole (tools.parse) or streamed;
  absent or true, every call is read."""
  seen = []
  stream = T.ToolStream
  monkeypatch.setattr(T, "ToolStream", lambda names, parallel=True: seen.append(parallel) or stream(names, parallel))
  msg = [{"role": "user", "content": "Hi"}]
  for flag in (False, True, None):
    extra = {} if flag is None else {"parallel_tool_calls": flag}
    client.chat.completions.create(model="tiny", messages=msg, tools=TOOLS, max_tokens=2, **extra)
    list(client.chat.completions.create(model="tiny", messages=msg, tools=TOOLS, max_tokens=2, stream=True, **extra))
  assert seen == [False, False, True, True, True, True]


# ---- logit_bias ----------------------------------------------------------------------------------

def _run(served, cases) -> list[list[int]]:
  """The generated ids of scheduler Requests (prompt, max_tokens, params, bias), submitted together."""
  events = queue.Queue()
  for i, (prompt, n, params, bias) in enumerate(cases):
    served.scheduler.submit(Request(prompt, n, lambda e, i=i: events.put((i, e)), params, seed=7,
                                    ignore_eos=True, logit_bias=bias))
  ids, done = [[] for _ in cases], 0
  while done < len(cases):
    i, e = events.get(timeout=60)
    if isinstance(e, Delta):
      ids[i] += e.ids
    else:
      assert isinstance(e, Done) and e.finish_reason == "length", e
      done += 1
  return ids


def test_logit_bias_forces_and_bans_alone_and_batched(served):
  before = post(served.url, "/metrics", None, method="GET")[2]
  prompt = served.tokenizer.encode("hello there")
  greedy, hot = SamplingParams(), SamplingParams(temperature=1.0)
  plain = _run(served, [(prompt, 8, greedy, None)])[0]
  forced = _run(served, [(prompt, 8, greedy, {65: 100.0}), (prompt, 8, hot, {65: 100.0, 66: -3.0})])
  assert forced == [[65] * 8, [65] * 8]
  banned = _run(served, [(prompt, 8, greedy, {plain[0]: -100.0})])[0]
  assert banned[0] != plain[0] and plain[0] not in banned
  cases = [(prompt, 8, greedy, None), (prompt, 8, greedy, {plain[0]: -100.0}), (prompt, 8, hot, None),
           (prompt, 8, hot, {i: 1.5 for i in range(8, 262)} | {7: 100.0}),
           (served.tokenizer.encode("abc"), 6, hot, {plain[1]: -100.0, 97: 5.0})]
  alone = [_run(served, [c])[0] for c in cases]
  assert alone[0] == plain and alone[1] == banned and alone[3] == [7] * 8
  assert _run(served, cases) == alone
  after = post(served.url, "/metrics", None, method="GET")[2]
  compiles = "jaxllm_xla_compiles_while_serving_total"
  assert metric(after, compiles) == metric(before, compiles)


def test_biases_alone_skip_writing_the_masks(served, monkeypatch):
  """A biased request decodes in the masked program; with no grammar's row the device's masks already allow
  every token, so they are written at most once (after an earlier grammar's request), not every step; a
  grammar's request after it still gets its masks (its call parses)."""
  writes = []
  put = served.scheduler.programs.put_masks
  monkeypatch.setattr(served.scheduler.programs, "put_masks", lambda masks: writes.append(1) or put(masks))
  prompt = served.tokenizer.encode("hello there")
  assert _run(served, [(prompt, 8, SamplingParams(), {65: 100.0})]) == [[65] * 8] and len(writes) <= 1
  writes.clear()
  assert _run(served, [(prompt, 8, SamplingParams(), {66: 100.0}), (prompt, 6, SamplingParams(), None)]) == \
      [[66] * 8, _run(served, [(prompt, 6, SamplingParams(), None)])[0]] and not writes
  status, _, answer = post(served.url, "/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}],
                           tools=TOOLS, tool_choice="required", max_tokens=250, logit_bias={"65": 100}))
  assert status == 200 and answer["choices"][0]["message"]["tool_calls"] and writes, answer


def test_logit_bias_over_http(served, client):
  """+100 on "A" (id 65) makes every token of a completion and of a streamed chat answer "A", at temperature 0
  and 1; malformed maps are 400s naming logit_bias."""
  for temperature in (0.0, 1.0):
    c = client.completions.create(model="tiny", prompt="hi", max_tokens=6, temperature=temperature,
                                  logit_bias={"65": 100}, extra_body={"ignore_eos": True})
    assert c.choices[0].text == "A" * 6 and c.usage.completion_tokens == 6
    parts = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                           temperature=temperature, logit_bias={"65": 100}, stream=True,
                                           extra_body={"ignore_eos": True})
    assert "".join(p.choices[0].delta.content or "" for p in parts) == "A" * 5
  for bias in [{"abc": 1}, {"-1": 1}, {"262": 1}, {"5": 101}, {"5": -100.5}, {"5": "x"}, {"5": True},
               {str(i): 1 for i in range(301)}, {"5": 1, "05": 2}]:
    for path, body in [("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions",
                                                              {"messages": [{"role": "user", "content": "x"}]})]:
      status, _, answer = post(served.url, path, dict(body, max_tokens=2, logit_bias=bias))
      assert status == 400 and answer["error"]["param"].startswith("logit_bias"), (bias, answer)


def test_logit_bias_keys_checked_before_int():
  """A key past Python's int-string limit (4300 digits) or past 10 digits is a 400, not a ValueError (500)."""
  from jaxllm.serve.protocol import ApiError, CompletionRequest, logit_biases
  for key in ["9" * 5000, "1" * 11, "", " 5", "\u0665"]:
    with pytest.raises(ApiError) as e:
      logit_biases(CompletionRequest.model_validate({"prompt": "x", "logit_bias": {key: 1}}), 262)
    assert e.value.status == 400 and e.value.param == "logit_bias", key
  assert logit_biases(CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"0000000005": 1}}), 262) == \
      {5: 1.0}


def test_a_request_the_programs_refuse_ends_with_its_error(served):
  """A bias the slot programs refuse (an id past the vocabulary: the HTTP checks would have answered 400) ends
  that request with an error within seconds, not a request that never answers; the next request is served."""
  events = queue.Queue()
  prompt = served.tokenizer.encode("hello there")
  served.scheduler.submit(Request(prompt, 4, events.put, SamplingParams(), seed=1, ignore_eos=True,
                                  logit_bias={10 ** 9: 5.0}))
  e = events.get(timeout=30)
  while isinstance(e, Delta):
    e = events.get(timeout=30)
  assert isinstance(e, Done) and e.finish_reason == "error" and e.error, e
  assert _run(served, [(prompt, 3, SamplingParams(), None)])[0]
