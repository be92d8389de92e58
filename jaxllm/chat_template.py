"""Renders a model file's chat template, untrusted jinja2 source, in bounded time and memory.

A GGUF file's `tokenizer.chat_template` is code from whoever made the file. jinja2's
ImmutableSandboxedEnvironment keeps it from Python's internals and from changing its inputs, but not from
running without end, allocating without end or failing with any Python exception. This module owns
rendering such a template (ChatTemplate) and bounds what the sandbox does not:

- Time: a trace function (sys.settrace; per thread, so a server may render on its worker threads) checks a
  deadline in the thread's CPU time at the Python calls and lines of the template's code while it compiles
  and runs, so a loop with an empty body stops too, and counts how deep calls nest (a macro calling
  itself). The thread's previous trace function (a debugger, coverage) is put back afterwards; it does not
  see the rendering.
- Memory: what the template builds is sized and bounded in the sandbox it runs in (jaxllm.template_sandbox:
  no value larger than MAX_SIZE, no integer wider than MAX_INT_BITS, MAX_BUILT built in all per render), and
  the output ends at MAX_OUTPUT.
- Errors: every failure (a syntax error, an undefined name, a sandbox refusal, raise_exception(),
  ZeroDivisionError, RecursionError, a limit) is a ChatTemplateError, a ValueError that names the
  template's origin (the model file); never a traceback.
"""
from __future__ import annotations

import gc
import inspect
import json
import os
import stat
import sys
import time

import jinja2
import markupsafe

from jaxllm.template_sandbox import (MAX_BUILT, MAX_SIZE, SANDBOX_FILE, BoundedEnvironment, LimitExceeded,
                                     TemplateRaised, render_state, size_of)

# Limits of one render. Real templates (Qwen2.5's, SmolLM2's, Llama 3's and 3.1's) render a short chat in
# under a millisecond (compiling them once takes 5-40 ms), nest calls 5-12 deep and build a few times
# their output. The limits on values (MAX_SIZE, MAX_BUILT, MAX_INT_BITS) are jaxllm.template_sandbox's.
MAX_SECONDS = 1.0            # one render (its first compiles the template too), at most this much CPU time
                             # (the thread's, less the garbage collections that pause it)
MAX_DEPTH = 200              # Python calls nested in the render: about 40 levels of macros calling macros
MAX_OUTPUT = MAX_SIZE        # the rendered prompt, in characters
MAX_SOURCE = 2**18           # characters of template text (real templates are 1-20 KB)
MAX_PAUSED = 4.0             # seconds of garbage collections at most that one render is not charged for
MAX_TEMPLATE_FILE = 2**24    # bytes of a template file (a tokenizer_config.json holds its added tokens too)

_THIS_FILE = sys._getframe().f_code.co_filename     # as this module's code names it
_CHECKS = (_THIS_FILE, SANDBOX_FILE)   # the checks' code: its loops are bounded, its calls shallow
# Where a limit is raised: in the template's own code, markupsafe's (Markup's methods loop in Python) and
# the checks', while rendering; also in jinja2's, while compiling. Not at the start of a generator's frame:
# a finalizer may be closing it. Python does not raise an exception from a finalizer or a gc callback that runs
# in the middle of the template; it prints it and turns tracing off, and the template would run on unbounded.
_RAISE_IN = ("<template>",                                   # jinja2's name for a template made from a string
             os.path.dirname(markupsafe.Markup.striptags.__code__.co_filename) + os.sep) + _CHECKS
_RAISE_IN_COMPILER = _RAISE_IN + (os.path.dirname(jinja2.Environment.compile.__code__.co_filename) + os.sep,)
_GENERATOR = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
_clock = time.thread_time    # the thread's CPU time: a busy machine neither cuts a render short nor moves its limits


def _collection_starts(phase: str, info: dict) -> None:
  guard = getattr(render_state, "guard", None)
  if guard is not None and phase == "start":
    guard.collecting_since = _clock()


def _collection_ends(phase: str, info: dict) -> None:
  guard = getattr(render_state, "guard", None)
  if guard is not None and phase == "stop" and guard.collecting_since is not None:
    credit = min(_clock() - guard.collecting_since, guard.pause_left)
    guard.deadline += credit
    guard.pause_left -= credit
    guard.collecting_since = None


# A garbage collection that starts in a render pauses it for as long as the whole process's heap takes to
# scan (a second or more in a process with torch and jax loaded): not the template's time. Its pause, with the
# callbacks that run in it, moves the deadline on, by MAX_PAUSED in all at most (a full collection's cost is
# the process's heap, not the template's; the cap bounds how much of it many collections can add):
# _collection_starts runs before the other callbacks, _collection_ends after those registered before this
# module was imported. Within a collection no limit is raised: the finalizers it runs (a template's generator
# closed, its `finally` lines) are where Python would print the exception and turn tracing off.
gc.callbacks.insert(0, _collection_starts)
gc.callbacks.append(_collection_ends)
_COLLECTION_CODE = (_collection_starts.__code__, _collection_ends.__code__)


