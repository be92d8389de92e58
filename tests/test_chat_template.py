"""Chat templates are untrusted code: jaxllm.chat_template renders them in bounded time and memory.

Every hostile template must end in a ChatTemplateError naming the model file, within ~2 s and a bounded
peak of Python allocations: never a hang, a traceback of another kind, or memory without end. Real
templates (Qwen2.5's, SmolLM2's, Llama 3's and 3.1's) render as jinja2's plain sandbox renders them, in a
few milliseconds. A hypothesis fuzz test renders random templates built from jinja pieces.
"""
import contextlib
import gc
import json
import os
import sys
import threading
import time
import tracemalloc

import jinja2.sandbox
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxllm import chat_template, template_sandbox
from jaxllm.chat_template import ChatTemplate, ChatTemplateError
from jaxllm.tokenizer import MAX_EOG, Tokenizer
from tiny import CHAT_TEMPLATE, MERGES, vocab

# The templates as their tokenizer_config.json files hold them.
QWEN25 = ("{%- if tools %}\n"
          "    {{- '<|im_start|>system\\n' }}\n"
          "    {%- if messages[0]['role'] == 'system' %}\n"
          "        {{- messages[0]['content'] }}\n"
          "    {%- else %}\n"
          "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
          "    {%- endif %}\n"
          '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user'
          " query.\\n\\nYou are provided with function signatures within <tools></tools> XML"
          ' tags:\\n<tools>" }}\n'
          "    {%- for tool in tools %}\n"
          '        {{- "\\n" }}\n'
          "        {{- tool | tojson }}\n"
          "    {%- endfor %}\n"
          '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and'
          ' arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>,'
          ' \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
          "{%- else %}\n"
          "    {%- if messages[0]['role'] == 'system' %}\n"
          "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
          "    {%- else %}\n"
          "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful"
          " assistant.<|im_end|>\\n' }}\n"
          "    {%- endif %}\n"
          "{%- endif %}\n"
          "{%- for message in messages %}\n"
          '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or'
          ' (message.role == "assistant" and not message.tool_calls) %}\n'
          "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
          '    {%- elif message.role == "assistant" %}\n'
          "        {{- '<|im_start|>' + message.role }}\n"
          "        {%- if message.content %}\n"
          "            {{- '\\n' + message.content }}\n"
          "        {%- endif %}\n"
          "        {%- for tool_call in message.tool_calls %}\n"
          "            {%- if tool_call.function is defined %}\n"
          "                {%- set tool_call = tool_call.function %}\n"
          "            {%- endif %}\n"
          '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
          "            {{- tool_call.name }}\n"
          '            {{- \'", "arguments": \' }}\n'
          "            {{- tool_call.arguments | tojson }}\n"
          "            {{- '}\\n</tool_call>' }}\n"
          "        {%- endfor %}\n"
          "        {{- '<|im_end|>\\n' }}\n"
          '    {%- elif message.role == "tool" %}\n'
          '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
          "            {{- '<|im_start|>user' }}\n"
          "        {%- endif %}\n"
          "        {{- '\\n<tool_response>\\n' }}\n"
          "        {{- message.content }}\n"
          "        {{- '\\n</tool_response>' }}\n"
          '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
          "            {{- '<|im_end|>\\n' }}\n"
          "        {%- endif %}\n"
          "    {%- endif %}\n"
          "{%- endfor %}\n"
          "{%- if add_generation_prompt %}\n"
          "    {{- '<|im_start|>assistant\\n' }}\n"
          "{%- endif %}\n")
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>"
           "system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
           "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>'"
          " + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if "
          "loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if "
          "add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
