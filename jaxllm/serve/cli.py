"""Command line: python -m jaxllm.serve [MODEL] [--host H] [--port P] [--max-batch N] [--max-context S] ...

Starts the HTTP server at once (GET /health answers 503 while the model loads and the programs compile,
200 once it serves), then loads MODEL (a .gguf path or a demo-model name, as `generate` takes it) with the
same quantization, kernel and graph options, and serves the OpenAI API on it (docs/server.md). SIGINT or
SIGTERM stops taking requests, lets the requests in flight run for --shutdown-timeout seconds, then ends the
rest (a stream with its error event and [DONE], another request with 503) and exits.
"""
from __future__ import annotations

import argparse
import os
import sys

from jaxllm.cli_options import read_chat_template
from jaxllm.kernels import KERNEL_CHOICES
from jaxllm.models import DEFAULT_MODEL, DEMO_MODELS
from jaxllm.sampling import MAX_TOP_K
from jaxllm.weights import QUANT_CHOICES, resolve_quant

DEFAULT_CONTEXT = 4096    # per slot, capped at the model's trained context


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jaxllm.serve", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
  p.add_argument("model_pos", nargs="?", metavar="MODEL", help=f"a .gguf path or one of {sorted(DEMO_MODELS)}")
  p.add_argument("--model", "-m", help="same as MODEL")
  p.add_argument("--served-model-name", help="the model's name in the API (default: the demo name or file stem)")
  p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
  p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
  p.add_argument("--api-key", default=os.environ.get("JAXLLM_API_KEY") or None, metavar="KEY",
                 help="require 'Authorization: Bearer KEY' of every request but /health and /metrics (default: "
                      "$JAXLLM_API_KEY, which keeps the key out of the process list; unset: no key)")
  p.add_argument("--allowed-origin", dest="allowed_origins", action="append", default=[], metavar="ORIGIN",
                 help="a web origin (https://chat.example.com; * for any) whose pages may call the API from a browser "
                      "(CORS); repeatable; default none")
  p.add_argument("--max-batch", "--parallel", "-np", dest="max_batch", type=int, default=4, metavar="N",
                 help="slots: requests decoded together in one batched KV cache (default 4)")
  p.add_argument("--admit-group", type=int, default=None, metavar="R",
                 help="prompts whose last prefill chunks one call runs at most (rounded down to a power of two; "
                      "default 4; each size is a program compiled at start-up)")
  p.add_argument("--max-context", "--ctx-size", "-c", dest="max_context", type=int, default=None, metavar="S",
                 help=f"tokens per slot, prompt and answer (default {DEFAULT_CONTEXT}, at most the model's)")
  p.add_argument("--max-waiting", type=int, default=64, metavar="N",
                 help="requests queued for a slot before new ones get 503 (default 64)")
  p.add_argument("--chat-template", "--chat-template-file", metavar="FILE|TEXT",
                 help="render chats with this template instead of the model's: a jinja2 file, a Hugging Face "
                      "tokenizer_config.json or chat_template.json (its \"chat_template\"), or the template text")
  p.add_argument("--wide-top-k", action="store_true",
                 help=f"take top_k above {MAX_TOP_K} (compiles the sampler's wide step too: a longer start; a batch "
                      "with such a request sorts the vocabulary each step)")
  p.add_argument("--no-prefix-reuse", action="store_true",
                 help="prefill every prompt whole, even when a free slot holds its start")
  p.add_argument("--quant", choices=QUANT_CHOICES, default="auto", help="as in generate")
  p.add_argument("--kernels", choices=KERNEL_CHOICES, default="auto", help="as in generate")
  p.add_argument("--tp", type=int, default=1, metavar="N", help="tensor parallel over the first N devices, as in generate")
  p.add_argument("--no-graphs", action="store_true", help="turn CUDA graphs (XLA command buffers) off")
  p.add_argument("--prefill-chunk", type=int, default=None, metavar="C",
                 help="prompt tokens per prefill chunk (default 512 on the CPU, 4096 on the GPU)")
  p.add_argument("--tokens-per-call", type=int, default=None, metavar="K",
                 help="decode steps per executable call (default 8)")
  p.add_argument("--threads", "-t", type=int, default=None, metavar="N", help="CPU kernel threads (CPU only)")
  p.add_argument("--no-cache", action="store_true", help="convert the model again and do not cache the conversion")
  p.add_argument("--no-compile-cache", action="store_true", help="compile every program (no disk cache)")
  p.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                 help="on SIGINT/SIGTERM, how long requests in flight may run before they are cancelled")
  p.add_argument("--quiet", "-q", action="store_true", help="no start-up lines on stderr")
  return p


