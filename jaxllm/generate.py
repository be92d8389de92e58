"""python -m jaxllm.generate: loads the model, generates, streams the text and reports; the options, their
defaults and the usage text are jaxllm.cli_options's (see docs/usage.md).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import sys
import time

from jaxllm.cli_options import (CHAT_CONTEXT, CONTEXT_ROUND, INTERRUPTED, MAX_REPEAT_LAST_N, build_parser,
                                read_chat_template)
from jaxllm.device_memory import exit_on_out_of_memory, explain, out_of_memory
from jaxllm.models import DEFAULT_MODEL
from jaxllm.weights import resolve_quant


def _default_context(prompt_len: int, max_tokens: int, model_ctx: int) -> int:
  want = -(-(prompt_len + max_tokens) // CONTEXT_ROUND) * CONTEXT_ROUND
  return max(min(want, model_ctx), prompt_len + 1)


MAX_TEXT_FILE = 2**26     # bytes of a --file (standard input too), --prompts-file or --json-schema


def _read_text(path: str, what: str) -> str:
  try:
    with open(path, "rb") as f:
      data = f.read(MAX_TEXT_FILE + 1)
  except OSError as e:
    raise SystemExit(f"error: cannot read {what}: {e}") from None
  if len(data) > MAX_TEXT_FILE:
    raise SystemExit(f"error: {what} {path!r} is longer than {MAX_TEXT_FILE} bytes")
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise SystemExit(f"error: {what} {path!r} is not UTF-8 text: byte {data[e.start:e.start + 1]!r} at "
                     f"offset {e.start}") from None


def _read_stdin(what: str) -> str:
  data = sys.stdin.buffer.read(MAX_TEXT_FILE + 1)
  if len(data) > MAX_TEXT_FILE:
    raise SystemExit(f"error: {what} (standard input) is longer than {MAX_TEXT_FILE} bytes")
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise SystemExit(f"error: {what} (standard input) is not UTF-8 text: byte {data[e.start:e.start + 1]!r} at "
                     f"offset {e.start}") from None


_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def unescape(text: str) -> str:
  """llama.cpp's -e: \\n, \\t and \\\\ become a newline, a tab and a backslash; other backslashes stay."""
  return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], text)


def _check_args(args) -> list[str]:
  """Argument errors before anything heavy is imported; returns the prompt texts."""
  if args.model and args.model_pos and args.model != args.model_pos:
    raise SystemExit(f"error: model given twice ({args.model_pos!r} and --model {args.model!r})")
  if args.max_tokens is not None and args.max_tokens < 1:
    raise SystemExit(f"error: --max-tokens must be >= 1, got {args.max_tokens}")
  if args.seed == -1:
    args.seed = secrets.randbits(63)
  if not 0 <= args.seed < 2 ** 63:
    raise SystemExit(f"error: --seed must be in [0, 2^63) or -1 (random), got {args.seed}")
  if not -1 <= args.repeat_last_n <= MAX_REPEAT_LAST_N:
    raise SystemExit(f"error: --repeat-last-n must be in [0, {MAX_REPEAT_LAST_N}] (the device sampler's window; "
                     f"0 = penalties off) or -1 (the whole context), got {args.repeat_last_n}")
  if args.repeat_last_n == -1 and args.max_context is not None:
    _check_whole_context(args.max_context)
  args.top_k = max(args.top_k, 0)   # llama.cpp: k <= 0 is no top-k
  if args.threads is not None and args.threads < 1:
    raise SystemExit(f"error: --threads must be >= 1, got {args.threads}")
  if args.system and not (args.chat or args.interactive):
    raise SystemExit("error: --system needs --chat or -i")
  if args.chat_template and not (args.chat or args.interactive):
    raise SystemExit("error: --chat-template needs --chat or -i")
  args.template, args.template_origin = read_chat_template(args.chat_template)
  if args.max_context is not None and args.max_context < 2:
    raise SystemExit(f"error: --max-context must be >= 2, got {args.max_context}")
  texts = list(args.prompt)
  if args.file == "-":
    texts.append(_read_stdin("--file -"))
  elif args.file:
    texts.append(_read_text(args.file, "--file"))
  if args.prompts_file:
    texts += [line for line in _read_text(args.prompts_file, "--prompts-file").splitlines() if line.strip()]
  if args.interactive and texts:
    raise SystemExit("error: -i reads its prompts from the terminal: drop --prompt / --file / --prompts-file")
  if not texts and not args.interactive:
    raise SystemExit("error: give a prompt (--prompt TEXT, repeatable, -f FILE, --prompts-file FILE) or -i")
  if args.escape:
    texts = [unescape(t) for t in texts]
    args.stop = [unescape(t) for t in args.stop]
  args.schema = _read_schema(args)
  return texts