LLAMA31 = ("{{- bos_token }}\n"
           "{%- if custom_tools is defined %}\n"
           "    {%- set tools = custom_tools %}\n"
           "{%- endif %}\n"
           "{%- if not tools_in_user_message is defined %}\n"
           "    {%- set tools_in_user_message = true %}\n"
           "{%- endif %}\n"
           "{%- if not date_string is defined %}\n"
           '    {%- set date_string = "26 Jul 2024" %}\n'
           "{%- endif %}\n"
           "{%- if not tools is defined %}\n"
           "    {%- set tools = none %}\n"
           "{%- endif %}\n"
           "\n"
           "{#- This block extracts the system message, so we can slot it into the right place. #}\n"
           "{%- if messages[0]['role'] == 'system' %}\n"
           "    {%- set system_message = messages[0]['content']|trim %}\n"
           "    {%- set messages = messages[1:] %}\n"
           "{%- else %}\n"
           '    {%- set system_message = "" %}\n'
           "{%- endif %}\n"
           "\n"
           "{#- System message + builtin tools #}\n"
           '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n'
           "{%- if builtin_tools is defined or tools is not none %}\n"
           '    {{- "Environment: ipython\\n" }}\n'
           "{%- endif %}\n"
           "{%- if builtin_tools is defined %}\n"
           '    {{- "Tools: " + builtin_tools | reject(\'equalto\', \'code_interpreter\') | join(", ") +'
           ' "\\n\\n"}}\n'
           "{%- endif %}\n"
           '{{- "Cutting Knowledge Date: December 2023\\n" }}\n'
           '{{- "Today Date: " + date_string + "\\n\\n" }}\n'
           "{%- if tools is not none and not tools_in_user_message %}\n"
           '    {{- "You have access to the following functions. To call a function, please respond with'
           ' JSON for a function call." }}\n'
           '    {{- \'Respond in the format {"name": function name, "parameters": dictionary of argument'
           " name and its value}.' }}\n"
           '    {{- "Do not use variables.\\n\\n" }}\n'
           "    {%- for t in tools %}\n"
           "        {{- t | tojson(indent=4) }}\n"
           '        {{- "\\n\\n" }}\n'
           "    {%- endfor %}\n"
           "{%- endif %}\n"
           "{{- system_message }}\n"
           '{{- "<|eot_id|>" }}\n'
           "\n"
           "{#- Custom tools are passed in a user message with some extra guidance #}\n"
           "{%- if tools_in_user_message and not tools is none %}\n"
           "    {#- Extract the first user message so we can plug it in here #}\n"
           "    {%- if messages | length != 0 %}\n"
           "        {%- set first_user_message = messages[0]['content']|trim %}\n"
           "        {%- set messages = messages[1:] %}\n"
           "    {%- else %}\n"
           '        {{- raise_exception("Cannot put tools in the first user message when there\'s no first'
           ' user message!") }}\n'
           "{%- endif %}\n"
           "    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}\n"
           '    {{- "Given the following functions, please respond with a JSON for a function call " }}\n'
           '    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}\n'
           '    {{- \'Respond in the format {"name": function name, "parameters": dictionary of argument'
           " name and its value}.' }}\n"
           '    {{- "Do not use variables.\\n\\n" }}\n'
           "    {%- for t in tools %}\n"
           "        {{- t | tojson(indent=4) }}\n"
           '        {{- "\\n\\n" }}\n'
           "    {%- endfor %}\n"
           '    {{- first_user_message + "<|eot_id|>"}}\n'
           "{%- endif %}\n"
           "\n"
           "{%- for message in messages %}\n"
           "    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in"
           " message) %}\n"
           "        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+"
           " message['content'] | trim + '<|eot_id|>' }}\n"
           "    {%- elif 'tool_calls' in message %}\n"
           "        {%- if not message.tool_calls|length == 1 %}\n"
           '            {{- raise_exception("This model only supports single tool-calls at once!") }}\n'
           "        {%- endif %}\n"
           "        {%- set tool_call = message.tool_calls[0].function %}\n"
           "        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}\n"
           "            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
           '            {{- "<|python_tag|>" + tool_call.name + ".call(" }}\n'
           "            {%- for arg_name, arg_val in tool_call.arguments | items %}\n"
           '                {{- arg_name + \'="\' + arg_val + \'"\' }}\n'
           "                {%- if not loop.last %}\n"
           '                    {{- ", " }}\n'
           "                {%- endif %}\n"
           "                {%- endfor %}\n"
           '            {{- ")" }}\n'
           "        {%- else  %}\n"
           "            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
           '            {{- \'{"name": "\' + tool_call.name + \'", \' }}\n'
           '            {{- \'"parameters": \' }}\n'
           "            {{- tool_call.arguments | tojson }}\n"
           '            {{- "}" }}\n'
           "        {%- endif %}\n"
           "        {%- if builtin_tools is defined %}\n"
           "            {#- This means we're in ipython mode #}\n"
           '            {{- "<|eom_id|>" }}\n'
           "        {%- else %}\n"
           '            {{- "<|eot_id|>" }}\n'
           "        {%- endif %}\n"
           '    {%- elif message.role == "tool" or message.role == "ipython" %}\n'
           '        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}\n'
           "        {%- if message.content is mapping or message.content is iterable %}\n"
           "            {{- message.content | tojson }}\n"
           "        {%- else %}\n"
           "            {{- message.content }}\n"
           "        {%- endif %}\n"
           '        {{- "<|eot_id|>" }}\n'
           "    {%- endif %}\n"
           "{%- endfor %}\n"
           "{%- if add_generation_prompt %}\n"
           "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
           "{%- endif %}\n")
REAL = {"qwen2.5": QWEN25, "smollm2": SMOLLM2, "llama3": LLAMA3, "llama3.1": LLAMA31, "tiny": CHAT_TEMPLATE}

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "  Bye  "}]
TOOLS = [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "content": "18 C"}, {"role": "tool", "content": "sunny"}]
VARIABLES = dict(add_generation_prompt=True, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", tools=None)
SECONDS = 2.0                 # a hostile template ends within this much of its thread's CPU time (the limit is
                              # chat_template.MAX_SECONDS, in the same clock: the load of the machine does not count)
PEAK_BYTES = 64 << 20         # and allocates at most this much meanwhile (the largest take ~6 MB)
TRACED_SECONDS = 30.0        # the time limit while tracemalloc counts the allocations (it slows them)


def _plain(source: str, **variables) -> str:
  """What jinja2's sandbox alone renders (jaxllm's renderer before the bounds)."""
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                     extensions=["jinja2.ext.loopcontrols"])
  return env.from_string(source).render(**variables)


