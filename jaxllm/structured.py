"""Structured output on the host: a JSON schema turned into each step's token mask, by llguidance.

llguidance (Rust, from the guidance project; llama.cpp and vLLM use it) compiles a JSON schema or a Lark
grammar into an Earley parser over a lexer, and computes the set of tokens allowed next on the fly, per step,
in tens of microseconds, walking a trie of the vocabulary's bytes: there is no index over the vocabulary to
precompute per grammar, so a request's schema costs milliseconds to compile, not seconds.

  grammar_tokenizer(tokenizer, vocab_size)  llguidance's view of a GGUF vocabulary: jaxllm's Tokenizer's bytes
                                            per id (control tokens marked special) and its end-of-generation ids
  GrammarCompiler(tokenizer, vocab_size)    schemas (json_schema) or Lark sources (lark) -> Grammar, refused
                                            with a ValueError that says why
  Grammar.constraint()                      one sequence's matcher (Constraint)
  Constraint.mask                           the next token's mask, uint32 [ceil(V / 32)]: token t allowed where
                                            bit t % 32 of word t // 32 is set (sampling.Sampler.mask's layout)
  Constraint.advance(token)                 the token the device drew under that mask; then `complete` says
                                            whether the grammar is finished (only an end of generation may follow)

The device applies the mask (sampling.sample); this module runs on the host alone (numpy, no device work).
llguidance is imported when a compiler is first made (the `serve` extra pins it), so the engine runs without it.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from jaxllm.sampling import MASK_BITS, mask_words
from jaxllm.tokenizer import Tokenizer

# Whitespace between JSON tokens, as llama.cpp's JSON grammars bound it: none, a space, or one or two newlines
# and an indentation. Unbounded whitespace (llguidance's default) lets a model emit blanks forever: a weak or
# random model often does.
WHITESPACE = r"(\x20|\x0A{1,2}[\x20\x09]{0,20})?"
JSON_OBJECT = {"type": "object"}     # the schema of OpenAI's json_object mode: any JSON object
_SPECIAL = b"\xff"                   # llguidance's mark of a special token's bytes


def _llguidance():
  try:
    import llguidance
  except ImportError:
    raise ImportError("structured output needs llguidance: pip install llguidance==1.9.1 "
                      "(or the serve extra, pip install -e '.[serve]')") from None
  return llguidance


class _Vocabulary:
  """What llguidance's TokenizerWrapper reads: token bytes by id, the special ids, and an encoder of text."""

  def __init__(self, tokenizer: Tokenizer, vocab_size: int):
    special = tokenizer.special_ids
    self.tokens = [(_SPECIAL if i in special else b"") + tokenizer.token_bytes(i)
                   for i in range(tokenizer.vocab_size)] + [b""] * (vocab_size - tokenizer.vocab_size)
    self.eos_token_id = tokenizer.eos_id
    self.bos_token_id = tokenizer.bos_id
    self.special_token_ids = sorted(special)
    self._tokenizer = tokenizer

  def __call__(self, text: str) -> list[int]:
    return self._tokenizer.encode(text, add_bos=False)


def grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int):
  """llguidance's LLTokenizer of a jaxllm Tokenizer, padded to the model's vocab_size (ids past the tokenizer's
  have no bytes: never allowed); its end-of-generation tokens are the tokenizer's eog_ids."""
  llg = _llguidance()
  if tokenizer.vocab_size > vocab_size:
    raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary {vocab_size}: "
                     "token masks cover the model's")
  eog = sorted(tokenizer.eog_ids)
  if not eog:
    raise ValueError("structured output needs an end-of-generation token; this tokenizer declares none")
  return llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary(tokenizer, vocab_size)), n_vocab=vocab_size, eos_token=eog)


