"""Streaming text: UTF-8 split across tokens, stop strings, and the CLI's output."""
import json

import jax

import pytest

from jaxllm import Engine, GGUFFile, SamplingParams, StreamDecoder, Tokenizer
from jaxllm.text import StopText
from jaxllm.generate import main as cli_main
from jaxllm.weights import load_weights
from tiny import write_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  path = write_tiny_model(tmp_path_factory.mktemp("s") / "m.gguf", "qwen2")
  gf = GGUFFile(path)
  tok = Tokenizer(gf.metadata)
  return path, Engine(gf.config, load_weights(gf, progress=False), tok, max_context=64, kernels="xla"), tok


def test_stream_decoder_holds_split_characters(model):
  _, _, tok = model
  text = "你好，世界 🎉 naïve"
  ids = tok.encode(text)
  assert len(ids) > len(text)          # the tiny vocab is bytes: every CJK char spans 3 tokens
  dec = StreamDecoder(tok)
  pieces = [dec.push(i) for i in ids] + [dec.flush()]
  assert "".join(pieces) == text
  assert all("\ufffd" not in p for p in pieces)
  assert "" in pieces                  # some tokens complete no character


def test_stop_text_holds_back_prefixes():
  s = StopText(["STOP"])
  assert s.push("abc ST") == ("abc ", False)
  assert s.push("O") == ("", False)
  assert s.push("x") == ("STOx", False)
  assert s.push(" ST") == (" ", False)
  assert s.push("OP and more") == ("", True)
  assert s.text == "abc STOx "


def test_stop_text_against_a_full_search():
  """Random pieces against the plain rule (cut before the first occurrence, reported with the piece that
  completes it), with the held-back text never longer than the stop string: the work a piece costs does
  not grow with the text."""
  import random
  rng = random.Random(0)
  for trial in range(300):
    stop = "".join(rng.choice("ab") for _ in range(rng.randint(1, 4)))
    s, full, shown, hit_at = StopText([stop]), "", "", None
    for i in range(rng.randint(1, 40)):
      piece = "".join(rng.choice("abc") for _ in range(rng.randint(0, 3)))
      full += piece
      out, hit = s.push(piece)
      shown += out
      if hit:
        hit_at = i
        break
      assert len(s.pending) < len(stop) and full.startswith(shown)
    cut = full.find(stop)
    assert (hit_at is not None) == (cut >= 0), (stop, full)
    want = full[:cut] if cut >= 0 else full
    assert shown + ("" if hit_at is not None else s.flush()) == want == s.text, (stop, full, shown)


def test_generate_stops_at_stop_string(model):
  _, engine, tok = model
  prompt = tok.encode("the cat")
  full = engine.generate(prompt, 24, ignore_eos=True)
  assert len(full.text) > 6
  stop = full.text[3:6]
  cut = engine.generate(prompt, 24, ignore_eos=True, stop=[stop])
  assert cut.finish_reason == "stop"
  assert cut.text == full.text[: full.text.index(stop)]


def test_pipelined_and_streaming_loops_agree(model, lab_switches):
  """Both loops give the same tokens, with each call's tokens copied to the host at dispatch (the default) or
  when read (lab switch JAXLLM_READ_AHEAD=0)."""
  _, engine, tok = model
  prompt = tok.encode("hello")
  params = SamplingParams(temperature=0.8, top_p=0.9)
  a = engine.generate(prompt, 20, params, seed=5, ignore_eos=True, pipelined=True)
  b = engine.generate(prompt, 20, params, seed=5, ignore_eos=True, pipelined=False)
  c = engine.generate(prompt, 20, params, seed=6, ignore_eos=True)
  assert a.ids == b.ids and len(a.ids) == 20
  assert a.ids != c.ids
  lab_switches.setenv("JAXLLM_READ_AHEAD", "0")
  for pipelined in (True, False):
    assert engine.generate(prompt, 20, params, seed=5, ignore_eos=True, pipelined=pipelined).ids == a.ids