def _render(source: str, messages=CHAT, **variables):
  return ChatTemplate(source, "/models/evil.gguf").render(messages=messages, **{**VARIABLES, **variables})


@pytest.mark.parametrize("name", sorted(REAL))
@pytest.mark.parametrize("messages", [CHAT, CHAT[1:], CHAT[1:2]], ids=["system", "no-system", "one"])
def test_real_templates_render_as_before(name, messages):
  expected = _plain(REAL[name], messages=messages, **VARIABLES)
  assert _render(REAL[name], messages) == expected
  assert _render(REAL[name], messages, add_generation_prompt=False) == _plain(
      REAL[name], messages=messages, **{**VARIABLES, "add_generation_prompt": False})


@contextlib.contextmanager
def _no_collections():
  """What a timing here measures is the template's work: a garbage collection, long in a test process with a
  large heap (torch's, jax's), is not (chat_template leaves its pauses out of the deadline too)."""
  enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if enabled:
      gc.enable()


def test_real_templates_render_known_text_fast():
  assert _render(SMOLLM2, CHAT[1:2]) == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained "
                                         "by Hugging Face<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                                         "<|im_start|>assistant\n")
  assert _render(QWEN25, CHAT[:2]) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there"
                                       "<|im_end|>\n<|im_start|>assistant\n")
  assert _render(LLAMA31, CHAT[:2]) == (
      "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
      "Today Date: 26 Jul 2024\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\n")
  tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"city": "string"}}}]
  for source in (QWEN25, LLAMA31):
    assert _render(source, TOOLS) == _plain(source, messages=TOOLS, **VARIABLES)   # tool calls and replies
    expected = _plain(source, messages=TOOLS[:1], **{**VARIABLES, "tools": tools})
    assert _render(source, TOOLS[:1], tools=tools) == expected                     # tojson, tojson(indent=4)
  long_chat = [{"role": ("user", "assistant")[i % 2], "content": f"message {i} " * 50} for i in range(100)]
  for name, source in REAL.items():
    template = ChatTemplate(source)
    template.render(messages=CHAT, **VARIABLES)                                     # compiled on first use
    with _no_collections():
      t0 = time.thread_time()
      for _ in range(10):
        template.render(messages=CHAT, **VARIABLES)
      per_render = (time.thread_time() - t0) / 10
      t1 = time.thread_time()
      text = template.render(messages=long_chat, **VARIABLES)
      long_render = time.thread_time() - t1
    assert per_render < 0.005, f"{name}: {per_render * 1e3:.2f} ms a render"
    assert text == _plain(source, messages=long_chat, **VARIABLES)
    assert long_render < 0.05, name


