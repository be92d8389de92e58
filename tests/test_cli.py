"""The CLI as a llama.cpp user drives it (issue 37): Ctrl-C, scripted and piped use, seeds, llama.cpp's flags."""
import importlib
import io
import json
import os
import pty
import signal
import subprocess
import sys
import time

import pytest

from jaxllm import cli_options
from jaxllm.generate import build_parser, main as cli_main, unescape
from jaxllm.sampling import MAX_REPEAT_LAST_N, MAX_TOP_K, REPEAT_LAST_N
from tiny import write_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def path(tmp_path_factory):
  return str(write_tiny_model(tmp_path_factory.mktemp("cli") / "m.gguf", "qwen2"))


class _Stdin(io.TextIOWrapper):
  """Piped standard input (not a terminal), with the bytes under .buffer as sys.stdin has them."""

  def __init__(self, text: str):
    super().__init__(io.BytesIO(text.encode("utf-8")), encoding="utf-8")

  def isatty(self):
    return False


def _json_lines(out: str) -> list[dict]:
  return [json.loads(line) for line in out.splitlines()]        # every line of stdout is JSON


# Item 1: Ctrl-C -----------------------------------------------------------------------------------

def _spawn(args, stdin=subprocess.DEVNULL):
  """The CLI in a child whose SIGINT is the default, as at a terminal: a suite started as a background job of a
  script inherits SIGINT ignored, and a Python started so keeps ignoring it (no KeyboardInterrupt). A signal
  with a handler is the default after exec, so the parent handles SIGINT while it starts the child."""
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    return subprocess.Popen([sys.executable, "-m", "jaxllm.generate", *args], stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT, env=env)
  finally:
    signal.signal(signal.SIGINT, previous)


def _interrupt_after(proc, marker: bytes, timeout=60.0) -> tuple[int, bytes]:
  """Reads stderr until a line holding `marker`, sends SIGINT, returns (exit status, all of stderr)."""
  err = b""
  deadline = time.monotonic() + timeout
  while marker not in err:
    line = proc.stderr.readline()
    assert line and time.monotonic() < deadline, f"no {marker!r} line: {err!r}"
    err += line
  proc.send_signal(signal.SIGINT)
  _, rest = proc.communicate(timeout=60)
  return proc.returncode, err + rest


def test_ctrl_c_in_a_plain_run_ends_with_one_line_and_130(path):
  proc = _spawn([path, "-p", "hi", "-n", "200", "--ignore-eos", "--kernels", "xla", "--no-compile-cache"])
  rc, err = _interrupt_after(proc, b"[jaxllm] ")           # the first stage line: loading or compiling
  assert rc == 130, err
  assert err.decode().strip().splitlines()[-1] == "interrupted"
  assert b"Traceback" not in err and b"KeyboardInterrupt" not in err


def test_ctrl_c_at_the_chat_prompt_exits_with_130(path):
  """-i on a pseudo-terminal: the chat waits at its prompt; Ctrl-C there ends the run."""
  leader, follower = pty.openpty()
  try:
    proc = _spawn([path, "-i", "-n", "4", "--kernels", "xla"], stdin=follower)
    rc, err = _interrupt_after(proc, b"chat with")
  finally:
    os.close(leader)
    os.close(follower)
  assert rc == 130, err
  assert err.decode().strip().splitlines()[-1] == "interrupted"
  assert b"Traceback" not in err


@pytest.mark.parametrize("stage", [("jaxllm.load", "load"), ("jaxllm.engine", "Engine.warmup"),
                                   ("jaxllm.engine", "Engine.generate")])
def test_ctrl_c_at_each_stage_returns_130(path, capsys, monkeypatch, stage):
  def interrupt(*_, **__):
    raise KeyboardInterrupt
  module, name = stage
  owner = importlib.import_module(module)      # jaxllm.load is also the name of a function in jaxllm
  for part in name.split(".")[:-1]:
    owner = getattr(owner, part)
  monkeypatch.setattr(owner, name.split(".")[-1], interrupt)
  assert cli_main([path, "-p", "hi", "-n", "2", "--kernels", "xla"]) == 130
  err = capsys.readouterr().err
  assert err.splitlines()[-1] == "interrupted" and "Traceback" not in err


