"""Tokenizer and chat template from GGUF metadata.

The BPE model, merges and special tokens come from `tokenizer.ggml.*`; the pre-tokenizer is chosen by
`tokenizer.ggml.pre` (the split regex each model family was trained with). Text is byte-level BPE, so
every token maps to a byte string; `StreamDecoder` turns a stream of ids into text without breaking a
UTF-8 character split across tokens. The chat template is rendered by jaxllm.chat_template (untrusted code,
bounded there).
"""
from __future__ import annotations

import codecs
from typing import Iterable, Mapping, Sequence

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from jaxllm.chat_template import ChatTemplate, ChatTemplateError

# Split patterns per `tokenizer.ggml.pre` family (the ones llama.cpp's vocab loader uses).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = ("gpt2", "qwen2", "llama-bpe", "smollm", "default")

# GGUF token types.
_CONTROL, _USER_DEFINED = 3, 4
# End-of-generation tokens by their text, beside the file's eos/eot ids (llama.cpp does the same).
_EOG_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")
MAX_EOG = 16     # end-of-generation ids a sequence can have (the width of decode's eog table)


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
  keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
  table, extra = {}, 0
  for b in range(256):
    if b in keep:
      table[b] = chr(b)
    else:
      table[b] = chr(256 + extra)
      extra += 1
  return table


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _pre_tokenizer(pre: str):
  if pre == "qwen2":
    split = _QWEN2
  elif pre == "llama-bpe":
    split = _LLAMA3
  elif pre == "smollm":
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  elif pre in ("gpt2", "default"):
    split = _GPT2
  else:
    raise ValueError(f"unsupported pre-tokenizer {pre!r}: jaxllm handles {PRE_TOKENIZERS}")
  return pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