# (template, what the error says). Each would run for minutes, take gigabytes or end in a Python exception
# with jinja2's sandbox alone.
HOSTILE = {
    "str_times_huge": ("{{ 'a' * 10**10 }}", r"'\*' would make a value of size 10000000000"),
    "list_times_huge": ("{{ range(100000)|list * 100000 }}", r"'\*' would make a value of size"),
    "int_power": ("{{ 10 ** (10 ** 10) }}", r"'\*\*' would make an integer of about 40000000000 bits"),
    "int_minus_doubling": ("{% set ns = namespace(x=2**2000 * 2**2000) %}{% for i in range(10000) %}"
                           "{% set ns.x = ns.x - (0 - ns.x) %}{% endfor %}", r"'-' made an integer of 4097 bits"),
    "int_squaring": ("{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}"
                     "{% endfor %}", r"'\*' made an integer of \d+ bits"),
    "nested_empty_loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                           r"rendering took longer than"),
    "nested_empty_loops_over_a_list": ("{% set r = range(100000)|list %}{% for i in r %}{% for j in r %}"
                                       "{% endfor %}{% endfor %}", r"rendering took longer than"),
    "recursive_macro": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", r"calls nest deeper than"),
    "zero_division": ("{{ 1 / 0 }}", r"ZeroDivisionError: division by zero"),
    "missing_message": ("{{ messages[99].content }}", r"UndefinedError: list object has no element 99"),
    "raise_exception": ("{{ raise_exception('Conversation roles must alternate') }}",
                        r"it raised an error: Conversation roles must alternate"),
    "syntax_error": ("{% for m in messages %}{{ m.content }}", r"TemplateSyntaxError: Unexpected end of template"),
    "unknown_filter": ("{{ messages|pprint }}", r"No filter named 'pprint'"),
    "sandbox_attribute": ("{{ ''.__class__.__mro__ }}", r"SecurityError: access to attribute '__class__'"),
    "sandbox_mutation": ("{{ messages.append(1) }}", r"SecurityError: access to attribute 'append'"),
    "tilde_doubling": ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}", r"'~' would make a value of size 4194304"),
    "plus_doubling": ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                      "{% endfor %}", r"'\+' made a value larger than"),
    "set_list_growth": ("{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}"
                        "{% endfor %}", r"'\+' made a value larger than"),
    "list_of_fresh_strings": ("{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
                              "{% set ns.l = ns.l + [('y' * 100000) ~ i] %}{% endfor %}",
                              r"made a value larger than|built values of more than"),
    "fresh_strings_dropped": ("{% for i in range(100000) %}{% set s = ('y' * 2000000) ~ i %}{% endfor %}",
                              r"built values of more than \d+ characters in all"),
    "block_set_doubling": ("{% set ns = namespace(s='xx') %}{% for i in range(64) %}{% set t %}{{ ns.s }}"
                           "{{ ns.s }}{% endset %}{% set ns.s = t %}{% endfor %}", r"captured text would make"),
    "macro_doubling": ("{% macro d(s) %}{{ s }}{{ s }}{% endmacro %}{% set ns = namespace(s='xx') %}"
                       "{% for i in range(64) %}{% set ns.s = d(ns.s) %}{% endfor %}", r"captured text would make"),
    "nested_literals": ("{% set a = ['x' * 1000000, 'x' * 1000000] %}{% set b = [a, a] %}{% set c = [b, b] %}"
                        "{{ c == [b, a] }}", r"a literal made a value larger than"),
    "output_flood": ("{% for i in range(100000) %}{% for j in range(100) %}{{ 'x' * 1000 }}{% endfor %}"
                     "{% endfor %}", r"its output is longer than"),
    "percent_width": ("{{ '%0999999999d' % 1 }}", r"'%' would make a value of size"),
    "percent_star_width": ("{{ '%*d' % (999999999, 1) }}", r"'%' would make a value of size"),
    "format_width": ("{{ '{:>999999999}'.format(1) }}", r"str.format\(\) would make a value of size"),
    "format_nested_width": ("{{ '{:>{}}'.format(1, 999999999) }}", r"str.format\(\) would make a value of size"),
    "format_filter": ("{{ '%*d'|format(999999999, 1) }}", r"'format' filter would make a value of size"),
    "center_filter": ("{{ 'a'|center(999999999) }}", r"'center' filter would make a value of size"),
    "ljust_method": ("{{ 'a'.ljust(10**9) }}", r"str.ljust\(\) would make a value of size"),
    "indent_filter": ("{{ ('a\n' * 100000)|indent(1000) }}", r"'indent' filter would make a value of size"),
    "replace_filter": ("{{ ('a' * 100000)|replace('a', 'b' * 1000) }}", r"'replace' filter would make"),
    "replace_method": ("{{ ('a' * 100000).replace('', 'b' * 1000) }}", r"str.replace\(\) would make"),
    "join_filter": ("{{ range(1000)|join('x' * 100000) }}", r"'join' filter would make a value of size"),
    "join_method": ("{{ ('x' * 100000).join(range(1000)|map('string')) }}", r"str.join\(\) would make"),
    "translate_method": ("{{ ('a' * 100000).translate({97: 'b' * 100000}) }}", r"str.translate\(\) would make"),
    "to_bytes_method": ("{{ (1).to_bytes(10**9, 'big') }}", r"int.to_bytes\(\) would make a value of size"),
    "tojson_indent": ("{{ range(10000)|batch(1)|list|tojson(indent=1000) }}",
                      r"'tojson' filter would make a value of size"),
    "batch_fill": ("{{ [1]|batch(10**9, 'x')|list }}", r"'batch' filter would make a value of size"),
    "string_to_list": ("{{ ('ab' * 1000000)|list|length }}", r"'list' filter would make a value of size"),
    "generator_to_list": ("{{ range(100000)|map('string')|map('center', 1000)|list }}",
                          r"'list' filter would make a value larger than"),
    "grown_namespace_in_a_list": ("{% set ns = namespace(s='') %}{% set l = [ns] * 50000 %}"
                                  "{% set ns.s = 'x' * 1000000 %}{{ l|map(attribute='s')|join }}",
                                  r"'join' filter would make a value larger than"),
    "grown_namespace_printed": ("{% set ns = namespace(s='') %}{% set l = [ns] * 50000 %}"
                                "{% set ns.s = 'x' * 1000000 %}{{ l }}", r"'\{\{ \}\}' would make a value of size"),
    "grown_namespace_stringified": ("{% set ns = namespace(s='') %}{% set l = [ns] * 50000 %}"
                                    "{% set ns.s = 'x' * 1000000 %}{{ l|string }}",
                                    r"'string' filter would make a value of size"),
    "namespace_cycle": ("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns }}",    # sized until past the limit
                        r"'\{\{ \}\}' would make a value of size|rendering took longer"),
    "long_source": ("{{ 'x' }}" * 40000, r"the template is 360000 characters long"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_template_is_a_clean_bounded_error(name, monkeypatch):
  """Each ends in its own clean error within SECONDS of CPU time; and, rendered again under tracemalloc, by
  the same limit with at most PEAK_BYTES allocated. tracemalloc slows allocation-heavy renders several times
  over (up to 15x on Python 3.12: 0.14 s -> 2.2 s), so that pass gets a time limit of TRACED_SECONDS, and
  which limit fires there is still the one the case is about."""
  source, says = HOSTILE[name]
  t0 = time.thread_time()
  with pytest.raises(ChatTemplateError, match=says) as info:
    _render(source)
  elapsed = time.thread_time() - t0
  assert str(info.value).startswith("'/models/evil.gguf': the model's chat template failed: ")
  assert elapsed < SECONDS, f"{elapsed:.2f} s"
  if "rendering took longer" not in says:
    monkeypatch.setattr(chat_template, "MAX_SECONDS", TRACED_SECONDS)
  tracemalloc.start()
  try:
    with pytest.raises(ChatTemplateError, match=says):
      _render(source)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert peak < PEAK_BYTES, f"{peak >> 20} MB"


def test_what_is_not_an_error_stays_so():
  assert _render("{{ messages[99] }}|{{ messages[0].nothing }}") == "|"    # jinja2's lenient undefined, as before
  # A sum of lists in linear time: 40000 lists took 0.5-0.7 s of CPU on the slower (AVX2) 2-core machine, 80000
  # 1.2 s, past the 1 s limit there; Python's own sum, quadratic, would take ~2.5 s for 40000 (~10 s for 80000).
  t0 = time.thread_time()
  assert _render("{{ ([[0]] * 40000)|sum(start=[])|length }}") == "40000"
  assert time.thread_time() - t0 < SECONDS
  assert _render("{{ '%5.1f|%-4d|%s' % (2.25, 7, 'x') }}{{ '{:>4}{}'.format(1, 'y') }}") == "  2.2|7   |x   1y"


def test_the_limits_do_not_leave_the_thread_traced_and_work_on_worker_threads():
  def tracer(frame, event, arg):
    return None

  results = {}

  def work(name):
    try:
      results[name] = _render(HOSTILE[name][0])
    except ChatTemplateError as e:
      results[name] = e

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(chat_template, "MAX_SECONDS", 0.2)
    sys.settrace(tracer)
    try:
      with pytest.raises(ChatTemplateError, match="rendering took longer"):
        _render(HOSTILE["nested_empty_loops"][0])
      assert sys.gettrace() is tracer                         # the previous trace function is back
      assert _render(SMOLLM2) == _plain(SMOLLM2, messages=CHAT, **VARIABLES)
      assert sys.gettrace() is tracer
    finally:
      sys.settrace(None)
    threads = [threading.Thread(target=work, args=(n,)) for n in ("nested_empty_loops", "recursive_macro")]
    for t in threads:
      t.start()
    for t in threads:
      t.join(2 * SECONDS)
  assert "rendering took longer" in str(results["nested_empty_loops"])
  assert "calls nest deeper" in str(results["recursive_macro"])
  assert sys.gettrace() is None


def _ends_in_time(template: ChatTemplate, times: int) -> None:
  """Renders `template` `times` times on a worker thread; each must stop at the deadline (MAX_SECONDS)."""
  for _ in range(times):
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(pytest.raises(
        ChatTemplateError, template.render, messages=CHAT, **VARIABLES)), daemon=True)
    worker.start()
    worker.join(SECONDS)
    assert not worker.is_alive(), "the template ran on past its deadline"
    assert outcome and f"rendering took longer than {chat_template.MAX_SECONDS} s" in str(outcome[0].value)