def test_ctrl_c_during_a_chat_answer_stops_only_the_answer(path, capsys, monkeypatch):
  """A Ctrl-C inside an answer stops it and the chat goes on to the next turn."""
  from jaxllm.engine import Engine
  real, calls = Engine.generate, []

  def first_interrupted(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 1:
      raise KeyboardInterrupt
    return real(self, *args, **kwargs)
  monkeypatch.setattr(Engine, "generate", first_interrupted)
  monkeypatch.setattr(sys, "stdin", _Stdin("one\ntwo\n"))
  assert cli_main([path, "-i", "-n", "3", "--ignore-eos", "--json", "--kernels", "xla"]) == 0
  captured = capsys.readouterr()
  assert "(stopped)" in captured.err and len(calls) == 2
  assert len(_json_lines(captured.out)) == 1


# Item 2: scripted use -----------------------------------------------------------------------------

def test_piped_chat_with_json_writes_only_json_lines(path, capsys, monkeypatch):
  monkeypatch.setattr(sys, "stdin", _Stdin("Hi\nand again\n/exit\n"))
  assert cli_main([path, "-i", "-n", "3", "--ignore-eos", "--json", "--kernels", "xla"]) == 0
  captured = capsys.readouterr()
  records = _json_lines(captured.out)
  assert len(records) == 2 and all(len(r["ids"]) == 3 for r in records)
  assert records[1]["reused_tokens"] > 0
  assert "> " not in captured.err            # off a terminal nothing is echoed


def test_piped_chat_answers_start_on_their_own_lines(path, capsys, monkeypatch):
  monkeypatch.setattr(sys, "stdin", _Stdin("Hi\nand again\n"))
  assert cli_main([path, "-i", "-n", "3", "--ignore-eos", "--kernels", "xla", "-q"]) == 0
  out = capsys.readouterr().out
  assert not out.startswith(">") and "> " not in out
  assert out.endswith("\n") and out.count("\n") >= 2


def test_file_dash_reads_the_prompt_from_stdin(path, capsys, monkeypatch):
  monkeypatch.setattr(sys, "stdin", _Stdin("the prompt from a pipe"))
  assert cli_main([path, "-f", "-", "-n", "2", "--json", "--kernels", "xla", "-s", "1"]) == 0
  from jaxllm import GGUFFile, Tokenizer
  tok = Tokenizer(GGUFFile(path).metadata)
  (record,) = _json_lines(capsys.readouterr().out)
  assert record["prompt_ids"] == tok.encode("the prompt from a pipe")
  from jaxllm.generate import MAX_TEXT_FILE
  monkeypatch.setattr(sys, "stdin", _Stdin("x" * (MAX_TEXT_FILE + 1)))     # an endless pipe is read up to the bound
  with pytest.raises(SystemExit, match=r"--file - \(standard input\) is longer than \d+ bytes"):
    cli_main([path, "-f", "-"])


# Item 3: seeds ------------------------------------------------------------------------------------

def _sampled(path, capsys, *extra):
  assert cli_main([path, "-p", "once", "-n", "12", "--ignore-eos", "--temp", "1.0", "--json", "--kernels", "xla",
                   *extra]) == 0
  captured = capsys.readouterr()
  (record,) = _json_lines(captured.out)
  return record, captured.err


def test_a_random_seed_per_run_printed_and_replayable(path, capsys):
  first, err = _sampled(path, capsys)
  second, _ = _sampled(path, capsys, "--seed", "-1")
  assert first["seed"] != second["seed"] and 0 <= first["seed"] < 2 ** 63
  assert f"seed {first['seed']}" in err
  replay, _ = _sampled(path, capsys, "-s", str(first["seed"]))
  assert replay["ids"] == first["ids"] and replay["seed"] == first["seed"]


def test_seed_has_help_and_refuses_other_negatives(capsys):
  (seed,) = [a for a in build_parser()._actions if "--seed" in a.option_strings]
  assert "-s" in seed.option_strings and "-1" in seed.help and "random" in seed.help
  with pytest.raises(SystemExit, match=r"-1 \(random\)"):
    cli_main(["m.gguf", "-p", "x", "--seed", "-2"])


# Item 7: llama.cpp's flags ------------------------------------------------------------------------

def test_llama_cpp_flags_parse_as_theirs():
  a = build_parser().parse_args(["m.gguf", "-ngl", "99", "-cnv", "-s", "5", "-t", "2", "-e", "-r", "User:",
                                 "--n-predict", "7", "--temp", "0.5", "--ctx-size", "128", "--repeat-last-n", "64"])
  assert (a.n_gpu_layers, a.interactive, a.seed, a.threads, a.escape) == (99, True, 5, 2, True)
  assert (a.stop, a.max_tokens, a.temperature, a.max_context, a.repeat_last_n) == (["User:"], 7, 0.5, 128, 64)
  b = build_parser().parse_args(["m.gguf", "--conversation", "--reverse-prompt", "x", "--stop", "y", "-n", "3"])
  assert b.interactive and b.stop == ["x", "y"] and b.max_tokens == 3


def test_no_prefix_abbreviations(capsys):
  for flag in ("--tempera", "--max-tok", "--inter"):
    with pytest.raises(SystemExit):
      build_parser().parse_args(["m.gguf", flag, "1"])
  assert "unrecognized arguments" in capsys.readouterr().err


def _spy_params(monkeypatch) -> list:
  """The SamplingParams each Engine.generate call of the CLI gets."""
  from jaxllm.engine import Engine
  seen = []
  real = Engine.generate

  def spy(self, ids, max_tokens, params, *args, **kwargs):
    seen.append(params)
    return real(self, ids, max_tokens, params, *args, **kwargs)
  monkeypatch.setattr(Engine, "generate", spy)
  return seen


def test_repeat_last_n_is_a_window_up_to_the_maximum(path, capsys, monkeypatch, tmp_path):
  """--repeat-last-n N for any N up to the sampler's window reaches the sampler as N (only 64 and 0 were taken
  before); -1 is the whole context where it fits the window; other values are one-line errors."""
  assert (cli_options.REPEAT_LAST_N, cli_options.MAX_REPEAT_LAST_N) == (REPEAT_LAST_N, MAX_REPEAT_LAST_N)
  bad = [(["--repeat-last-n", "-2"], rf"must be in \[0, {MAX_REPEAT_LAST_N}\] .* or -1 \(the whole context\), got -2"),
         (["--repeat-last-n", str(MAX_REPEAT_LAST_N + 1)], rf"must be in \[0, {MAX_REPEAT_LAST_N}\]"),
         (["--repeat-last-n", "-1", "-c", "8192"], rf"-1 \(the whole context\) takes a context of at most "
                                                   rf"{MAX_REPEAT_LAST_N} tokens .* this one holds 8192")]
  for flags, msg in bad:
    with pytest.raises(SystemExit, match=msg) as e:
      cli_main(["m.gguf", "-p", "x", *flags])
    assert "\n" not in str(e.value)
  long = str(write_tiny_model(tmp_path / "long.gguf", "qwen2", context=16384))   # the context known once loaded
  with pytest.raises(SystemExit, match=r"this one holds 5120: give --repeat-last-n 4096 or less") as e:
    cli_main([long, "-p", "x", "-n", "5000", "--repeat-last-n", "-1", "--kernels", "xla"])
  assert "\n" not in str(e.value)
  seen = _spy_params(monkeypatch)
  for flags in (["--repeat-last-n", "7"], ["--repeat-last-n", "-1"], ["--repeat-last-n", "0"], []):
    assert cli_main([path, "-p", "x", "-n", "2", "--repeat-penalty", "1.3", "-c", "96", "--json", "--kernels", "xla",
                     *flags]) == 0
  assert [p.repeat_last_n for p in seen] == [7, 96, 0, REPEAT_LAST_N]
  assert [p.penalized for p in seen] == [True, True, False, True]
  capsys.readouterr()


def test_top_k_up_to_the_vocabulary(path, capsys, monkeypatch):
  """--top-k above the candidates (it was refused above 128) runs the wide step; k <= 0 and k >= the
  vocabulary (262 tokens here) mean no top-k, as in llama.cpp."""
  assert cli_options.MAX_TOP_K == MAX_TOP_K
  seen = _spy_params(monkeypatch)
  for k in ("200", "1000", "-5"):
    assert cli_main([path, "-p", "x", "-n", "3", "--temp", "1", "--top-k", k, "-s", "1", "--json",
                     "--kernels", "xla", "--ignore-eos"]) == 0
  records = _json_lines(capsys.readouterr().out)
  assert [p.top_k for p in seen] == [200, 0, 0] and all(len(r["ids"]) == 3 for r in records)
  assert seen[0].wide_top_k and not seen[1].wide_top_k


def test_escapes_and_reverse_prompt(path, capsys):
  assert unescape(r"a\nb\tc\\n\q") == "a\nb\tc\\n\\q"
  from jaxllm import GGUFFile, Tokenizer
  tok = Tokenizer(GGUFFile(path).metadata)
  assert cli_main([path, "-p", r"one\ntwo", "-e", "-n", "2", "--json", "--kernels", "xla"]) == 0
  (record,) = _json_lines(capsys.readouterr().out)
  assert record["prompt_ids"] == tok.encode("one\ntwo")
  assert cli_main([path, "-p", r"one\ntwo", "-n", "2", "--json", "--kernels", "xla"]) == 0
  (record,) = _json_lines(capsys.readouterr().out)
  assert record["prompt_ids"] == tok.encode(r"one\ntwo")
  full, _ = _sampled(path, capsys, "-s", "3")
  cut = full["text"][2:4]
  if cut:
    stopped, _ = _sampled(path, capsys, "-s", "3", "-r", cut)
    assert stopped["finish_reason"] == "stop" and cut not in stopped["text"]


def test_ngl_note_and_threads_env(path, capsys, monkeypatch):
  monkeypatch.delenv("JAXLLM_CPU_THREADS", raising=False)
  assert cli_main([path, "-p", "x", "-n", "2", "-ngl", "99", "-t", "1", "--kernels", "xla"]) == 0
  assert os.environ["JAXLLM_CPU_THREADS"] == "1"
  assert "-ngl 99: ignored, every layer runs on the" in capsys.readouterr().err
  with pytest.raises(SystemExit, match="--threads must be >= 1"):
    cli_main([path, "-p", "x", "-t", "0"])


def test_chat_full_context_drops_the_oldest_turns(path, capsys, monkeypatch):
  """In -i, a history too long for the context loses its oldest turns (the system prompt stays), the chat
  goes on answering, and stderr says so (it stopped with an error at every later turn before)."""
  from jaxllm.engine import Engine
  prompts = []
  real = Engine.generate

  def spy(self, ids, *args, **kwargs):
    prompts.append(self.tokenizer.decode(ids))
    return real(self, ids, *args, **kwargs)
  monkeypatch.setattr(Engine, "generate", spy)
  turns = [f"turn number {i} with a few more words" for i in range(8)]
  monkeypatch.setattr(sys, "stdin", _Stdin("\n".join(turns) + "\n"))
  assert cli_main([path, "-i", "-c", "96", "-n", "8", "--ignore-eos", "--json", "--kernels", "xla",
                   "--system", "SYSTEM RULES"]) == 0
  captured = capsys.readouterr()
  records = _json_lines(captured.out)
  assert len(records) == len(turns) and all(r["finish_reason"] == "length" for r in records)
  assert "error" not in captured.err and "context full (96 tokens): dropped the oldest" in captured.err
  assert all("SYSTEM RULES" in p for p in prompts) and "turn number 7" in prompts[-1]
  assert "turn number 0" not in prompts[-1]


def test_chat_template_file_replaces_the_models(path, capsys, tmp_path):
  """--chat-template FILE renders the chat (the prompt's ids are its text's); a tokenizer_config.json's template
  too; a broken, missing or FIFO template, or one without --chat, is one line and status 1, before the model
  loads where the file alone shows it."""
  from jaxllm.load import read_model
  _, tok = read_model(path)
  plain = tmp_path / "t.jinja"
  plain.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                   "{% if add_generation_prompt %}<bot>{% endif %}", encoding="utf-8")
  config = tmp_path / "tokenizer_config.json"
  config.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "x"},
                                                  {"name": "default", "template": "{{ messages[0].content }}!"}]}))
  for file, text in ((plain, "<system>be brief<user>hi<bot>"), (config, "be brief!"),
                     ("{{ messages[-1].content }}?", "hi?")):                  # the template text itself (vLLM's)
    cli_main([path, "--chat", "--system", "be brief", "--prompt", "hi", "--max-tokens", "2", "--show-tokens", "-q",
              "--chat-template", str(file)])
    assert f"prompt ids: {tok.encode(text)}\n" in capsys.readouterr().out, file
  broken = tmp_path / "broken.jinja"
  broken.write_text("{% for m in messages %}", encoding="utf-8")
  fifo = tmp_path / "fifo"
  os.mkfifo(fifo)
  for args, words in (([], "--chat-template needs --chat or -i"),
                      (["--chat"], "TemplateSyntaxError"),
                      (["--chat", "--chat-template", str(tmp_path / "none")], "cannot read chat template file"),
                      (["--chat", "--chat-template", str(fifo)], "is not a regular file")):
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e:
      cli_main([path, "--prompt", "hi", "-q", "--chat-template", str(broken), *args])
    assert str(e.value).startswith("error: --chat-template") and words in str(e.value), e.value
    assert time.monotonic() - t0 < 30
