"""The sandbox a chat template renders in (jaxllm.chat_template runs it): jinja2's
ImmutableSandboxedEnvironment with everything a template builds sized and bounded.

What the template builds is sized: the operators `+ - * ** %` (the sandbox's intercepted binops), `~`,
list/tuple/dict literals, filters, method calls and globals, the text that `{% set %}` blocks, macros and
`{% call %}` capture, and each `{{ }}`. A step that one call could make huge (`'a' * 10**10`,
`'{:>999999999}'.format(1)`, `x|center(10**9)`, `2 ** 10**9`) is refused before it runs, any other step
right after it: no value may be larger than MAX_SIZE nor an integer wider than MAX_INT_BITS, and all values
built are charged to the render's budget (MAX_BUILT, kept by the render's guard in `render_state.guard`).
One call may still use a few times MAX_SIZE while it runs (splitting a long string into characters, say).

Sizes are in characters: a string's length; for a list, tuple, set or dict, _ITEM per item (or per key and
per value) plus the sizes of its items, roughly the length of its text (`{{ [...] }}`) and at least its
memory in pointers. The functions here are the checks: the render's time and depth tracer skips their frames
(SANDBOX_FILE) and stops a render inside them only at its deadline.
"""
from __future__ import annotations

import functools
import inspect
import itertools
import re
import string
import sys
import threading
from collections.abc import Mapping

import jinja2
import jinja2.compiler
import jinja2.sandbox
from jinja2.runtime import Macro, Namespace

MAX_SIZE = 2 * 2**20         # any one value: 2 Mi characters hold ~500k tokens, 4x a 128k-token context
MAX_BUILT = 32 * MAX_SIZE    # all values built in one render, dropped ones too: bounds what is held without
                             # tracking what is freed
MAX_INT_BITS = 4096          # integers a template computes (2**4096 has 1234 digits)

_ITEM = 8                    # size of an item in a container: a pointer; more than the ", " and quotes of its text
_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))
SANDBOX_FILE = sys._getframe().f_code.co_filename     # as this module's code names it
render_state = threading.local()   # .guard: the chat_template._Guard of the render on this thread


class LimitExceeded(BaseException):
  """A limit was hit. A BaseException so that no `except Exception` in jinja2 or a filter swallows it."""


class TemplateRaised(Exception):
  """The template called raise_exception(message)."""


# size_of's kinds of value, by type (filled in as types appear).
_TEXT, _NUMBER, _SEQUENCE, _MAPPING, _NAMESPACE, _OTHER = range(6)
_KINDS = {str: _TEXT, bytes: _TEXT, int: _NUMBER, bool: _NUMBER, list: _SEQUENCE, tuple: _SEQUENCE,
          dict: _MAPPING, Namespace: _NAMESPACE, float: _OTHER, type(None): _OTHER}


def _kind(kind: type) -> int:
  """A type's kind for size_of (by type, not isinstance: a Namespace answers __class__ in Python)."""
  if kind not in _KINDS:
    _KINDS[kind] = (_TEXT if issubclass(kind, (str, bytes)) else _NUMBER if issubclass(kind, int) else
                    _SEQUENCE if issubclass(kind, (list, tuple, set, frozenset, *_VIEWS)) else
                    _MAPPING if issubclass(kind, dict) else _NAMESPACE if issubclass(kind, Namespace) else _OTHER)
  return _KINDS[kind]


def size_of(value, limit: int = MAX_SIZE) -> int:
  """The size of `value` (see the module docstring), counted only until it passes `limit`."""
  total, todo = 0, [value]
  while todo and total <= limit:
    v = todo.pop()
    kind = _KINDS.get(type(v))
    if kind is None:
      kind = _kind(type(v))
    if kind == _TEXT:
      total += len(v)
    elif kind == _NUMBER:
      total += _ITEM + v.bit_length() // 3
    elif kind == _SEQUENCE:
      total += _ITEM * len(v)
      for item in v:                      # strings and small ints here: most items are, and it is faster
        kind = type(item)
        if kind is str:
          total += len(item)
        elif kind is int and -2**63 <= item < 2**63:
          total += _ITEM
        else:
          todo.append(item)
    elif kind == _MAPPING or kind == _NAMESPACE:
      items = object.__getattribute__(v, "_Namespace__attrs") if kind == _NAMESPACE else v
      total += 2 * _ITEM * len(items)
      todo.extend(items.keys())
      todo.extend(items.values())
    else:
      total += _ITEM
  return total