# Loops that drop a generator each turn: a finalizer closes it in the middle of the template. Had a limit been
# raised there, Python would print it and turn tracing off, and the loops would run on for minutes.
FINALIZED = {"jinja2_generator": "{% for x in r|map('string') %}{% break %}{% endfor %}",
             "template_generator": "{% for x in r if x %}{% break %}{% endfor %}"}


@pytest.mark.parametrize("name", sorted(FINALIZED))
def test_a_limit_is_not_lost_in_a_finalizer(name):
  source = ("{% set r = range(3000)|list %}{% for i in r %}{% for j in r %}" + FINALIZED[name] +
            "{% endfor %}{% endfor %}")
  template = ChatTemplate(source)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(chat_template, "MAX_SECONDS", 0.5)           # the first render compiles it: that alone can take
    _ends_in_time(template, 1)                               # over 0.03 s (the GPU suite's 16 processes)
    mp.setattr(chat_template, "MAX_SECONDS", 0.03)          # many deadlines, each somewhere else in the loop
    _ends_in_time(template, 20)


@contextlib.contextmanager
def _collecting(callback, threshold: int):
  """`callback` among gc's callbacks, and a collection every `threshold` allocations, for the block."""
  saved = gc.get_threshold()
  gc.callbacks.append(callback)
  gc.set_threshold(threshold)
  try:
    yield
  finally:
    gc.callbacks.remove(callback)
    gc.set_threshold(*saved)


def _burn(seconds: float) -> None:
  """Runs Python lines for `seconds` of the thread's CPU time."""
  t0 = time.thread_time()
  while time.thread_time() - t0 < seconds:
    pass


# A loop that keeps a list each turn (a collection every few turns at a low threshold) and runs for minutes.
KEEPER = "{% set ns = namespace(keep=[]) %}{% for i in range(10**5) %}{% set ns.keep = [ns.keep] %}{% endfor %}"