@pytest.mark.parametrize("k, device_loop", [(3, "unrolled"), (4, "while")])
def test_tokens_per_call_gives_the_same_tokens(model, k, device_loop):
  """K decode steps per executable call, unrolled or in a while loop: the same tokens as one per call
  (greedy and sampled, both loops, lengths that are not multiples of K, a stop string, EOS and a full
  context), and reuse_cache still reuses what the cache holds."""
  path, default, tok = model
  gf = GGUFFile(path)
  one = Engine(gf.config, default.weights, tok, max_context=64, kernels="xla", tokens_per_call=1)
  many = Engine(gf.config, default.weights, tok, max_context=64, kernels="xla", tokens_per_call=k,
                device_loop=device_loop)
  prompt = tok.encode("hello")
  sampled = SamplingParams(temperature=0.8, top_p=0.9)
  for params, n, pipelined in ((SamplingParams(), 17, True), (sampled, 10, True), (sampled, 11, False)):
    a = one.generate(prompt, n, params, seed=3, ignore_eos=True, pipelined=pipelined)
    b = many.generate(prompt, n, params, seed=3, ignore_eos=True, pipelined=pipelined)
    assert a.ids == b.ids and len(b.ids) == n, (params, n, pipelined)
  full = one.generate(prompt, 24, ignore_eos=True)
  stop = full.text[3:6]
  assert many.generate(prompt, 24, ignore_eos=True, stop=[stop]).text == full.text[: full.text.index(stop)]
  assert many.generate(prompt, 40).ids == one.generate(prompt, 40).ids
  long = many.generate(list(range(1, 61)), 50, ignore_eos=True)
  assert len(long.ids) == 64 - 60 + 1 and long.finish_reason == "context"
  first = many.generate(prompt, 8, ignore_eos=True)
  again = many.generate(prompt + first.ids, 8, ignore_eos=True, reuse_cache=True)
  assert many.last_reused[0] >= len(prompt)
  assert again.ids == one.generate(prompt + first.ids, 8, ignore_eos=True).ids


def test_tokens_per_call_must_be_a_small_positive_integer(model):
  path, one, tok = model
  if jax.default_backend() == "cpu":   # the defaults: 8 a call in a while loop, 1 where the loop is unrolled
    assert one.loop_for(1) == "while" and one.tokens_per_call_for(1) == 8
    unrolled = Engine(one.config, one.weights, tok, max_context=64, kernels="xla", device_loop="unrolled")
    assert unrolled.tokens_per_call_for(1) == 1
  assert Engine(one.config, one.weights, tok, max_context=64, kernels="xla", tokens_per_call=5).tokens_per_call_for(3) == 5
  for bad in (0, -1, 65, 2.0, True):
    with pytest.raises(ValueError, match="tokens_per_call"):
      Engine(one.config, one.weights, tok, max_context=64, kernels="xla", tokens_per_call=bad)
  with pytest.raises(ValueError, match="device_loop must be one of"):
    Engine(one.config, one.weights, tok, max_context=64, kernels="xla", device_loop="scan")


def test_generation_ends_when_context_is_full(model):
  _, engine, tok = model
  result = engine.generate(list(range(1, 61)), 50, ignore_eos=True)
  assert len(result.ids) == 64 - 60 + 1 and result.finish_reason == "context"


def test_cli_json(model, capsys):
  path, _, tok = model
  assert cli_main([path, "--prompt", "the", "--max-tokens", "5", "--ignore-eos", "--json", "--kernels", "xla"]) == 0
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert out["prompt_ids"] == tok.encode("the") and len(out["ids"]) == 5
  assert out["text"] == tok.decode(out["ids"])
  for key in ("ttft_ms", "tpot_ms", "tok_per_s"):
    assert out[key] > 0
  assert out["kernels"] in ("ffi", "xla") and out["graph_state"] is None


def test_cli_show_graph_state(model, capsys, monkeypatch):
  path, _, _ = model
  monkeypatch.setenv("JAXLLM_CUDA_GRAPHS", "0")
  cli_main([path, "--prompt", "the", "--max-tokens", "2", "--json", "--show-graph-state"])
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert out["graph_state"]["requested"] is False and out["graphs"] is False
  assert out["graph_state"]["state"] == "off"