def _need(size: int, what: str) -> None:
  """Refuses a step that would build a value of `size`."""
  if size > MAX_SIZE:
    raise LimitExceeded(f"{what} would make a value of size {size}; at most {MAX_SIZE} is allowed")


def _made(value, what: str):
  """Checks and charges a value that a step has just built; returns it."""
  if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
    raise LimitExceeded(f"{what} made an integer of {value.bit_length()} bits; at most {MAX_INT_BITS} are allowed")
  size = size_of(value)
  if size > MAX_SIZE:
    raise LimitExceeded(f"{what} made a value larger than {MAX_SIZE}; at most {MAX_SIZE} is allowed")
  render_state.guard.charge(size)
  return value


def _text(value, what: str) -> str:
  """str(value), refused before it is made when it would be too long."""
  if isinstance(value, str):
    return value
  _need(size_of(value), what)
  return _made(str(value), what)


def _take(value, what: str) -> tuple[list, int]:
  """The items of an iterable as a list, and their size; refused as soon as they would pass MAX_SIZE."""
  if isinstance(value, (str, bytes)):
    _need(_ITEM * len(value), what)
    return list(value), (_ITEM + 1) * len(value)
  items, size = [], 0
  for item in value:
    kind = type(item)
    size += _ITEM + (len(item) if kind is str else _ITEM + item.bit_length() // 3 if kind is int else size_of(item))
    if size > MAX_SIZE:
      raise LimitExceeded(f"{what} would make a value larger than {MAX_SIZE}; at most {MAX_SIZE} is allowed")
    items.append(item)
  return items, size


def _width(number: str) -> int:
  """A decimal number from a format string (widths and precisions), capped past MAX_SIZE."""
  return int(number.lstrip("0")[:10] or "0")


def _check_format(fmt: str, args, marker: str, nested: bool, what: str) -> None:
  """Refuses a %-format (`marker` "%") or str.format ("{") whose result could pass MAX_SIZE: each field may
  be as wide as the largest number in the format (a width or precision), as a number argument when widths
  come from the arguments (`nested`: `%*d`, `{:{}}`), and as long as the longest argument."""
  values = list(args.values()) if isinstance(args, Mapping) else list(args) if isinstance(args, tuple) else [args]
  widest = max((_width(n) for n in re.findall(r"\d+", fmt)), default=0)
  if nested:
    widest = max([widest] + [v for v in values if isinstance(v, int)])
  longest = max((size_of(v) for v in values), default=0)
  _need(len(fmt) + fmt.count(marker) * (widest + longest), what)


def _check_method(obj, args: tuple, kwargs: dict) -> tuple:
  """Refuses a call of a str/bytes/int method that would build too large a value; returns the arguments
  (str.join's iterable as a list)."""
  method = getattr(obj, "__wrapped__", obj)        # the sandbox wraps str.format and str.format_map
  owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
  what = f"{type(owner).__name__}.{name}()"
  if isinstance(owner, (str, bytes)):
    first = args[0] if args else None
    if name in ("center", "ljust", "rjust", "zfill") and isinstance(first, int):
      _need(max(first, len(owner)), what)
    elif name == "expandtabs":
      tab = first if isinstance(first, int) else kwargs.get("tabsize", 8)
      _need(len(owner) + owner.count("\t" if isinstance(owner, str) else b"\t") * max(tab, 0), what)
    elif name == "replace" and len(args) >= 2:
      old, new = args[0], args[1]
      if isinstance(old, (str, bytes)) and isinstance(new, (str, bytes)):
        _check_replace(owner, old, new, args[2] if len(args) > 2 else -1, what)
    elif name == "join" and args:
      items, size = _take(args[0], what)
      _need(size + len(owner) * len(items), what)
      args = (items,) + args[1:]
    elif name in ("format", "format_map") and isinstance(owner, str):
      values = args[0] if name == "format_map" and args else args + tuple(kwargs.values())
      nested = any("{" in (spec or "") for _, _, spec, _ in string.Formatter().parse(owner))
      _check_format(owner, values, "{", nested, what)
    elif name == "translate" and isinstance(first, Mapping):
      longest = max((len(v) for v in first.values() if isinstance(v, str)), default=1)
      _need(len(owner) * max(longest, 1), what)
  elif isinstance(owner, int) and name == "to_bytes":
    length = args[0] if args else kwargs.get("length", 1)
    if isinstance(length, int):
      _need(length, what)
  return args


def _check_replace(s, old, new, count, what: str) -> None:
  found = s.count(old) if old else len(s) + 1
  if isinstance(count, int) and count >= 0:
    found = min(found, count)
  _need(len(s) + found * len(new), what)


# Filters. Each is wrapped (_bounded_filter): its input is sized first where the filter turns it into text
# (_STRINGIFIES) and taken as a bounded list where the filter walks it into a list (_TAKES); a filter that
# could build a large value from small arguments checks them (_check_arguments); every result is checked.
# pprint, urlize, wordwrap and xmlattr are left out: chat templates have no use for them, and each could
# build much more than its input in one call.
_LEFT_OUT = frozenset({"pprint", "urlize", "wordwrap", "xmlattr"})
_STRINGIFIES = frozenset({"capitalize", "center", "e", "escape", "forceescape", "format", "indent", "lower",
                          "replace", "safe", "string", "striptags", "title", "tojson", "trim", "truncate",
                          "upper", "urlencode", "wordcount"})
_TAKES = frozenset({"batch", "groupby", "join", "list", "slice", "sort", "sum", "unique"})
_ARGUMENTS = frozenset({"batch", "center", "format", "indent", "join", "replace", "sum", "tojson"})


def _check_arguments(name: str, a: dict, size: int | None, what: str) -> None:
  """Checks the bound arguments `a` of a filter in _ARGUMENTS; `size`: its input's, when taken as a list."""
  if name == "center" and isinstance(a["width"], int):
    _need(max(a["width"], len(str(a["value"]))), what)
  elif name == "indent":
    width, s = a["width"], str(a["s"])
    if isinstance(width, int):
      _need(width, what)
      width = " " * max(width, 0)
    _need(len(s) + (s.count("\n") + 1) * len(str(width)), what)
  elif name == "format":
    fmt = str(a["value"])
    _check_format(fmt, a["kwargs"] or a["args"], "%", "*" in fmt, what)
  elif name == "replace":
    _check_replace(str(a["s"]), str(a["old"]), str(a["new"]), a["count"], what)
  elif name == "join":
    _need(size + len(str(a["d"])) * len(a["value"]), what)
  elif name == "tojson" and a["indent"] is not None:
    indent = a["indent"]
    indent = " " * max(indent, 0) if isinstance(indent, int) else str(indent)
    _need(len(indent), what)
    value_size = size_of(a["value"])     # each item on a line of its own, indented to its depth
    _need(6 * value_size + (value_size // _ITEM + 1) * (1 + len(indent) * _depth(a["value"])), what)
  elif name == "batch" and a["fill_with"] is not None and isinstance(a["linecount"], int):
    _need(_ITEM * a["linecount"], what)
  elif name == "sum" and isinstance(a["start"], (list, tuple)):
    _need(size_of(a["start"]) + size, what)


def _depth(value) -> int:
  """How deeply lists, tuples and dicts nest in `value` (walking at most MAX_SIZE // _ITEM of them)."""
  deepest, todo, steps = 0, [(value, 0)], 0
  while todo and steps <= MAX_SIZE // _ITEM:
    v, level = todo.pop()
    steps += 1
    deepest = max(deepest, level)
    kind = _kind(type(v))
    if kind == _SEQUENCE:
      todo.extend((i, level + 1) for i in v)
    elif kind == _MAPPING:
      todo.extend((i, level + 1) for i in v.values())
  return deepest


def _sum(environment, iterable, attribute=None, start=0):
  """jinja2's sum, adding lists and tuples in linear time (Python's sum copies the total at each step)."""
  if attribute is not None:
    iterable = map(jinja2.filters.make_attrgetter(environment, attribute), iterable)
  if isinstance(start, (list, tuple)):
    items = list(iterable)
    for i in items:
      if type(i) is not type(start):
        raise TypeError(f'can only concatenate {type(start).__name__} (not "{type(i).__name__}") '
                        f"to {type(start).__name__}")
    return type(start)(itertools.chain(start, *items))
  return sum(iterable, start)


def _bounded_filter(name: str, func):
  """The filter `func` with its input, arguments and result checked (see above)."""
  if name == "sum":
    func = jinja2.filters.pass_environment(_sum)
  elif getattr(func, "jinja_async_variant", False):
    func = func.__wrapped__             # the sync function itself (the wrapper takes an eval context first)
  what = f"the {name!r} filter"
  first = 0 if getattr(func, "jinja_pass_arg", None) is None else 1   # where the input is: after a context
  signature = inspect.signature(func) if name in _ARGUMENTS else None
  stringifies, takes = name in _STRINGIFIES, name in _TAKES

  @functools.wraps(func)                # keeps jinja2's pass_context/pass_eval_context marks
  def bounded(*args, **kwargs):
    size = None
    if len(args) > first:
      if stringifies:
        _need(size_of(args[first]), what)
      if takes:
        items, size = _take(args[first], what)
        args = args[:first] + (items,) + args[first + 1:]
    if signature is not None:
      bound = signature.bind(*args, **kwargs)
      bound.apply_defaults()
      _check_arguments(name, bound.arguments, size, what)
    return _made(func(*args, **kwargs), what)
  return bounded


def _raise_exception(message):
  raise TemplateRaised(_text(message, "raise_exception()"))


class _CodeGenerator(jinja2.compiler.CodeGenerator):
  """jinja2's code generator with `~` and list/tuple/dict literals routed through the environment's checks."""

  @jinja2.compiler.optimizeconst
  def visit_Concat(self, node, frame):
    if frame.eval_ctx.volatile:         # the same choice of join as jinja2's own visit_Concat
      join = "(markup_join if context.eval_ctx.volatile else str_join)"
    elif frame.eval_ctx.autoescape:
      join = "markup_join"
    else:
      join = "str_join"
    self.write(f"environment.checked_join({join}, (")
    for arg in node.nodes:
      self.visit(arg, frame)
      self.write(", ")
    self.write("))")

  def _checked_literal(self, visit, node, frame):
    self.write("environment.checked_literal(")
    visit(node, frame)
    self.write(")")

  def visit_List(self, node, frame):
    self._checked_literal(super().visit_List, node, frame)

  def visit_Dict(self, node, frame):
    self._checked_literal(super().visit_Dict, node, frame)

  def visit_Tuple(self, node, frame):
    if node.ctx != "load":              # a target: `{% for a, b in ... %}`, `{% set a, b = ... %}`
      super().visit_Tuple(node, frame)
    else:
      self._checked_literal(super().visit_Tuple, node, frame)


class BoundedEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
  """The sandbox with every way of building a value checked (see the module docstring)."""

  intercepted_binops = frozenset({"+", "-", "*", "**", "%"})    # those that can build more than they take
  code_generator_class = _CodeGenerator

  def __init__(self):
    super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                     finalize=self._finalize)
    self.concat = self._concat          # joins the text that {% set %} blocks, macros and {% call %} capture
    self.globals.pop("lipsum")          # lorem ipsum: no use in a chat template
    self.globals["raise_exception"] = _raise_exception
    self.filters = {name: _bounded_filter(name, func) for name, func in self.filters.items()
                    if name not in _LEFT_OUT}

  def call_binop(self, context, operator, left, right):
    what = f"{operator!r}"
    if operator == "*":
      for seq, n in ((left, right), (right, left)):
        if isinstance(n, int) and isinstance(seq, (str, bytes, list, tuple)):
          _need(size_of(seq) * max(n, 0), what)
    elif operator == "**":
      if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        if left.bit_length() * right > MAX_INT_BITS:
          raise LimitExceeded(f"{what} would make an integer of about {left.bit_length() * right} bits; "
                          f"at most {MAX_INT_BITS} are allowed")
    elif operator == "%" and isinstance(left, (str, bytes)):
      fmt = str(left)
      _check_format(fmt, right, "%", "*" in fmt, what)
    return _made(super().call_binop(context, operator, left, right), what)

  def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's names: not to clash with kwargs)
    args = _check_method(__obj, args, kwargs)
    result = super().call(__context, __obj, *args, **kwargs)
    if isinstance(__obj, Macro):        # its text was checked as it was captured
      return result
    return _made(result, f"calling {getattr(__obj, '__name__', type(__obj).__name__)}")

  def handle_exception(self, source=None):
    """Raises the error being handled as it is. (jinja2 rewrites the traceback to point into the template by
    running code under the template's name, which a limit could hit in the middle.)"""
    raise                               # noqa: PLE0704 (called from jinja2's `except` blocks)

  def checked_join(self, join, parts):
    _need(sum(len(p) if isinstance(p, str) else size_of(p) for p in parts), "'~'")
    return _made(join(parts), "'~'")

  def checked_literal(self, value):
    return _made(value, "a literal")

  def _concat(self, parts):
    parts = parts if isinstance(parts, list) else list(parts)
    _need(sum(len(p) for p in parts), "captured text")
    return _made("".join(parts), "captured text")

  def _finalize(self, value):
    return _text(value, "'{{ }}'")
