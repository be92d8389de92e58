"""The host's side of a sequence's output: detokenized text, stop strings and the per-sequence result.

The engine yields token ids; SequenceOutput turns one sequence's ids into text as they arrive (through the
tokenizer's StreamDecoder), holds back text that could still become a stop string (StopText), decides why
the sequence finished, and builds its GenerationResult (ids, text, token times, TTFT, TPOT).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxllm.sampling import NONFINITE
from jaxllm.tokenizer import StreamDecoder


@dataclasses.dataclass
class GenerationResult:
  prompt_ids: list[int]
  ids: list[int]                  # new tokens (the stopping EOS excluded)
  text: str                       # decoded new text (stop string excluded)
  finish_reason: str              # "eos" | "stop" | "length" | "context" | "grammar" | "error"
  ttft_ms: float                  # prompt submitted -> first new token on the host
  tpot_ms: float                  # mean time per new token after the first
  tok_per_s: float                # decode tokens per second after the first
  token_times_ms: list[float]     # arrival time of each new token, from the prompt's submission
  error: str | None = None        # what went wrong when finish_reason is "error"
  reused_tokens: int = 0          # prompt tokens whose keys were already in the cache (reuse_cache)

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


class StopText:
  """Holds back text that could still become a stop string; reports when one appears.

  Shown text is kept as a list of pieces and only the held-back tail (shorter than the longest stop string,
  plus the newest piece) is searched and rebuilt, so the cost per token does not grow with the text
  generated.
  """

  def __init__(self, stops: Sequence[str]):
    self.stops = [s for s in stops if s]
    self.shown: list[str] = []   # text already returned, in pieces
    self.pending = ""            # decoded text not returned yet: it may still begin a stop string

  @property
  def text(self) -> str:
    """All the text so far (cut before the stop string, once one appeared)."""
    return "".join(self.shown) + self.pending

  def _show(self, n: int) -> str:
    out, self.pending = self.pending[:n], self.pending[n:]
    if out:
      self.shown.append(out)
    return out

  def push(self, piece: str) -> tuple[str, bool]:
    """Adds decoded text; returns (text safe to show now, whether a stop string was hit)."""
    # Shown text never ends with the start of a stop string (that much is held back), so a stop string
    # can only begin in the pending text.
    self.pending += piece
    hits = [at for at in (self.pending.find(s) for s in self.stops) if at >= 0]
    if hits:                     # the earliest stop string in the text, whatever its place in the list
      at = min(hits)
      self.pending = self.pending[:at]
      return self._show(at), True
    hold = 0
    for s in self.stops:
      for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
        if self.pending.endswith(s[:n]):
          hold = max(hold, n)
          break
    return self._show(len(self.pending) - hold), False

  def flush(self) -> str:
    return self._show(len(self.pending))



class SequenceOutput:
  """Host-side state of one sequence in Engine.generate_batch: ids, text, stop conditions, token times."""

  def __init__(self, prompt_ids, limit, max_tokens, tokenizer, stop, eog):
    self.prompt_ids, self.limit, self.max_tokens, self.eog = prompt_ids, limit, max_tokens, eog
    self.stream = StreamDecoder(tokenizer) if tokenizer is not None else None
    self.stops = StopText(stop)
    self.ids: list[int] = []
    self.times: list[float] = []
    self.finish: str | None = None
    self.error: str | None = None
    self.reused = 0

  def push(self, token: int, t_ms: float) -> str:
    """Takes the next sampled token; returns the text it makes final ("" when finished or held back)."""
    if self.finish:
      return ""
    if token == NONFINITE:
      self.finish = "error"
      self.error = (f"the model's logits were not finite (NaN or inf) at new token {len(self.ids)}: "
                    "nothing was sampled from them")
      return self._flush()
    self.times.append(t_ms)
    if token in self.eog:
      self.finish = "eos"
      return self._flush()
    self.ids.append(token)
    piece = ""
    if self.stream is not None:
      piece, hit = self.stops.push(self.stream.push(token))
      if hit:
        self.finish = "stop"
        return piece
    if len(self.times) >= self.limit:
      self.finish = "length" if self.limit >= self.max_tokens else "context"
      piece += self._flush()
    return piece

  def end(self, reason: str, error: str | None = None) -> str:
    """Ends the sequence for a reason found outside its tokens: its grammar is complete ("grammar"), or refused a
    token ("error", with `error`); returns the text still held back. A grammar completed by the last token the
    limit allowed ends it as "grammar", not "length"."""
    if self.finish in ("length", "context") and reason == "grammar":
      self.finish = reason
      return ""
    if self.finish:
      return ""
    self.finish, self.error = reason, error
    return self._flush()

  def _flush(self) -> str:
    if self.stream is None:
      return ""
    piece, _ = self.stops.push(self.stream.flush())
    return piece + self.stops.flush()

  def result(self) -> GenerationResult:
    times = self.times
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return GenerationResult(prompt_ids=self.prompt_ids, ids=self.ids,
                            text=self.stops.text if self.stream is not None else "",
                            finish_reason=self.finish or "length", ttft_ms=times[0] if times else 0.0,
                            tpot_ms=tpot, tok_per_s=1e3 / tpot if tpot > 0 else 0.0, token_times_ms=times,
                            error=self.error, reused_tokens=self.reused)