def test_cli_chat_streams_text(model, capsys):
  path, _, tok = model
  cli_main([path, "--chat", "--system", "be brief", "--prompt", "hi", "--max-tokens", "4", "--ignore-eos",
            "--show-tokens"])
  captured = capsys.readouterr()
  assert "prompt ids: " + str(tok.encode(tok.apply_chat_template(
      [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]))) in captured.out
  assert "TTFT" in captured.err and "TPOT" in captured.err and "tok/s" in captured.err


def test_cli_batch_of_prompts(model, capsys, tmp_path):
  path, engine, tok = model
  f = tmp_path / "prompts.txt"
  f.write_text("second prompt\n\nthird one here\n", encoding="utf-8")
  # The fixture's engine (XLA path, 64 positions), so that the CLI's batch runs the same program as the batch below
  # (in bf16 on the GPU, a batch of three and a request alone may part at a near tie: test_embedding compares those).
  cli_main([path, "--prompt", "first", "--prompts-file", str(f), "--max-tokens", "6", "--ignore-eos", "--json",
            "--kernels", "xla", "-c", "64"])
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  prompts = [tok.encode(s) for s in ("first", "second prompt", "third one here")]
  assert [r["prompt_ids"] for r in out["results"]] == prompts
  assert [r["ids"] for r in out["results"]] == [r.ids for r in engine.generate_batch(prompts, 6, ignore_eos=True)]
  with pytest.raises(SystemExit, match="give a prompt"):
    cli_main([path])


def test_stop_text_cuts_at_the_earliest_stop_string_whatever_the_list_order():
  """Several stop strings: the text is cut at the one that appears first in the text (it was cut at the
  first in list order: `StopText(["b", "a"]).push("ab")` kept "a")."""
  assert StopText(["b", "a"]).push("ab") == ("", True)
  s = StopText(["world", "lo", "xyz"])
  assert s.push("hello world") == ("hel", True) and s.text == "hel"
  s = StopText(["cd", "bcd"])
  assert s.push("abc") == ("a", False) and s.push("d") == ("", True) and s.text == "a"


def test_a_stream_ends_when_every_row_is_done(model, monkeypatch):
  """stream_tokens stops once every row is done on the device (end of generation, or its share of the
  context), instead of yielding the done rows' last tokens up to max_tokens."""
  _, engine, tok = model
  # Full contexts: rows of 61 and 58 tokens in a context of 64 generate 4 and 7 tokens, not 40.
  prompts = [list(range(1, 62)), list(range(3, 61))]
  rows = [t.tolist() for t, _ in engine.stream_tokens(prompts, 40, ignore_eos=True)]
  assert len(rows) == 7
  # End of generation: the row's third greedy token made an end-of-generation id ends the stream there.
  prompt = tok.encode("hello")
  alone = [int(t[0]) for t, _ in engine.stream_tokens([prompt], 12, ignore_eos=True)]
  third = alone[2]
  assert third not in alone[:2]
  monkeypatch.setattr(tok, "eog_ids", frozenset({third}))
  got = [int(t[0]) for t, _ in engine.stream_tokens([prompt], 12)]
  assert got == alone[:3]


def test_an_interrupt_after_a_donating_call_leaves_a_working_engine(model, monkeypatch):
  """Ctrl-C between a call that donated the state and the assignment of its result: the old buffers are
  deleted, the new ones lost. The engine drops its cache (no traceback on the way out) and the next request,
  reusing the cache or not, runs from a new one with the same tokens as before."""
  _, engine, tok = model
  prompt = tok.encode("the cat")
  want = engine.generate(prompt, 12, ignore_eos=True).ids
  real = engine.advance_fn

  def interrupted(batch, greedy):
    advance = real(batch, greedy)

    def call(state, block):
      advance(state, block)
      raise KeyboardInterrupt
    return call
  monkeypatch.setattr(engine, "advance_fn", interrupted)
  with pytest.raises(KeyboardInterrupt):
    engine.generate(prompt, 12, ignore_eos=True)
  monkeypatch.setattr(engine, "advance_fn", real)
  again = engine.generate(prompt + want[:4], 8, ignore_eos=True, reuse_cache=True)
  assert engine.last_reused == [0]
  assert again.ids == want[4:12]
  assert engine.generate(prompt, 12, ignore_eos=True).ids == want
