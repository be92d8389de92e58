"""Command line: python -m jaxllm.generate [MODEL] (--prompt TEXT | -f FILE | -i) [options].

MODEL is a .gguf path or a demo-model name (default smollm2-135m). Text streams to stdout as it is
generated; one line per start-up stage and a closing line with TTFT, TPOT and decode tok/s go to stderr
(-q keeps them quiet). -i starts an interactive chat that keeps the KV cache of earlier turns. The first
run of a model converts it and caches the conversion and the compiled steps; later runs start in seconds.
llama.cpp's common flags (-s, -t, -e, -r, -cnv, -ngl, --n-predict, --repeat-last-n) are taken as it takes
them, or refused with the reason. Ctrl-C ends a run with `interrupted` and exit status 130.
See docs/usage.md.
"""
# This module holds the CLI's options (build_parser, whose --help shows the text above) and their defaults;
# jaxllm.generate runs them.
from __future__ import annotations

import argparse

from jaxllm.kernels import KERNEL_CHOICES
from jaxllm.models import DEFAULT_MODEL, DEMO_MODELS
from jaxllm.weights import QUANT_CHOICES

CONTEXT_ROUND = 256
CHAT_CONTEXT = 4096     # default context of an interactive chat (capped at the model's)
# jaxllm.sampling's REPEAT_LAST_N and MAX_REPEAT_LAST_N (the device sampler's window; sampling imports jax)
REPEAT_LAST_N, MAX_REPEAT_LAST_N = 64, 4096
MAX_TOP_K = 128         # jaxllm.sampling.MAX_TOP_K: a larger --top-k runs the step that sorts the vocabulary
INTERRUPTED = 130       # exit status after Ctrl-C (128 + SIGINT), as shells report it
VERSION = "0.1.0"


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jaxllm.generate", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
  p.add_argument("model_pos", nargs="?", metavar="MODEL", help=f"a .gguf path or one of {sorted(DEMO_MODELS)}")
  p.add_argument("--model", "-m", help="same as MODEL")
  p.add_argument("--prompt", "-p", action="append", default=[],
                 help="the prompt text; repeat for a batch generated together")
  p.add_argument("--file", "-f", help="read one prompt from this file (UTF-8); - reads standard input")
  p.add_argument("--prompts-file", help="a file with one prompt per line (added to --prompt)")
  p.add_argument("--interactive", "-i", "--conversation", "-cnv", dest="interactive", action="store_true",
                 help="chat: read turns from the terminal or standard input (/exit to leave, /reset to forget, "
                      "Ctrl-C stops an answer, Ctrl-C at the prompt exits)")
  p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
  p.add_argument("--system", help="system message for --chat and -i (else the template's default)")
  p.add_argument("--chat-template", "--chat-template-file", metavar="FILE|TEXT",
                 help="for --chat and -i, render chats with this template instead of the model's: a jinja2 file, a "
                      "Hugging Face tokenizer_config.json or chat_template.json (its \"chat_template\"), or the "
                      "template text itself")
  p.add_argument("--max-tokens", "--n-predict", "-n", dest="max_tokens", type=int, default=None,
                 help="new tokens at most (default 64; -i: until the end of the answer or 1024)")
  p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-generation tokens")
  p.add_argument("--temperature", "--temp", type=float, default=0.0, help="0 = greedy (default)")
  p.add_argument("--top-k", type=int, default=0,
                 help=f"keep the K most likely tokens; 0 = off, as are K < 0 and K >= the vocabulary (llama.cpp's "
                      f"rule); above {MAX_TOP_K} a step that sorts the vocabulary draws, exactly, at some cost")
  p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
  p.add_argument("--min-p", type=float, default=0.0, help="0 = off: drop tokens below min_p x the best one's probability")
  p.add_argument("--repeat-penalty", type=float, default=1.0,
                 help="1 = off: divide (or, if negative, multiply) the logits of the last N tokens (--repeat-last-n)")
  p.add_argument("--repeat-last-n", type=int, default=REPEAT_LAST_N, metavar="N",
                 help=f"tokens the penalties look at (default {REPEAT_LAST_N}), at most {MAX_REPEAT_LAST_N} (the "
                      f"device sampler's window); 0 = penalties off; -1 = the whole context, for a context of at "
                      f"most {MAX_REPEAT_LAST_N}")
  p.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted once from tokens in the last N")
  p.add_argument("--frequency-penalty", type=float, default=0.0, help="subtracted per occurrence in the last N")
  p.add_argument("--seed", "-s", type=int, default=-1,
                 help="sampling seed in [0, 2^63); -1 (default) = a random one, printed in the summary and in "
                      "--json so the run can be replayed with --seed N")
  p.add_argument("--stop", "--reverse-prompt", "-r", dest="stop", action="append", default=[],
                 help="stop string (repeatable); the text is cut before it")
  p.add_argument("--escape", "-e", action="store_true",
                 help="process the escapes \\n, \\t and \\\\ in the prompt and stop strings (as llama.cpp's -e)")
  p.add_argument("--threads", "-t", type=int, default=None, metavar="N",
                 help="threads the CPU kernels run on (JAXLLM_CPU_THREADS; default: the CPUs this process may use); "
                      "applies to the CPU only")
  p.add_argument("--n-gpu-layers", "--gpu-layers", "-ngl", dest="n_gpu_layers", type=int, default=None, metavar="N",
                 help="accepted for llama.cpp's sake: every layer runs on the GPU (on the CPU where there is none)")
  p.add_argument("--quant", choices=QUANT_CHOICES, default="auto",
                 help="auto = gguf on the CPU, w8a16 on the GPU; gguf = the file's own Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q6_K "
                      "blocks, layer by layer, W8A16 for other types; w8a16 = int8 re-quantized; none = float (reference)")
  p.add_argument("--tp", type=int, default=1, metavar="N",
                 help="tensor parallel over the first N devices (jaxllm.parallel; W8A16 or float weights)")
  p.add_argument("--kernels", choices=KERNEL_CHOICES, default="auto",
                 help="ffi = jaxllm's kernels with the fused decode step, ffi-unfused = without it, "
                      "xla = pure jnp, auto = ffi where built")
  p.add_argument("--max-context", "--ctx-size", "-c", dest="max_context", type=int, default=None,
                 help=f"KV cache length (default: prompt + max tokens rounded up to {CONTEXT_ROUND}; -i: "
                      f"{CHAT_CONTEXT}; at most the model's trained context)")
  p.add_argument("--allow-long-context", action="store_true",
                 help="allow a context longer than the model was trained for (it may not cope)")
  p.add_argument("--no-graphs", action="store_true", help="turn CUDA graphs (XLA command buffers) off")
  p.add_argument("--show-graph-state", action="store_true",
                 help="report whether the decode step compiled into CUDA graphs and their coverage (from XLA's dump)")
  p.add_argument("--loop", choices=("pipelined", "streaming"), default="pipelined",
                 help="pipelined dispatches step i+1 before reading token i; streaming waits for each")
  p.add_argument("--tokens-per-call", type=int, default=None, metavar="K",
                 help="decode steps per executable call: the host dispatches and reads once per K tokens, "
                      "which arrive together (default 8)")
  p.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid under the JSON schema in FILE "
                 "(each token drawn under the grammar's mask, by llguidance; docs/server.md)")
  p.add_argument("--json-object", action="store_true", help="the output is a JSON object (any)")
  p.add_argument("--show-tokens", action="store_true", help="print token ids as well as text")
  p.add_argument("--json", action="store_true", help="print one JSON object at the end (-i: one per turn) instead of text")
  p.add_argument("--quiet", "-q", action="store_true", help="no start-up lines or summary on stderr")
  p.add_argument("--no-cache", action="store_true", help="convert the model again and do not cache the conversion")
  p.add_argument("--no-compile-cache", action="store_true",
                 help="do not keep compiled steps on disk (same as JAXLLM_COMPILE_CACHE=0)")
  p.add_argument("--clear-cache", action="store_true",
                 help="remove cached conversions, compiled steps and kernel tuning (downloaded models stay), then exit")
  p.add_argument("--version", action="version", version=f"jaxllm {VERSION}")
  return p


def read_chat_template(value: str | None) -> tuple[str | None, str | None]:
  """--chat-template's (generate's and serve's) template and its origin (chat_template.read_template), or
  (None, None) without one; what cannot be read is a one-line error."""
  if not value:
    return None, None
  from jaxllm.chat_template import read_template
  try:
    return read_template(value)
  except ValueError as e:
    raise SystemExit(f"error: --chat-template: {e}") from None