def test_a_limit_is_not_lost_in_a_gc_callback():
  """Python runs gc callbacks (jax registers one) in the middle of the template; had a limit been raised in
  one, Python would print it and turn tracing off."""
  def callback(phase, info):
    calls.append(phase)
    _burn(0.005)                                          # lines of Python the deadline may pass in

  calls = []
  template = ChatTemplate(KEEPER)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(chat_template, "MAX_SECONDS", 0.05)
    _ends_in_time(template, 1)                              # compiled, before collections take the time
    with _collecting(callback, 50):                         # a collection every 50 lists the template keeps
      _ends_in_time(template, 10)
  assert calls


def test_a_garbage_collection_is_not_the_templates_time():
  """A full collection in a process with a large heap (torch's, jax's) can take longer than the whole budget;
  one that starts while a real template compiles does not make it a limit."""
  def callback(phase, info):
    if phase == "start" and getattr(template_sandbox.render_state, "guard", None) is not None and not burnt:
      burnt.append(phase)
      _burn(2 * chat_template.MAX_SECONDS)

  burnt = []
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(chat_template, "MAX_SECONDS", 0.2)
    with _collecting(callback, 10):                         # a collection within the first allocations
      text = ChatTemplate(QWEN25).render(messages=CHAT, add_generation_prompt=True)
  assert burnt and text.endswith("<|im_start|>assistant\n")


def test_collections_are_credited_up_to_a_bound():
  """Collections are not charged to a render only up to MAX_PAUSED in all: a template that makes many long ones
  (0.05 s each here, as a large heap's would be) ends within MAX_SECONDS + MAX_PAUSED and one collection more
  of the thread's time (credited without a bound, it ran 0.75 s)."""
  def callback(phase, info):
    if phase == "start" and getattr(template_sandbox.render_state, "guard", None) is not None:
      calls.append(phase)
      _burn(0.05)

  calls = []
  template = ChatTemplate(KEEPER)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(chat_template, "MAX_SECONDS", 0.2)
    mp.setattr(chat_template, "MAX_PAUSED", 0.2)
    with pytest.raises(ChatTemplateError):
      template.render(messages=CHAT)                        # compiled, before collections take the time
    with _collecting(callback, 50):
      t0 = time.thread_time()
      with pytest.raises(ChatTemplateError, match="rendering took longer than 0.2 s"):
        template.render(messages=CHAT)
      elapsed = time.thread_time() - t0
  # More than one collection ran (uncredited, the first would have ended it), and no more were credited than
  # MAX_PAUSED allows.
  assert len(calls) >= 2 and elapsed < 0.2 + 0.2 + 0.15, (len(calls), elapsed)


def test_too_long_messages_are_refused_before_rendering():
  messages = [{"role": "user", "content": "x" * (chat_template.MAX_SIZE + 1)}]
  with pytest.raises(ChatTemplateError, match="^'/models/evil.gguf': the messages are too long to render"):
    _render(SMOLLM2, messages)


def _tokenizer(**metadata) -> Tokenizer:
  """A tokenizer of tests/tiny.py's vocabulary with these metadata added, from /models/tiny.gguf."""
  tokens, types = vocab()
  return Tokenizer({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
                    "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": [" ".join(m) for m in MERGES],
                    "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"), **metadata},
                   source="/models/tiny.gguf")


def test_the_tokenizer_names_its_file_in_chat_template_errors():
  ok = _tokenizer(**{"tokenizer.chat_template": CHAT_TEMPLATE})
  assert ok.apply_chat_template([{"role": "user", "content": "hi"}]) == \
      "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
  bad = _tokenizer(**{"tokenizer.chat_template": "{{ 1 / 0 }}"})
  with pytest.raises(ChatTemplateError, match=r"^'/models/tiny.gguf': the model's chat template failed: "
                                              r"ZeroDivisionError"):
    bad.apply_chat_template([{"role": "user", "content": "hi"}])
  restored = Tokenizer.from_state(bad.to_state(), source="/models/tiny.gguf")
  with pytest.raises(ChatTemplateError, match=r"^'/models/tiny.gguf': .*ZeroDivisionError"):
    restored.apply_chat_template([{"role": "user", "content": "hi"}])
  with pytest.raises(ChatTemplateError, match=r"^the model's chat template failed: ZeroDivisionError"):
    Tokenizer.from_state(bad.to_state()).apply_chat_template([{"role": "user", "content": "hi"}])
  with pytest.raises(ValueError, match="this model has no chat template"):
    _tokenizer().apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_tokenizer_with_too_many_end_of_generation_tokens_is_refused():
  tokens, types = vocab()                                  # <|endoftext|> and <|im_end|> end a turn already
  metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.merges": [" ".join(m) for m in MERGES]}

  def with_more(n):                                        # n more control tokens that end a turn, by their text
    return {**metadata, "tokenizer.ggml.tokens": tokens + ["<|eot_id|>"] * n,
            "tokenizer.ggml.token_type": types + [3] * n}

  assert len(Tokenizer(with_more(MAX_EOG - 2)).eog_ids) == MAX_EOG
  with pytest.raises(ValueError, match=rf"^the tokenizer declares {MAX_EOG + 1} end-of-generation tokens "
                                       rf"\(259 '<\|endoftext\|>', 261 '<\|im_end\|>', 262 '<\|eot_id\|>', "
                                       rf"263 '<\|eot_id\|>', ...\); jaxllm handles at most {MAX_EOG}$"):
    Tokenizer(with_more(MAX_EOG - 1))
  state = Tokenizer(with_more(0)).to_state()                # a cached tokenizer is checked as well
  state["eog_ids"] = list(range(MAX_EOG + 1))
  with pytest.raises(ValueError, match=rf"declares {MAX_EOG + 1} end-of-generation tokens \(0 '\\x00', "):
    Tokenizer.from_state(state)