def _read_schema(args) -> dict | None:
  """The JSON schema of --json-schema FILE ({"type": "object"} for --json-object), or None."""
  if args.json_schema and args.json_object:
    raise SystemExit("error: give --json-schema FILE or --json-object, not both")
  if not args.json_schema:
    return {"type": "object"} if args.json_object else None
  try:
    schema = json.loads(_read_text(args.json_schema, "--json-schema"))
  except ValueError as e:
    schema = e
  if not isinstance(schema, dict):
    got = f"text that is not JSON ({schema})" if isinstance(schema, ValueError) else \
        f"{type(schema).__name__} {json.dumps(schema)[:60]}"
    raise SystemExit(f"error: --json-schema {args.json_schema!r} must hold a JSON schema (a JSON object), got {got}")
  return schema


def _grammar(args, tok, vocab_size: int):
  """The compiled grammar of the schema (_read_schema's), or None; a schema llguidance cannot enforce is a
  one-line error."""
  if args.schema is None:
    return None
  from jaxllm.structured import GrammarCompiler
  where = f"--json-schema {args.json_schema!r}" if args.json_schema else "--json-object"
  try:
    return GrammarCompiler(tok, vocab_size).json_schema(args.schema)
  except (ImportError, ValueError) as e:
    raise SystemExit(f"error: {where}: {e}") from None


def _check_whole_context(max_context: int) -> None:
  """--repeat-last-n -1 (the whole context) where the context fits in the device sampler's window."""
  if max_context > MAX_REPEAT_LAST_N:
    raise SystemExit(f"error: --repeat-last-n -1 (the whole context) takes a context of at most {MAX_REPEAT_LAST_N} "
                     f"tokens (the device sampler's window), this one holds {max_context}: give --repeat-last-n "
                     f"{MAX_REPEAT_LAST_N} or less, or --max-context {MAX_REPEAT_LAST_N}")


def _settle(params, repeat_last_n: int, max_context: int, vocab_size: int):
  """The sampling settings once the context and the vocabulary are known: --repeat-last-n -1 is the whole
  context (refused where that is longer than the sampler's window), and a top-k of at least the vocabulary is
  no top-k (llama.cpp's rule; the step without the vocabulary's sort then serves it)."""
  if repeat_last_n == -1:
    _check_whole_context(max_context)
    params = dataclasses.replace(params, repeat_last_n=max_context)
  if params.top_k >= vocab_size:
    params = dataclasses.replace(params, top_k=0)
  return params


def main(argv=None) -> int:
  """The CLI; Ctrl-C at any stage ends with one line `interrupted` on stderr and status 130, the device out of
  memory at any stage with one line `error: ...` (jaxllm.device_memory) and status 1."""
  try:
    with exit_on_out_of_memory():
      return _main(argv)
  except KeyboardInterrupt:
    print("interrupted", file=sys.stderr, flush=True)
    return INTERRUPTED