class Tokenizer:
  """A GGUF model's tokenizer.

  Attributes:
    vocab_size: number of token ids.
    bos_id, eos_id: from the metadata (may be None).
    add_bos: whether encode() prepends BOS (the file's `tokenizer.ggml.add_bos_token`).
    eog_ids: ids that end generation (eos, eot, and end-of-turn tokens such as <|im_end|>); at most MAX_EOG.
    chat_template: the jinja2 template text, or None.
    source: where the tokenizer came from (the model file's path), named in chat-template errors; or None.

  Args:
    metadata: the GGUF file's key-value metadata.
    source: the file's path, or None.
  """

  def __init__(self, metadata: Mapping, source: str | None = None):
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
      raise ValueError(f"unsupported tokenizer model {model!r}: jaxllm reads byte-level BPE ('gpt2') "
                       "vocabularies (Qwen2/2.5/3, SmolLM2, Llama 3)")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
      raise ValueError("tokenizer.ggml.tokens must be a list of strings, got "
                       f"{type(tokens).__name__} {str(tokens)[:60]}")
    types = metadata.get("tokenizer.ggml.token_type")
    if types is None:
      types = [1] * len(tokens)
    if isinstance(types, np.ndarray):  # GGUFFile's numeric arrays: checked before becoming a list of ints
      if types.ndim != 1 or not np.issubdtype(types.dtype, np.integer):
        raise ValueError(f"tokenizer.ggml.token_type must be a list of integers, got {types.dtype} values")
      if len(types) != len(tokens):
        raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries, but there are {len(tokens)} tokens")
      types = types.tolist()
    if not isinstance(types, list) or not all(isinstance(t, int) for t in types):
      raise ValueError("tokenizer.ggml.token_type must be a list of integers")
    if len(types) != len(tokens):
      raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries, but there are {len(tokens)} tokens")
    raw_merges = metadata.get("tokenizer.ggml.merges", [])
    if not isinstance(raw_merges, list) or not all(isinstance(m, str) for m in raw_merges):
      raise ValueError("tokenizer.ggml.merges must be a list of strings")
    merges = []
    for i, m in enumerate(raw_merges):
      pair = tuple(m.split(" ", 1))
      if len(pair) != 2 or not all(pair):
        raise ValueError(f"tokenizer.ggml.merges: merge {i} ({m[:40]!r}) is not two tokens separated by a space")
      merges.append(pair)
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if not isinstance(pre, str):
      raise ValueError(f"tokenizer.ggml.pre must be a string, got {type(pre).__name__} {str(pre)[:40]}")
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", False)
    if not isinstance(add_bos, (bool, int)):
      raise ValueError(f"tokenizer.ggml.add_bos_token must be a boolean, got {type(add_bos).__name__} "
                       f"{str(add_bos)[:40]}")
    self.vocab_size = len(tokens)
    self.bos_id = _token_id(metadata, "tokenizer.ggml.bos_token_id", len(tokens))
    self.eos_id = _token_id(metadata, "tokenizer.ggml.eos_token_id", len(tokens))
    self.add_bos = bool(add_bos)
    template = metadata.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
      raise ValueError(f"tokenizer.chat_template must be a string, got {type(template).__name__}")
    self.chat_template = template
    self.source = None if source is None else str(source)
    self._template: ChatTemplate | None = None

    try:
      bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                       ignore_merges=pre == "llama-bpe")
    except Exception as e:  # the tokenizers library raises a bare Exception for a bad vocabulary
      raise ValueError(f"the BPE vocabulary in tokenizer.ggml.* is inconsistent: {e}") from None
    tok = _HFTokenizer(bpe)
    if pre == "qwen2":
      tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    special = [i for i, t in enumerate(types) if t == _CONTROL]
    user = [i for i, t in enumerate(types) if t == _USER_DEFINED]
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])
    self._tok = tok
    self._special = frozenset(special)

    added = set(special) | set(user)
    self._bytes = [t.encode("utf-8") if i in added else bytes(_UNICODE_TO_BYTE.get(ch, 0) for ch in t)
                   for i, t in enumerate(tokens)]
    eog = {i for i in (self.eos_id, _token_id(metadata, "tokenizer.ggml.eot_token_id", len(tokens)),
                       _token_id(metadata, "tokenizer.ggml.eom_token_id", len(tokens))) if i is not None}
    eog |= {i for i in special if tokens[i] in _EOG_TEXTS}
    self.eog_ids = _checked_eog(eog, tokens.__getitem__)

  def to_state(self) -> dict:
    """Everything the tokenizer is, as JSON-able values (for the model cache)."""
    return {"hf": self._tok.to_str(), "bytes": [b.decode("latin-1") for b in self._bytes],
            "special": sorted(self._special), "bos_id": self.bos_id, "eos_id": self.eos_id, "add_bos": self.add_bos,
            "chat_template": self.chat_template, "eog_ids": sorted(self.eog_ids)}

  @classmethod
  def from_state(cls, state: dict, source: str | None = None) -> "Tokenizer":
    """The tokenizer to_state() described (without the GGUF metadata it was built from); `source` as in
    Tokenizer()."""
    self = cls.__new__(cls)
    self._tok = _HFTokenizer.from_str(state["hf"])
    self._bytes = [b.encode("latin-1") for b in state["bytes"]]
    self._special = frozenset(state["special"])
    self.vocab_size = len(self._bytes)
    self.bos_id, self.eos_id, self.add_bos = state["bos_id"], state["eos_id"], state["add_bos"]
    self.chat_template = state["chat_template"]
    self.eog_ids = _checked_eog(state["eog_ids"], lambda i: self._bytes[i].decode("utf-8", "replace"))
    self.source = None if source is None else str(source)
    self._template = None
    return self

  def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
    """Text -> ids; special-token texts such as <|im_start|> become their ids. BOS per the model."""
    if not isinstance(text, str):
      raise TypeError(f"encode() takes a str, got {type(text).__name__}")
    try:
      text.encode("utf-8")
    except UnicodeEncodeError as e:
      raise ValueError(f"the text is not valid Unicode: {e.reason} at position {e.start} ({text[e.start:e.end]!r}); "
                       "was it read from bytes that are not UTF-8?") from None
    ids = self._tok.encode(text, add_special_tokens=False).ids
    if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
      ids = [self.bos_id] + ids
    return ids

  def token_bytes(self, token_id: int) -> bytes:
    return self._bytes[token_id]

  @property
  def special_ids(self) -> frozenset[int]:
    """The ids of control tokens (<|im_start|> and the like): text never spells them, only their ids do."""
    return self._special

  def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
    """Ids -> text; invalid UTF-8 (a character cut at the end) becomes U+FFFD."""
    data = b"".join(self._bytes[i] for i in ids if not (skip_special and i in self._special))
    return data.decode("utf-8", errors="replace")

  def set_chat_template(self, source: str, origin: str | None = None) -> None:
    """Renders chats with `source` (jinja2 text from elsewhere than the model file, as --chat-template reads
    it: chat_template.read_template) in place of the file's; origin names it in its errors. A template that
    cannot render a one-message chat, or renders it without the message, is refused here, not on each request.

    Raises:
      ChatTemplateError (a ValueError): the template failed on [{"role": "user", "content": "Hi"}] or left
        "Hi" out.
    """
    if not isinstance(source, str):
      raise TypeError(f"a chat template is a str, got {type(source).__name__}")
    template, kept = ChatTemplate(source, origin or self.source, owner="the"), (self.chat_template, self._template)
    self.chat_template, self._template = source, template
    try:
      text = self.apply_chat_template([{"role": "user", "content": "Hi"}])
      if "Hi" not in text:     # a file of something else (a JSON config read as text) renders without the chat
        raise ChatTemplateError(f"{template._where()}the chat template does not render a chat's messages: a "
                                f"one-message chat ('Hi') became {text[:80]!r}")
    except ValueError:
      self.chat_template, self._template = kept
      raise

  def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
                          tools: Sequence[Mapping] | None = None) -> str:
    """Renders `messages` ([{"role": ..., "content": ...}]) with the model's template; `tools` (OpenAI's
    [{"type": "function", "function": {...}}], as HF's apply_chat_template takes them) is its tools variable.

    Raises:
      ChatTemplateError (a ValueError): the template failed or hit a limit (jaxllm.chat_template).
    """
    if not self.chat_template:
      raise ValueError("this model has no chat template (tokenizer.chat_template is missing)")
    if self._template is None:
      self._template = ChatTemplate(self.chat_template, self.source)
    token = self._bytes[self.bos_id].decode("utf-8", "replace") if self.bos_id is not None else ""
    eos = self._bytes[self.eos_id].decode("utf-8", "replace") if self.eos_id is not None else ""
    return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                 bos_token=token, eos_token=eos, tools=list(tools) if tools else None)