class ChatTemplateError(ValueError):
  """A chat template could not be rendered: it is broken, refused the messages or hit a limit."""


class _Guard:
  """One render's budget on one thread: the deadline, how deep calls nest, what has been built so far."""

  def __init__(self):
    self.deadline = _clock() + MAX_SECONDS
    self.compiling, self.depth, self.built = False, 0, 0
    self.collecting_since: float | None = None     # the thread time a garbage collection started at, in one
    self.pause_left = MAX_PAUSED                   # collections' seconds still to be credited
    self.frame_tracer = self._frame       # made once: a bound method per event would be garbage per event

  def trace(self, frame, event, arg):
    """sys.settrace's function, called as each Python frame starts; returns the frame's own tracer."""
    code = frame.f_code
    if code in _COLLECTION_CODE:           # a collection's callbacks: a limit raised there would be lost
      return None
    if self.compiling:                     # jinja2's compiler: its loops are bounded by the source's length
      if (_clock() > self.deadline and self.collecting_since is None and not code.co_flags & _GENERATOR
          and code.co_filename.startswith(_RAISE_IN_COMPILER)):
        raise self._limit()
      return None
    if code.co_filename in _CHECKS:        # the checks: their loops are bounded, their calls shallow
      if _clock() > self.deadline and self.collecting_since is None:
        raise self._limit()
      return None                          # no events from inside: faster, and no depth to count
    self.depth += 1
    if (self._over() and not code.co_flags & _GENERATOR and code.co_filename.startswith(_RAISE_IN)):
      raise self._limit()
    return self.frame_tracer

  def _over(self) -> bool:
    """Whether a limit is passed (calls nest too deep, or the deadline), outside a garbage collection."""
    return (self.depth > MAX_DEPTH or _clock() > self.deadline) and self.collecting_since is None

  def _frame(self, frame, event, arg):
    """A frame's tracer: each line (a loop with an empty body runs lines too) checks the limits again."""
    if event == "return":
      self.depth -= 1
    elif event == "line" and self._over() and frame.f_code.co_filename.startswith(_RAISE_IN):
      raise self._limit()
    return self.frame_tracer

  def _limit(self) -> LimitExceeded:
    if self.depth > MAX_DEPTH:
      return LimitExceeded(f"calls nest deeper than {MAX_DEPTH} (a macro that calls itself without end?)")
    return LimitExceeded(f"{'compiling' if self.compiling else 'rendering'} took longer than {MAX_SECONDS} s")

  def charge(self, size: int) -> None:
    self.built += size
    if self.built > MAX_BUILT:
      raise LimitExceeded(f"it built values of more than {MAX_BUILT} characters in all")


class ChatTemplate:
  """A chat template, compiled on first use and rendered within bounds (see the module docstring).

  Args:
    source: the jinja2 template text.
    origin: where it came from, for error messages (the model file's path), or None.
    owner: whose template it is, in error messages ("the model's chat template failed: ...").
  """

  def __init__(self, source: str, origin: str | None = None, owner: str = "the model's"):
    if not isinstance(source, str):
      raise TypeError(f"a chat template is a str, got {type(source).__name__}")
    self.source, self.origin, self.owner = source, origin, owner
    self._template: jinja2.Template | None = None
    self._broken: ChatTemplateError | None = None

  def render(self, **variables) -> str:
    """The template rendered with `variables` (messages, add_generation_prompt, ...).

    Raises:
      ChatTemplateError: on any failure, with what went wrong.
    """
    if self._broken is not None:
      raise self._broken
    if size_of(variables) > MAX_SIZE:
      raise ChatTemplateError(f"{self._where()}the messages are too long to render: more than {MAX_SIZE} "
                              f"characters (~{MAX_SIZE // 4} tokens)")
    guard, previous_guard, previous_trace = _Guard(), getattr(render_state, "guard", None), sys.gettrace()
    render_state.guard = guard
    sys.settrace(guard.trace)
    failure = None
    try:
      text = self._render(variables)
    except (LimitExceeded, Exception) as e:             # a limit; the template's own error, jinja2's or Python's
      failure = e
    finally:
      sys.settrace(previous_trace)                  # first: the code below is not the template's
      render_state.guard = previous_guard
    if failure is None:
      return text
    error = self._error(failure)
    if isinstance(failure, jinja2.TemplateSyntaxError):
      self._broken = error                          # it would fail the same way each time
    raise error from None

  def _render(self, variables: dict) -> str:
    if self._template is None:
      if len(self.source) > MAX_SOURCE:
        raise jinja2.TemplateSyntaxError(f"the template is {len(self.source)} characters long; at most "
                                         f"{MAX_SOURCE} are allowed", 1)
      render_state.guard.compiling = True
      self._template = BoundedEnvironment().from_string(self.source)
      render_state.guard.compiling = False
      sys.settrace(render_state.guard.trace)              # again: had the compiler's limit been swallowed, it is off
    chunks, length = [], 0
    for chunk in self._template.generate(**variables):
      length += len(chunk)
      if length > MAX_OUTPUT:
        raise LimitExceeded(f"its output is longer than {MAX_OUTPUT} characters")
      chunks.append(chunk)
    return "".join(chunks)

  def _error(self, failure: BaseException) -> ChatTemplateError:
    """The ChatTemplateError for a failure: what went wrong (cut to 500 characters), and where."""
    if isinstance(failure, LimitExceeded):
      what = f"it hit a limit: {failure}"
    elif isinstance(failure, jinja2.TemplateSyntaxError):
      what = f"{type(failure).__name__}: {failure.message} (line {failure.lineno})"
    elif isinstance(failure, TemplateRaised):
      what = f"it raised an error: {failure}"
    else:
      what = f"{type(failure).__name__}: {failure}"
    if len(what) > 500:
      what = what[:500] + "..."
    return ChatTemplateError(f"{self._where()}{self.owner} chat template failed: {what}")

  def _where(self) -> str:
    return f"{self.origin!r}: " if self.origin else ""