def _main(argv) -> int:
  args = build_parser().parse_args(argv)
  if args.threads is not None:
    os.environ["JAXLLM_CPU_THREADS"] = str(args.threads)   # read by the CPU kernels when they first run
  if args.clear_cache:
    from jaxllm import store
    removed = store.clear()
    print("removed " + (", ".join(removed) if removed else "nothing (the cache was empty)"), file=sys.stderr)
    return 0
  texts = _check_args(args)
  model = args.model or args.model_pos or DEFAULT_MODEL
  t_start = time.perf_counter()

  from jaxllm.progress import Stages, compile_line  # imports jax: after argument errors
  from jaxllm.sampling import SamplingParams
  stages = Stages(quiet=args.quiet)
  try:    # checked before the model loads; -1 and a top-k past the vocabulary are settled once it has
    params = SamplingParams(temperature=args.temperature, top_k=min(args.top_k, 2 ** 31 - 1), top_p=args.top_p,
                            min_p=args.min_p, repeat_penalty=args.repeat_penalty,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            repeat_last_n=max(args.repeat_last_n, 0))
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None

  from jaxllm import executables, graphs
  from jaxllm.cache import check_fits
  from jaxllm.engine import Engine, greedy_mode
  from jaxllm.load import load
  from jaxllm.parallel import make_mesh
  try:
    args.quant = resolve_quant(args.quant, tensor_parallel=args.tp != 1)
    config, weights, tok = load(model, quant=args.quant, progress=stages, cache=not args.no_cache)
  except (ValueError, FileNotFoundError, RuntimeError) as e:
    if out_of_memory(e):
      raise                                               # main's one line
    raise SystemExit(f"error: {e}") from None
  if args.template is not None:
    try:
      tok.set_chat_template(args.template, origin=args.template_origin)
    except ValueError as e:
      raise SystemExit(f"error: --chat-template: {e}") from None
  if args.n_gpu_layers is not None:
    import jax
    where = "the GPU" if jax.default_backend() == "gpu" else f"the {jax.default_backend().upper()} (no GPU here)"
    stages.line(f"-ngl {args.n_gpu_layers}: ignored, every layer runs on {where}")

  chat = args.chat or args.interactive
  system = [{"role": "system", "content": args.system}] if args.system else []
  try:
    all_ids = [tok.encode(tok.apply_chat_template(system + [{"role": "user", "content": t}]) if chat else t)
               for t in texts]
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  max_tokens = args.max_tokens or (1024 if args.interactive else 64)
  longest = max((len(i) for i in all_ids), default=1)
  max_context = args.max_context or (min(CHAT_CONTEXT, config.context_length) if args.interactive else
                                     _default_context(longest, max_tokens, config.context_length))
  if max_context > config.context_length:
    if not args.allow_long_context:
      raise SystemExit(f"error: --max-context {max_context} is longer than the {config.context_length} tokens "
                       f"the model was trained for; use at most {config.context_length}, or add "
                       "--allow-long-context to run anyway")
    print(f"[jaxllm] warning: context {max_context} is longer than the model's trained {config.context_length}",
          file=sys.stderr)
  params = _settle(params, args.repeat_last_n, max_context, config.vocab_size)
  grammar = _grammar(args, tok, config.vocab_size)
  try:
    engine = Engine(config, weights, tok, max_context=max_context, kernels=args.kernels,
                    graphs_on=False if args.no_graphs else None,
                    cache_executables=not args.no_compile_cache and executables.compile_cache_enabled(),
                    tokens_per_call=args.tokens_per_call, mesh=make_mesh(args.tp) if args.tp != 1 else None)
    for ids in all_ids:
      engine.check_prompt(ids)
    check_fits(config, max(1, len(all_ids)), max_context, engine.cache_dtype)   # every prompt's row at once
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None

  with stages.stage("compile and warm up") as info:
    engine.warmup(longest, params, batch=max(1, len(all_ids)), trial=True, masked=grammar is not None)
    info["line"] = compile_line(engine.built, engine.cache_executables, engine.tune_seconds,
                                "steps compiled over several devices are not kept" if engine.tp is not None else
                                "the compile cache is off")
  greedy = greedy_mode(params)
  graph_state = graphs.graph_state(engine, greedy) if args.show_graph_state else None
  if graph_state is not None:
    print("[jaxllm] graph state: " + json.dumps(graph_state), file=sys.stderr)
  run = _Run(args, engine, params, model, max_tokens, max_context, stages, graph_state, t_start, grammar)
  if args.interactive:
    return run.interactive(system)
  if len(all_ids) > 1:
    return run.batch(all_ids)
  return run.single(all_ids[0])