def _check(args) -> None:
  if args.api_key is not None and not (args.api_key.strip() and args.api_key.isascii() and args.api_key.isprintable()
                                       and " " not in args.api_key):
    raise SystemExit("error: --api-key (or JAXLLM_API_KEY) must be printable ASCII without spaces, and not empty")
  for name, low in (("max_batch", 1), ("max_waiting", 0), ("port", 0)):
    if getattr(args, name) < low:
      raise SystemExit(f"error: --{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
  if args.admit_group is not None and args.admit_group < 1:
    raise SystemExit(f"error: --admit-group must be >= 1, got {args.admit_group}")
  if args.max_context is not None and args.max_context < 2:
    raise SystemExit(f"error: --max-context must be >= 2, got {args.max_context}")


def make_loader(args, model: str):
  """The function that loads the model and starts the scheduler (run on a thread while /health says 503). The
  device out of memory comes out of it as a DeviceMemoryError (jaxllm.device_memory), whose one line the server
  prints and /health reports."""
  def load():
    from jaxllm.device_memory import explain, out_of_memory
    try:
      return load_and_start()
    except RuntimeError as e:
      if not out_of_memory(e):
        raise
      raise explain(e) from None

  def load_and_start():
    from jaxllm import executables
    from jaxllm.engine import Engine
    from jaxllm.load import load as load_model
    from jaxllm.parallel import make_mesh
    from jaxllm.progress import Stages, tune_note
    from jaxllm.serve.scheduler import Scheduler
    stages = Stages(quiet=args.quiet)
    config, weights, tok = load_model(model, quant=resolve_quant(args.quant, tensor_parallel=args.tp != 1),
                                      progress=stages, cache=not args.no_cache)
    if args.template is not None:
      try:
        tok.set_chat_template(args.template, origin=args.template_origin)
      except ValueError as e:          # a load error: on stderr, and the server exits 1
        raise ValueError(f"--chat-template: {e}") from None
    context = args.max_context or min(DEFAULT_CONTEXT, config.context_length)
    if context > config.context_length:
      raise ValueError(f"--max-context {context} is longer than the {config.context_length} tokens the model "
                       "was trained for")
    engine = Engine(config, weights, tok, max_context=context, kernels=args.kernels,
                    graphs_on=False if args.no_graphs else None, prefill_chunk=args.prefill_chunk,
                    cache_executables=not args.no_compile_cache and executables.compile_cache_enabled(),
                    tokens_per_call=args.tokens_per_call, mesh=make_mesh(args.tp) if args.tp != 1 else None)
    with stages.stage(f"compile {args.max_batch} slots") as info:
      scheduler = Scheduler(engine, slots=args.max_batch, max_waiting=args.max_waiting,
                            prefix_reuse=not args.no_prefix_reuse, wide_top_k=args.wide_top_k,
                            admit_group=args.admit_group)
      scheduler.start()
      info["note"] = tune_note(engine.tune_seconds).strip(" ()")
    scheduler.metrics.ready()
    if not args.quiet:
      print(f"[jaxllm] serving {model} on http://{args.host}:{args.port} ({args.max_batch} slots of {context} "
            "tokens)", file=sys.stderr, flush=True)
    return scheduler
  return load


def served_name(model: str) -> str:
  return model if model in DEMO_MODELS else os.path.splitext(os.path.basename(model))[0]


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  _check(args)
  if args.threads is not None:
    os.environ["JAXLLM_CPU_THREADS"] = str(args.threads)
  model = args.model or args.model_pos or DEFAULT_MODEL
  if model not in DEMO_MODELS and not os.path.exists(model):
    raise SystemExit(f"error: {model!r} is neither a file nor one of {sorted(DEMO_MODELS)}")
  args.template, args.template_origin = read_chat_template(args.chat_template)
  import uvicorn
  from jaxllm.serve.app import ServerState, create_app
  state = ServerState(args.served_model_name or served_name(model))
  load, servers = make_loader(args, model), []

  def loader():
    try:
      return load()
    except BaseException:
      servers[0].should_exit = True     # a server without a model is of no use: exit with status 1
      raise
  app = create_app(state, loader, api_key=args.api_key, allowed_origins=args.allowed_origins)
  config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                          timeout_graceful_shutdown=args.shutdown_timeout, access_log=False)
  servers.append(_server_class(uvicorn)(config, state))
  server = servers[0]
  try:
    server.run()
  except KeyboardInterrupt:
    return 130
  return 0 if state.load_error is None and server.started else 1


def _server_class(uvicorn):
  """uvicorn's Server, whose shutdown ends the requests still in flight through the scheduler just before
  --shutdown-timeout runs out: each stream then gets its error event ("the server is shutting down") and
  [DONE], each other request its 503, instead of uvicorn cancelling their tasks mid-response (a stream cut
  without an end, and a traceback on stderr)."""
  import asyncio

  import anyio

  class Server(uvicorn.Server):
    def __init__(self, config, state):
      super().__init__(config)
      self.app_state = state

    async def shutdown(self, sockets=None) -> None:
      grace, scheduler = self.config.timeout_graceful_shutdown, self.app_state.scheduler
      ender = None
      if grace is not None and scheduler is not None:
        async def end_in_flight():
          await asyncio.sleep(max(0.0, grace - min(1.0, 0.2 * grace)))   # room left for the last events
          await anyio.to_thread.run_sync(scheduler.stop)
        ender = asyncio.ensure_future(end_in_flight())
      try:
        await super().shutdown(sockets)
      finally:
        if ender is not None:
          ender.cancel()
  return Server