def _checked_eog(ids: Iterable[int], text) -> frozenset[int]:
  """The end-of-generation ids, refused when there are more than decode's table holds (MAX_EOG); `text(i)`
  is token i's text, for the message."""
  ids = frozenset(ids)
  if len(ids) > MAX_EOG:
    first = ", ".join(f"{i} {text(i)!r}" for i in sorted(ids)[:4])
    raise ValueError(f"the tokenizer declares {len(ids)} end-of-generation tokens ({first}, ...); jaxllm "
                     f"handles at most {MAX_EOG}")
  return ids


def _token_id(metadata: Mapping, key: str, vocab_size: int) -> int | None:
  """An optional special-token id from the metadata, checked against the vocabulary."""
  value = metadata.get(key)
  if value is None:
    return None
  if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab_size:
    raise ValueError(f"{key} must be a token id in [0, {vocab_size}), got {value!r}")
  return value


class StreamDecoder:
  """Turns token ids into text as they arrive, holding back an incomplete UTF-8 character."""

  def __init__(self, tokenizer: Tokenizer):
    self._tok = tokenizer
    self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

  def push(self, token_id: int) -> str:
    """Returns the text that token_id completes (may be empty)."""
    return self._utf8.decode(self._tok.token_bytes(token_id))

  def flush(self) -> str:
    return self._utf8.decode(b"", final=True)