class _Run:
  """What main() has set up: the engine and the settings, and how each mode reports."""

  def __init__(self, args, engine, params, model, max_tokens, max_context, stages, graph_state, t_start, grammar):
    self.args, self.engine, self.params, self.model = args, engine, params, model
    self.max_tokens, self.max_context, self.stages, self.graph_state = max_tokens, max_context, stages, graph_state
    self.t_start, self.grammar = t_start, grammar

  def _constraint(self):
    """A fresh matcher of the grammar (--json-schema) for one answer, or None."""
    return None if self.grammar is None else self.grammar.constraint()

  def _read_turn(self, on_terminal: bool) -> str:
    """One line of the chat. The prompt `> ` is shown only on a terminal, on stderr with --json (stdout
    holds only JSON lines); off a terminal nothing is echoed, so each answer starts on its own line."""
    if not on_terminal:
      return input()
    if self.args.json:
      sys.stderr.write("> ")
      sys.stderr.flush()
      return input()
    return input("> ")

  @staticmethod
  def show(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()

  def _summary(self, prompt_len: int, result) -> str:
    e = self.engine
    reused = f", {result.reused_tokens} reused" if result.reused_tokens else ""
    return (f"[jaxllm] {self.model} quant={self.args.quant} kernels={e.kernels} graphs={_graphs_word(e)} | "
            f"prompt {prompt_len} tok{reused}, {len(result.ids)} new ({result.finish_reason}) | "
            f"TTFT {result.ttft_ms:.1f} ms, TPOT {result.tpot_ms:.2f} ms, decode {result.tok_per_s:.1f} tok/s | "
            f"seed {self.args.seed}")

  def _record(self) -> dict:
    import resource
    e = self.engine
    return {"model": self.model, "seed": self.args.seed, "quant": self.args.quant, "kernels": e.kernels, "graphs": e.graphs_active,
            "graphs_fallback": e.graphs_fallback, "graph_state": self.graph_state, "max_context": self.max_context,
            "stage_s": self.stages.times, "compile_s": self.stages.times.get("compile and warm up", 0.0),
            "load_s": sum(v for k, v in self.stages.times.items() if k != "compile and warm up"),
            "startup_s": time.perf_counter() - self.t_start,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

  def _generate(self, ids, on_text=None, reuse=False):
    a = self.args
    return self.engine.generate(ids, self.max_tokens, self.params, seed=a.seed, stop=a.stop, ignore_eos=a.ignore_eos,
                                pipelined=a.loop == "pipelined", on_text=on_text, reuse_cache=reuse,
                                constraint=self._constraint())

  def single(self, prompt_ids) -> int:
    a = self.args
    result = self._generate(prompt_ids, on_text=None if a.json else self.show)
    if result.finish_reason == "error":
      print(f"\n[jaxllm] error: {result.error}", file=sys.stderr)
    if a.json:
      print(json.dumps({**result.to_json(), **self._record()}, ensure_ascii=False))
    else:
      print()
      if a.show_tokens:
        print(f"prompt ids: {result.prompt_ids}")
        print(f"new ids:    {result.ids}")
    if not a.quiet:
      print(self._summary(len(prompt_ids), result), file=sys.stderr)
    return 1 if result.finish_reason == "error" else 0

  def batch(self, all_ids) -> int:
    """Several prompts generated together; each one's text printed once it is done."""
    a, e = self.args, self.engine
    constraints = None if self.grammar is None else [self._constraint() for _ in all_ids]
    results = e.generate_batch(all_ids, self.max_tokens, self.params, seed=a.seed, stop=a.stop,
                               ignore_eos=a.ignore_eos, pipelined=a.loop == "pipelined", constraints=constraints)
    total = sum(len(r.ids) for r in results)
    span_ms = max(r.token_times_ms[-1] for r in results if r.token_times_ms) - \
        min(r.token_times_ms[0] for r in results if r.token_times_ms)
    rate = total / span_ms * 1e3 if span_ms > 0 else 0.0
    if a.json:
      print(json.dumps({"results": [r.to_json() for r in results], **self._record(), "total_tok_per_s": rate},
                       ensure_ascii=False))
    else:
      for b, r in enumerate(results):
        print(f"--- [{b}] ({len(r.ids)} tokens, {r.finish_reason})")
        print(r.text)
        if a.show_tokens:
          print(f"prompt ids: {r.prompt_ids}\nnew ids:    {r.ids}")
    if not a.quiet:
      print(f"[jaxllm] {self.model} batch {len(results)} kernels={e.kernels} graphs={_graphs_word(e)}"
            f" | {total} new tokens, {rate:.1f} tok/s in total | seed {a.seed}", file=sys.stderr)
    return 0

  def _fit(self, system: list[dict], turn: list[dict]) -> tuple[list[dict], list[int], int]:
    """The turn's messages and prompt ids, the oldest messages dropped (a question and its answer at a time;
    the system prompt and the new question kept) until the prompt leaves room for an answer of
    min(max tokens, half the context); and how many messages were dropped."""
    tok = self.engine.tokenizer
    room = min(self.max_tokens, self.max_context // 2)
    dropped = 0
    while True:
      ids = tok.encode(tok.apply_chat_template(system + turn))
      if len(ids) + room <= self.max_context or len(turn) <= 1:
        return turn, ids, dropped
      turn, dropped = turn[2:], dropped + 2

  def interactive(self, system: list[dict]) -> int:
    """A multi-turn chat: each turn's prompt is the whole history in the chat template, and the engine
    reuses the KV cache of what the previous turns already ran."""
    a, tok = self.args, self.engine.tokenizer
    history: list[dict] = []
    self.stages.line(f"chat with {self.model}: /exit to leave, /reset to start over, Ctrl-C stops an answer")
    on_terminal = sys.stdin.isatty()
    while True:
      try:
        line = self._read_turn(on_terminal)
      except EOFError:
        if on_terminal:
          print(file=sys.stderr)
        return 0
      except KeyboardInterrupt:
        if on_terminal:
          print(file=sys.stderr)   # off the prompt's line; main() prints `interrupted`
        raise
      if line.strip() in ("/exit", "/quit"):
        return 0
      if line.strip() == "/reset":
        history = []
        continue
      if not line.strip():
        continue
      turn = history + [{"role": "user", "content": line}]
      try:
        turn, ids, dropped = self._fit(system, turn)
        self.engine.check_prompt(ids)
      except ValueError as e:
        print(f"[jaxllm] error: {e} (/reset starts a new chat)", file=sys.stderr)
        continue
      if dropped:
        print(f"[jaxllm] context full ({self.max_context} tokens): dropped the oldest {dropped} messages "
              f"(the system prompt kept), {len(ids)} tokens left", file=sys.stderr)
      pieces: list[str] = []

      def collect(piece: str) -> None:
        pieces.append(piece)
        if not a.json:
          self.show(piece)
      try:
        result = self._generate(ids, on_text=collect, reuse=True)
        answer = result.text
      except KeyboardInterrupt:
        result, answer = None, "".join(pieces)
        print("\n[jaxllm] (stopped)", file=sys.stderr)
      except RuntimeError as e:
        if not out_of_memory(e):
          raise
        # The turn is lost, not the chat: the engine makes a new cache on the next turn (the old one went with the
        # failed call), and the history stays as it was before this question.
        print(f"\n[jaxllm] error: {explain(e)} (the chat goes on: ask again, or /reset)", file=sys.stderr)
        continue
      history = turn + [{"role": "assistant", "content": answer}]
      if result is None:
        continue
      if a.json:
        print(json.dumps({**result.to_json(), **self._record()}, ensure_ascii=False), flush=True)
      else:
        print()
      if not a.quiet:
        print(self._summary(len(ids), result), file=sys.stderr)


def _graphs_word(engine) -> str:
  """What the summary line says about CUDA graphs: true on this backend."""
  import jax
  if jax.default_backend() != "gpu":
    return f"n/a ({jax.default_backend()})"
  return "on" if engine.graphs_active else "off"


if __name__ == "__main__":
  sys.exit(main())