# The fuzz test's grammar: expressions, filters, calls, loops, sets, macros.
_NUMBERS = st.sampled_from(["0", "1", "2", "3", "-1", "100", "100000", "10**6", "10**9", "2.5"])
_ATOMS = st.one_of(_NUMBERS, st.sampled_from(
    ["'a'", "'xy'", "'%s'", "'{}'", "'\\n'", "messages", "messages[0]", "messages[0].content", "messages[-1].role",
     "ns.v", "ns", "[1, 'b']", "{'k': 'v'}", "(1, 2)", "range(3)", "range(100000)", "none", "true", "loop",
     "undefined_name", "bos_token", "v", "m(1)", "m('z')", "namespace(q=1)", "dict(a=1)"]))
_FILTERS = st.sampled_from(
    ["length", "list", "join", "join(', ')", "upper", "trim", "string", "tojson", "tojson(indent=2)", "center(10)",
     "center(10**9)", "indent(4)", "replace('a', 'bb')", "sum", "first", "last", "sort", "unique", "reverse",
     "batch(2)", "batch(3, 'x')", "slice(2)", "int", "float", "default('d')", "map('string')",
     "map(attribute='content')", "select", "reject", "selectattr('role')", "format(1)", "wordcount",
     "truncate(5)", "title", "capitalize", "items", "dictsort", "abs", "round", "min", "max", "e", "safe",
     "urlencode", "striptags", "groupby('role')", "count", "lower", "random"])
_METHODS = st.sampled_from(["upper()", "split()", "strip()", "ljust(5)", "ljust(10**9)", "replace('a', 'bb')",
                            "join(['1', '2'])", "format(1, 2)", "count('a')", "startswith('a')", "items()",
                            "keys()", "get('role')", "copy()", "index(1)", "zfill(8)", "title()"])
_BINOPS = st.sampled_from(["+", "-", "*", "/", "//", "%", "**", "~", "and", "or", "==", "<", "in", "not in"])


def _expressions():
  return st.recursive(_ATOMS, lambda e: st.one_of(
      st.tuples(e, _BINOPS, e).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
      st.tuples(e, _FILTERS).map(lambda t: f"({t[0]}|{t[1]})"),
      st.tuples(e, _METHODS).map(lambda t: f"{t[0]}.{t[1]}"),
      st.tuples(e, e).map(lambda t: f"{t[0]}[{t[1]}]"),
      st.tuples(e, e, e).map(lambda t: f"({t[0]} if {t[1]} else {t[2]})"),
      st.lists(e, max_size=3).map(lambda items: "[" + ", ".join(items) + "]")), max_leaves=6)


def _statements(expression):
  return st.recursive(
      st.one_of(expression.map(lambda e: "{{ " + e + " }}"), st.sampled_from(["text", "\n", "{{ v }}"]),
                expression.map(lambda e: "{% set ns.v = " + e + " %}"),
                expression.map(lambda e: "{% set v = " + e + " %}"),
                expression.map(lambda e: "{{ raise_exception(" + e + ") }}")),
      lambda s: st.one_of(
          st.tuples(expression, s).map(lambda t: "{% for v in " + t[0] + " %}" + t[1] + "{% endfor %}"),
          st.tuples(expression, s, s).map(lambda t: "{% if " + t[0] + " %}" + t[1] + "{% else %}" + t[2] +
                                          "{% endif %}"),
          s.map(lambda b: "{% set ns.v %}" + b + "{% endset %}"),
          st.lists(s, min_size=2, max_size=3).map("".join)), max_leaves=6)


_TEMPLATES = st.tuples(_statements(_expressions()), _statements(_expressions())).map(
    lambda t: "{% set ns = namespace(v='a') %}{% macro m(a) %}" + t[0] + "{% endmacro %}" + t[1])
_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]),
                                            "content": st.text(max_size=20)}), min_size=1, max_size=4)