class Constraint:
  """One sequence's place in a grammar: the mask of its next token, advanced by each token it draws.

  Attributes:
    mask: uint32 [ceil(V / 32)], the tokens allowed next.
    complete: the grammar is finished: nothing but an end of generation may follow.
    error: why the matcher refused a token (a token outside the mask: a defect), or None.
  """

  def __init__(self, matcher, eog_ids: frozenset[int], words: int):
    self._matcher, self._eog, self._words = matcher, eog_ids, words
    self.error: str | None = None
    self.complete = False
    self.mask = self._next_mask()

  def _next_mask(self) -> np.ndarray:
    # llguidance's mask may hold a word more than the vocabulary needs (a bit for an id past it): cut it off.
    mask = np.frombuffer(self._matcher.compute_bitmask(), np.uint32)[:self._words].copy()
    assert mask.shape == (self._words,), (mask.shape, self._words)
    return mask

  def advance(self, token: int) -> None:
    """Takes the token drawn under `mask`; updates mask, complete and error."""
    if self.complete or self.error:
      return
    if not self._matcher.consume_token(int(token)):
      self.error = f"the grammar refused token {token}: {(self._matcher.get_error().splitlines() or [''])[0][:200]}"
      return
    self.mask = self._next_mask()
    others = self.mask.copy()
    for t in self._eog:
      others[t // MASK_BITS] &= ~np.uint32(1 << (t % MASK_BITS))
    self.complete = self._matcher.is_stopped() or (self._matcher.is_accepting() and not others.any())


class Grammar:
  """A compiled grammar: each constraint() is a fresh matcher of it (a copy of the one compiled)."""

  def __init__(self, matcher, eog_ids: frozenset[int], words: int):
    self._matcher, self._eog, self._words = matcher, eog_ids, words

  def constraint(self) -> Constraint:
    return Constraint(self._matcher.deep_copy(), self._eog, self._words)


class GrammarCompiler:
  """Compiles JSON schemas into Grammars over one model's vocabulary (the LLTokenizer built once).

  Args:
    tokenizer: the model's jaxllm Tokenizer.
    vocab_size: the model's vocabulary (Config.vocab_size): the masks' width is ceil(vocab_size / 32).
  """

  def __init__(self, tokenizer: Tokenizer, vocab_size: int):
    self._llg = _llguidance()
    self._tokenizer = grammar_tokenizer(tokenizer, vocab_size)
    self._eog = frozenset(tokenizer.eog_ids)
    self._words = mask_words(vocab_size)

  def json_schema(self, schema: Any) -> Grammar:
    """The grammar of JSON text that validates against `schema` (a dict); ValueError if it is not a schema
    llguidance enforces, saying what it found."""
    if not isinstance(schema, dict):
      raise ValueError(f"a JSON schema must be a JSON object, got {_short(schema)}")
    try:
      grammar = self._llg.LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_pattern": WHITESPACE})
    except (ValueError, TypeError) as e:
      raise ValueError(f"the JSON schema cannot be read: {e}") from None
    return self._grammar(grammar, "JSON schema", f" (schema {_short(schema)})")

  def lark(self, source: str) -> Grammar:
    """The grammar of a Lark source in llguidance's dialect (terminals, rules, %json {schema} for JSON that
    validates against a schema: jaxllm.serve.tools' call formats); ValueError saying why it cannot be made."""
    try:
      grammar = self._llg.LLMatcher.grammar_from_lark(source)
    except (ValueError, TypeError) as e:
      raise ValueError(f"the grammar cannot be read: {e}") from None
    return self._grammar(grammar, "grammar")

  def _grammar(self, grammar: str, what: str, detail: str = "") -> Grammar:
    matcher = self._llg.LLMatcher(self._tokenizer, grammar, log_level=0)
    if matcher.is_error():
      first = (matcher.get_error().splitlines() or [""])[0][:300]
      raise ValueError(f"llguidance cannot enforce this {what}: {first}{detail}")
    return Grammar(matcher, self._eog, self._words)


def _short(value: Any) -> str:
  text = json.dumps(value) if isinstance(value, (dict, list, str, int, float, bool, type(None))) else repr(value)
  return text if len(text) <= 80 else text[:77] + "..."
