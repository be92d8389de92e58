"""Command line: python -m jaxllm.generate [MODEL] --prompt TEXT [options].

MODEL is a .gguf path or a demo-model name (default smollm2-135m). Text streams to stdout as it is
generated; a closing line with TTFT, TPOT and decode tok/s goes to stderr. See docs/usage.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from jaxllm.kernels import KERNEL_CHOICES
from jaxllm.models import DEFAULT_MODEL, DEMO_MODELS
from jaxllm.weights import QUANT_CHOICES

CONTEXT_ROUND = 256


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jaxllm.generate", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("model_pos", nargs="?", metavar="MODEL", help=f"a .gguf path or one of {sorted(DEMO_MODELS)}")
  p.add_argument("--model", "-m", help="same as MODEL")
  p.add_argument("--prompt", "-p", action="append", default=[],
                 help="the prompt text; repeat for a batch generated together")
  p.add_argument("--prompts-file", help="a file with one prompt per line (added to --prompt)")
  p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
  p.add_argument("--system", help="system message for --chat (else the template's default)")
  p.add_argument("--max-tokens", "-n", type=int, default=64, help="new tokens at most (default 64)")
  p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-generation tokens")
  p.add_argument("--temperature", "--temp", type=float, default=0.0, help="0 = greedy (default)")
  p.add_argument("--top-k", type=int, default=0, help="0 = off (at most 128)")
  p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
  p.add_argument("--min-p", type=float, default=0.0, help="0 = off: drop tokens below min_p x the best one's probability")
  p.add_argument("--repeat-penalty", type=float, default=1.0,
                 help="1 = off: divide (or, if negative, multiply) the logits of the last 64 tokens")
  p.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted once from tokens in the last 64")
  p.add_argument("--frequency-penalty", type=float, default=0.0, help="subtracted per occurrence in the last 64")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
  p.add_argument("--quant", choices=QUANT_CHOICES, default="w8a16", help="none = float weights (reference)")
  p.add_argument("--kernels", choices=KERNEL_CHOICES, default="auto",
                 help="ffi = jaxllm's kernels, xla = pure jnp, auto = ffi where built")
  p.add_argument("--max-context", type=int, default=None,
                 help=f"KV cache length (default: prompt + max tokens rounded up to {CONTEXT_ROUND})")
  p.add_argument("--no-graphs", action="store_true", help="turn CUDA graphs (XLA command buffers) off")
  p.add_argument("--show-graph-state", action="store_true",
                 help="report whether the decode step compiled into CUDA graphs and their coverage (from XLA's dump)")
  p.add_argument("--loop", choices=("pipelined", "streaming"), default="pipelined",
                 help="pipelined dispatches step i+1 before reading token i; streaming waits for each")
  p.add_argument("--show-tokens", action="store_true", help="print token ids as well as text")
  p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of text")
  return p


def _default_context(prompt_len: int, max_tokens: int, model_ctx: int) -> int:
  want = -(-(prompt_len + max_tokens) // CONTEXT_ROUND) * CONTEXT_ROUND
  return max(min(want, model_ctx), prompt_len + 1)


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  model = args.model or args.model_pos or DEFAULT_MODEL
  if args.model and args.model_pos and args.model != args.model_pos:
    raise SystemExit(f"error: model given twice ({args.model_pos!r} and --model {args.model!r})")
  if args.max_tokens < 1:
    raise SystemExit(f"error: --max-tokens must be >= 1, got {args.max_tokens}")
  if not 0 <= args.seed < 2 ** 63:
    raise SystemExit(f"error: --seed must be in [0, 2^63), got {args.seed}")
  if args.system and not args.chat:
    raise SystemExit("error: --system needs --chat")
  texts = list(args.prompt)
  if args.prompts_file:
    try:
      with open(args.prompts_file, encoding="utf-8") as f:
        texts += [line.rstrip("\n") for line in f if line.strip()]
    except OSError as e:
      raise SystemExit(f"error: cannot read --prompts-file: {e}") from None
  if not texts:
    raise SystemExit("error: give a prompt (--prompt TEXT, repeatable, or --prompts-file FILE)")

  from jaxllm.sampling import SamplingParams  # imports jax: after argument errors
  try:
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            repeat_penalty=args.repeat_penalty, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty)
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None

  from jaxllm.engine import Engine
  from jaxllm.load import load
  try:
    config, weights, tok = load(model, quant=args.quant)
  except (ValueError, FileNotFoundError, RuntimeError) as e:
    raise SystemExit(f"error: {e}") from None

  def render(text: str) -> str:
    if not args.chat:
      return text
    system = [{"role": "system", "content": args.system}] if args.system else []
    return tok.apply_chat_template(system + [{"role": "user", "content": text}])

  all_ids = [tok.encode(render(t)) for t in texts]
  prompt_ids = max(all_ids, key=len)
  max_context = args.max_context or _default_context(len(prompt_ids), args.max_tokens, config.context_length)
  try:
    engine = Engine(config, weights, tok, max_context=max_context, kernels=args.kernels,
                    graphs_on=False if args.no_graphs else None)
    for ids in all_ids:
      engine.check_prompt(ids)
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None

  t0 = time.perf_counter()
  engine.warmup(len(prompt_ids), params, batch=len(all_ids))
  compile_s = time.perf_counter() - t0
  graph_state = engine.graph_state(params.greedy) if args.show_graph_state else None
  if graph_state is not None:
    print("[jaxllm] graph state: " + json.dumps(graph_state), file=sys.stderr)

  def show(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()

  if len(all_ids) > 1:
    return _main_batch(args, engine, all_ids, params, model, max_context, compile_s, graph_state)
  prompt_ids = all_ids[0]
  result = engine.generate(prompt_ids, args.max_tokens, params, seed=args.seed, stop=args.stop,
                           ignore_eos=args.ignore_eos, pipelined=args.loop == "pipelined",
                           on_text=None if args.json else show)
  summary = (f"[jaxllm] {model} quant={args.quant} kernels={engine.kernels} graphs={_graphs_word(engine)} | "
             f"prompt {len(prompt_ids)} tok, "
             f"{len(result.ids)} new ({result.finish_reason}) | TTFT {result.ttft_ms:.1f} ms, "
             f"TPOT {result.tpot_ms:.2f} ms, decode {result.tok_per_s:.1f} tok/s | compile {compile_s:.1f} s")
  if args.json:
    out = result.to_json()
    out.update(model=model, quant=args.quant, kernels=engine.kernels, graphs=engine.graphs_active,
               graphs_fallback=engine.graphs_fallback, graph_state=graph_state, max_context=max_context,
               compile_s=compile_s)
    print(json.dumps(out, ensure_ascii=False))
  else:
    print()
    if args.show_tokens:
      print(f"prompt ids: {result.prompt_ids}")
      print(f"new ids:    {result.ids}")
  print(summary, file=sys.stderr)
  return 0


def _graphs_word(engine) -> str:
  """What the summary line says about CUDA graphs: true on this backend."""
  import jax
  if jax.default_backend() != "gpu":
    return f"n/a ({jax.default_backend()})"
  return "on" if engine.graphs_active else "off"


def _main_batch(args, engine, all_ids, params, model, max_context, compile_s, graph_state) -> int:
  """Several prompts generated together; each one's text printed once it is done."""
  results = engine.generate_batch(all_ids, args.max_tokens, params, seed=args.seed, stop=args.stop,
                                  ignore_eos=args.ignore_eos, pipelined=args.loop == "pipelined")
  total = sum(len(r.ids) for r in results)
  span_ms = max(r.token_times_ms[-1] for r in results if r.token_times_ms) - \
      min(r.token_times_ms[0] for r in results if r.token_times_ms)
  if args.json:
    print(json.dumps({"results": [r.to_json() for r in results], "model": model, "quant": args.quant,
                      "kernels": engine.kernels, "graphs": engine.graphs_active, "graph_state": graph_state,
                      "max_context": max_context, "compile_s": compile_s,
                      "total_tok_per_s": total / span_ms * 1e3 if span_ms > 0 else 0.0}, ensure_ascii=False))
  else:
    for b, r in enumerate(results):
      print(f"--- [{b}] ({len(r.ids)} tokens, {r.finish_reason})")
      print(r.text)
      if args.show_tokens:
        print(f"prompt ids: {r.prompt_ids}\nnew ids:    {r.ids}")
  print(f"[jaxllm] {model} batch {len(results)} kernels={engine.kernels} graphs={_graphs_word(engine)}"
        f" | {total} new tokens, {total / span_ms * 1e3 if span_ms > 0 else 0.0:.1f} tok/s in total"
        f" | compile {compile_s:.1f} s", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