@settings(max_examples=int(os.environ.get("JAXLLM_FUZZ_EXAMPLES", "200")), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(source=_TEMPLATES, messages=_MESSAGES)
def test_fuzz_a_random_template_renders_or_is_a_clean_error(source, messages):
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(chat_template, "MAX_SECONDS", 0.1)         # keeps the whole run short; the bound is the same
    with _no_collections():
      t0 = time.thread_time()
      try:
        out = ChatTemplate(source, "/models/fuzz.gguf").render(messages=messages, **VARIABLES)
      except ChatTemplateError as e:
        out = e
      elapsed = time.thread_time() - t0
    if isinstance(out, ChatTemplateError):
      assert str(out).startswith("'/models/fuzz.gguf': the model's chat template failed: ")
    else:
      assert isinstance(out, str)
    assert elapsed < 1.0, source


def test_a_template_file_is_read_or_refused_with_what_it_holds(tmp_path):
  """read_template_file (--chat-template): jinja2 text as it is; a tokenizer_config.json's or chat_template.json's
  "chat_template" (a string, or the "default" of named ones); every other content is a ValueError naming the
  file and what it holds, and a FIFO is refused without waiting for a writer."""
  from jaxllm.chat_template import MAX_SOURCE, read_template_file

  def write(name, content):
    p = tmp_path / name
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return p
  assert read_template_file(write("t.jinja", QWEN25)) == QWEN25
  assert read_template_file(write("bom.jinja", b"\xef\xbb\xbf" + QWEN25.encode())) == QWEN25    # no BOM kept
  assert read_template_file(write("UPPER.JSON", json.dumps({"chat_template": QWEN25}))) == QWEN25
  assert read_template_file(write("tokenizer_config.json", json.dumps({"chat_template": QWEN25, "x": 1}))) == QWEN25
  named = [{"name": "tool_use", "template": "a"}, {"name": "default", "template": "b"}]
  assert read_template_file(write("chat_template.json", json.dumps({"chat_template": named}))) == "b"
  os.mkfifo(tmp_path / "fifo")
  odd_names = [{"name": ["x"], "template": "a"}, {"name": "tool_use", "template": "b"}]
  for path, words in ((write("nd.json", json.dumps({"chat_template": named[:1]})), "none of them 'default'"),
                      (write("odd.json", json.dumps({"chat_template": odd_names})), "['tool_use'], none of them"),
                      (write("deep.json", "[" * 100_000 + "]" * 100_000), "is not JSON that can be read"),
                      (write("none.json", json.dumps({"bos_token": "<s>"})), 'no "chat_template" text'),
                      (write("list.json", "[1, 2]"), 'no "chat_template" text'),
                      (write("bad.json", "{chat"), "is not JSON that can be read"),
                      (write("bin.jinja", b"{{ x }}\xff\xfe"), "is not UTF-8 text: byte b'\\xff' at offset 7"),
                      (write("empty.jinja", " \n"), "holds an empty template"),
                      (write("long.jinja", "x" * (MAX_SOURCE + 1)), "characters long"),
                      (tmp_path / "fifo", "is not a regular file"),
                      (tmp_path, "is not a regular file"),
                      (tmp_path / "missing", "cannot read chat template file")):
    with pytest.raises(ValueError) as e:
      read_template_file(path)
    assert f"{str(path)!r}" in str(e.value) and words in str(e.value), (path, e.value)


def test_a_template_argument_is_a_file_or_the_text_itself(tmp_path):
  """read_template (--chat-template's value, as vLLM reads it): a path is read as a file; a value with jinja2's
  braces or a line break is the template; anything else is the file's error, saying a built-in name is not one."""
  from jaxllm.chat_template import read_template
  (tmp_path / "t.jinja").write_text("{{ messages[0].content }}", encoding="utf-8")
  assert read_template(str(tmp_path / "t.jinja")) == ("{{ messages[0].content }}", str(tmp_path / "t.jinja"))
  assert read_template("{{ messages[0].content }}") == ("{{ messages[0].content }}", "the --chat-template text")
  with pytest.raises(ValueError, match=r"^cannot read chat template file 'chatml': .* name, as llama.cpp takes"):
    read_template("chatml")
  with pytest.raises(ValueError, match="characters long"):
    read_template("{" * (chat_template.MAX_SOURCE + 1))


def test_set_chat_template_renders_with_it_or_keeps_the_old_one():
  """Tokenizer.set_chat_template: chats render with the new template, its errors name its origin; one that fails
  on a one-message chat is refused at once and the tokenizer keeps the template it had."""
  tok = _tokenizer(**{"tokenizer.chat_template": QWEN25})
  before = tok.apply_chat_template(CHAT[:2])
  with pytest.raises(ChatTemplateError, match="^'/t/broken.jinja': .*TemplateSyntaxError"):
    tok.set_chat_template("{% for m in messages %}", origin="/t/broken.jinja")
  with pytest.raises(ChatTemplateError, match="^'/t/raises.jinja': the chat template failed: it raised an error: no"):
    tok.set_chat_template("{{ raise_exception('no') }}", origin="/t/raises.jinja")
  with pytest.raises(ChatTemplateError, match="^'/t/c.json': the chat template does not render a chat's messages"):
    tok.set_chat_template('{"bos_token": "<s>"}', origin="/t/c.json")             # a config read as a template
  assert tok.apply_chat_template(CHAT[:2]) == before
  tok.set_chat_template("{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}", origin="/t/ok.jinja")
  assert tok.apply_chat_template(CHAT[:2]) == "system:Be brief.;user:Hi there;"
  with pytest.raises(ChatTemplateError, match="^'/t/ok.jinja': "):
    tok.apply_chat_template([{"role": "user", "content": "x" * (chat_template.MAX_SIZE + 1)}])