def read_template_file(path: str | os.PathLike) -> str:
  """The chat template a file holds, for use in place of the model's (generate's and serve's --chat-template):
  the jinja2 text itself, or, in a .json file, a Hugging Face tokenizer_config.json's or chat_template.json's
  "chat_template": the text, or a list of {"name", "template"} whose "default" is taken.

  Raises:
    ValueError: naming the file and saying what it holds instead (not a regular file, too large, not UTF-8,
      not JSON, no template, an empty or too long one). A FIFO or device is refused without blocking on it.
  """
  path = os.fspath(path)
  where = f"chat template file {path!r}"
  as_json = path.lower().endswith(".json")
  try:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))   # a FIFO opens without a writer, then is refused
  except OSError as e:
    raise ValueError(f"cannot read {where}: {e.strerror or e}") from None
  if not stat.S_ISREG(os.fstat(fd).st_mode):
    os.close(fd)
    raise ValueError(f"{where} is not a regular file")
  with os.fdopen(fd, "rb") as f:
    data = f.read(MAX_TEMPLATE_FILE + 1)
  if len(data) > MAX_TEMPLATE_FILE:
    raise ValueError(f"{where} is larger than {MAX_TEMPLATE_FILE} bytes")
  try:
    text = data.decode("utf-8-sig")                # a byte-order mark is not the template's
  except UnicodeDecodeError as e:
    raise ValueError(f"{where} is not UTF-8 text: byte {data[e.start:e.start + 1]!r} at offset {e.start}") from None
  if as_json:
    try:
      config = json.loads(text)
    except (ValueError, RecursionError) as e:      # RecursionError: arrays nested thousands deep
      raise ValueError(f"{where} is not JSON that can be read: {str(e)[:200]}") from None
    text = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(text, list):                     # Hugging Face's named templates
      named = {t["name"]: t.get("template") for t in text if isinstance(t, dict) and isinstance(t.get("name"), str)}
      if "default" not in named:
        raise ValueError(f"{where} names its templates {sorted(named)[:10]}, none of them 'default'")
      text = named["default"]
    if not isinstance(text, str):
      raise ValueError(f"{where} has no \"chat_template\" text (a JSON file must be a tokenizer_config.json or a "
                       f"chat_template.json; any other file is read as the template itself)")
  if not text.strip():
    raise ValueError(f"{where} holds an empty template")
  if len(text) > MAX_SOURCE:
    raise ValueError(f"{where}: the template is {len(text)} characters long; at most {MAX_SOURCE} are allowed")
  return text


def read_template(value: str) -> tuple[str, str]:
  """--chat-template's value, as vLLM takes it: a file (read_template_file), or else, where it holds jinja2's
  braces or a line break, the template text itself. Returns (the text, its origin for error messages).

  Raises:
    ValueError: read_template_file's, or for a value that is neither a file nor template text.
  """
  if os.path.exists(value) or not any(c in value for c in "{}\n"):
    try:
      return read_template_file(value), value
    except ValueError as e:
      if os.path.exists(value):
        raise
      raise ValueError(f"{e} (nor is it template text; a built-in template's name, as llama.cpp takes, is not "
                       "one here)") from None
  if len(value) > MAX_SOURCE:
    raise ValueError(f"the template text is {len(value)} characters long; at most {MAX_SOURCE} are allowed")
  return value, "the --chat-template text"
