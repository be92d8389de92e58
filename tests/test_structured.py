"""Structured output: token masks on the device (sampling.sample, decode.decode_step), grammars on the host
(jaxllm.structured, llguidance), response_format through the server and --json-schema through the CLI.

The device side is checked against numpy on fresh random logits and masks; the rest on the tiny random-weights
model, whose constrained outputs must parse and validate against their schemas (jsonschema) every time: the
schemas are bounded (enums, maxLength, maxItems, integer ranges) so that a random model finishes them.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import openai
import pytest

from jaxllm.decode import decode_step
from jaxllm.sampling import MAX_TOP_K, Sampler, SamplingParams, allowed_tokens, full_mask, mask_words, sample
from test_serve import metric, post, serve
from tiny import write_tiny_model

# The module's tests share a costly module fixture: under xdist one worker runs them all, setting it up once
# (bench/gpu_check.sh runs --dist loadgroup).
pytestmark = pytest.mark.xdist_group("structured")

FLAT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "colour": {"enum": ["red", "green", "blue"]}},
        "required": ["name", "n", "colour"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": -5, "maximum": 5},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}, "code": {"type": "string", "maxLength": 4}},
              "required": ["ok", "code"], "additionalProperties": False}},
    "required": ["id", "tags", "inner"], "additionalProperties": False}
ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4}
CHOICE = {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 3}, {"enum": ["none", "some"]}]}
SCHEMAS = {"flat": FLAT, "nested": NESTED, "array": ARRAY, "choice": CHOICE}


def _unpack(masks: np.ndarray, v: int) -> np.ndarray:
  """numpy's reading of packed masks [B, W] uint32: [B, V] bool, token t from bit t % 32 of word t // 32."""
  return np.unpackbits(masks.astype("<u4").view(np.uint8), axis=1, bitorder="little")[:, :v].astype(bool)


def _random_masks(rng, logits: np.ndarray) -> np.ndarray:
  """Random masks [B, W] (the bits past V set too, to be ignored) with rows of one token, every token, and only
  the 10 least likely tokens (the unmasked argmax is then always masked out)."""
  b, v = logits.shape
  bits = rng.random((b, mask_words(v) * 32)) < 0.3
  bits[0] = False
  bits[0, rng.integers(v)] = True
  bits[1] = True
  bits[2, :v] = False
  bits[2, np.argsort(logits[2])[:10]] = True
  bits[:, v:] = True
  return np.packbits(bits, axis=1, bitorder="little").view("<u4").astype(np.uint32)


@functools.cache
def _draw(greedy_only: bool, penalties: bool):
  return jax.jit(functools.partial(sample, greedy_only=greedy_only, penalties=penalties))


def test_sampler_never_draws_a_masked_token():
  """Fresh random logits and masks: the greedy token is numpy's argmax over the allowed tokens; a sampled one
  (full softmax, top-k, top-p, min-p, penalties, the wide top-k step) is always allowed and within numpy's top-k
  or nucleus of the allowed tokens."""
  rng = np.random.default_rng(0)
  b, v = 16, 1000
  settings = {"greedy": SamplingParams(), "full": SamplingParams(temperature=1.0),
              "top_k": SamplingParams(temperature=1.0, top_k=5), "top_p": SamplingParams(temperature=0.8, top_p=0.5),
              "min_p": SamplingParams(temperature=1.5, min_p=0.2),
              "penalized": SamplingParams(temperature=0.7, repeat_penalty=1.5, presence_penalty=1.0),
              "wide": SamplingParams(temperature=1.0, top_k=MAX_TOP_K + 72)}
  for trial in range(3):
    logits = (rng.standard_normal((b, v)) * 3).astype(np.float32)
    masks = _random_masks(rng, logits)
    allowed = _unpack(masks, v)
    np.testing.assert_array_equal(np.asarray(allowed_tokens(jnp.asarray(masks), v)), allowed)
    masked = np.where(allowed, logits, -np.inf)
    history = [list(rng.integers(0, v, 20)) for _ in range(b)]
    for name, params in settings.items():
      sampler = Sampler.create(params, b, seed=100 * trial, history=history, vocab_size=v, masks=masks)
      draw = _draw(name == "greedy", name == "penalized")
      tokens = np.asarray(draw(jnp.asarray(logits), jax.device_put(sampler))[0])
      assert allowed[np.arange(b), tokens].all(), (name, tokens)
      if name == "greedy":
        np.testing.assert_array_equal(tokens, masked.argmax(-1))
      for r, t in enumerate(tokens):
        order = np.argsort(-masked[r])
        rank = int(np.nonzero(order == t)[0][0])
        if name in ("top_k", "wide"):
          assert rank < params.top_k, (name, r, rank)
        if name == "top_p":
          p = np.exp((masked[r] - masked[r].max()) / params.temperature)
          p = p[order] / p.sum()
          assert np.cumsum(p)[rank] - p[rank] < params.top_p, (r, rank)
    # Without the mask the draws leave the allowed tokens: the check above has teeth.
    plain = Sampler.create(SamplingParams(), b, vocab_size=v)
    assert not allowed[np.arange(b), np.asarray(sample(jnp.asarray(logits), plain, greedy_only=True)[0])].all()


class _Fixed:
  """A stand-in Constraint whose mask never changes: the same tokens allowed at every step."""

  def __init__(self, v: int, tokens):
    bits = np.zeros((1, mask_words(v) * 32), bool)
    bits[0, list(tokens)] = True
    self.mask = np.packbits(bits, axis=1, bitorder="little").view("<u4").astype(np.uint32)[0]
    self.complete, self.error = False, None

  def advance(self, token: int) -> None:
    pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  return write_tiny_model(tmp_path_factory.mktemp("structured") / "tiny.gguf", "qwen2", context=256)


def _argmax_head(hlo: str) -> bool:
  """Whether a lowered step takes the fused argmax head: its own call (mode 2, one FFI call per op) or the
  GPU's layers call's last kernel (head 1)."""
  import re
  from jaxllm.kernels.fused import HEAD_MODES, MODES
  return bool(re.search(rf"\b(mode = {MODES['argmax']}|head = {HEAD_MODES['argmax']}) : i64", hlo))


def test_a_masked_state_never_takes_the_argmax_head(lab_switches):
  """The fused step's LM-head argmax sees no mask: a greedy step whose state carries one compiles the logits
  head and samples from masked logits; the same step without a mask keeps the argmax head. Run through the
  fused path (on the CPU its handlers switched on as the GPU runs them; a model geometry the CUDA kernels
  take: Qwen2.5-0.5B's, two layers, a 4096-token vocabulary), every token is one the mask allows."""
  from jaxllm import Engine
  from jaxllm.kernels import ffi
  from jaxllm.load import default_dtype
  from jaxllm.model import use_fused
  from jaxllm.presets import preset
  from jaxllm.weights import random_weights
  if ffi.unavailable_reason() is not None:
    pytest.skip(f"FFI kernels unavailable: {ffi.unavailable_reason()}")
  lab_switches.setenv("JAXLLM_FUSED_CPU", "1")
  config = preset("qwen2.5-0.5b").replace(n_layers=2, vocab_size=4096)
  weights = random_weights(config, seed=3, quant="w8a16", dtype=default_dtype())
  engine = Engine(config, weights, None, max_context=64, kernels="ffi")

  def hlo(masked):
    state = engine._state_spec(1, True, masked=masked)
    assert use_fused(config, weights, state.cache, 1, "ffi")
    step = functools.partial(decode_step, config, greedy_only=True, penalties=False, kernels="ffi")
    return jax.jit(step).lower(weights, state).as_text()
  assert _argmax_head(hlo(False))
  assert not _argmax_head(hlo(True))
  ids = [11, 500, 2047, 7, 3000]
  free = engine.generate(ids, 12, ignore_eos=True).ids
  allow = {t for t in range(40, 60) if t not in free}
  got = engine.generate(ids, 12, ignore_eos=True, constraint=_Fixed(config.vocab_size, allow)).ids
  assert len(got) == 12 and set(got) <= allow, (got, free)


@pytest.fixture(scope="module")
def served(tiny):
  s = serve(tiny, slots=2)
  yield s
  s.stop()


@pytest.fixture(scope="module")
def client(served):
  return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)


def _format(schema) -> dict:
  return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def _valid(text: str, schema) -> None:
  jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_constrained_output_validates(served, client, name):
  """Chat (greedy, then streamed) and completions (three sampled choices): each output parses, validates against
  the schema and ends with finish_reason "stop"."""
  schema = SCHEMAS[name]
  messages = [{"role": "user", "content": f"Give me a {name} answer."}]
  r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=200, temperature=0,
                                     response_format=_format(schema))
  _valid(r.choices[0].message.content, schema)
  assert r.choices[0].finish_reason == "stop"
  stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=200, temperature=0,
                                          response_format=_format(schema), stream=True)
  chunks = [c.choices[0] for c in stream if c.choices]
  assert "".join(c.delta.content or "" for c in chunks) == r.choices[0].message.content
  assert chunks[-1].finish_reason == "stop"
  r = client.completions.create(model="tiny", prompt=f"{name}:", max_tokens=200, temperature=1.0, top_p=0.95, n=3,
                                seed=7, extra_body={"response_format": _format(schema)})
  for choice in r.choices:
    _valid(choice.text, schema)
    assert choice.finish_reason == "stop", choice.text


def test_json_object_mode(served, client):
  """{"type": "json_object"}: a JSON object, whatever it holds (prompts whose greedy object this random model
  closes within the budget: inside a string it may otherwise write for ever)."""
  for prompt in ["b", "x", "JSON:", "The quick brown fox"]:
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=120, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), dict), r.choices[0].text


def test_constrained_and_free_requests_share_the_batch(served):
  """Free greedy requests running beside constrained ones (both slots busy, the rest queued) give what they give
  alone; the constrained ones validate; nothing compiles while they run."""
  free = [(f"free text {i}", 30 + 7 * i) for i in range(3)]
  constrained = [("flat", FLAT), ("nested", NESTED), ("array", ARRAY)]
  before = post(served.url, "/metrics", None, method="GET")[2]
  client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)

  async def one(prompt, max_tokens, schema=None):
    extra = {"response_format": _format(schema)} if schema else {}
    r = await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                        extra_body=extra)
    return r.choices[0].text, r.choices[0].finish_reason

  async def run():
    jobs = []
    for (prompt, n), (name, schema) in zip(free, constrained):
      jobs += [one(prompt, n), one(name, 200, schema)]
    return await asyncio.gather(*jobs)
  results = asyncio.run(run())
  after = post(served.url, "/metrics", None, method="GET")[2]
  for (prompt, n), got in zip(free, results[0::2]):
    assert got == served.reference(served.tokenizer.encode(prompt), n), prompt
  for (_, schema), (text, reason) in zip(constrained, results[1::2]):
    _valid(text, schema)
    assert reason == "stop"
  compiles = "jaxllm_xla_compiles_while_serving_total"
  assert metric(after, compiles) == metric(before, compiles)   # the process's count: other tests compile in it too
  assert metric(after, "jaxllm_kv_slots_used") == 0


@pytest.mark.parametrize("response_format, words", [
    (_format({"type": "foo"}), "Invalid type"),
    (_format({"type": "string", "maxLength": -1}), "maxLength"),
    (_format({"$ref": "#/definitions/missing"}), "missing"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "schema"),
    ({"type": "json_schema"}, "json_schema"),
    ({"type": "xml"}, "'text', 'json_object' or 'json_schema'"),
    ({"type": "json_object", "schema": {}}, "takes only"),
])
def test_a_bad_response_format_is_a_400_and_the_server_goes_on(served, client, response_format, words):
  for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                     ("/v1/completions", {"prompt": "x"})]:
    t0 = time.perf_counter()
    status, _, answer = post(served.url, path, dict(body, response_format=response_format, max_tokens=4))
    assert time.perf_counter() - t0 < 1.0
    assert status == 400 and answer["error"]["param"] == "response_format", answer
    assert words in answer["error"]["message"] and answer["error"]["type"] == "invalid_request_error"
  r = client.completions.create(model="tiny", prompt="x", max_tokens=3, temperature=0)
  assert r.choices[0].finish_reason == "length"


def test_cli_json_schema(tiny, tmp_path, capsys):
  """generate --json-schema FILE prints JSON valid under it (greedy and sampled, a batch of two); --json-object
  any object; a file that is not a schema, or a schema llguidance cannot enforce, is one line naming it."""
  from jaxllm.generate import main
  path = tmp_path / "schema.json"
  path.write_text(json.dumps(FLAT))
  common = [tiny, "-n", "200", "--no-cache", "--no-compile-cache", "-q", "--json"]
  assert main(common + ["-p", "hello", "--json-schema", str(path)]) == 0
  result = json.loads(capsys.readouterr().out)
  _valid(result["text"], FLAT)
  assert result["finish_reason"] == "grammar"
  assert main(common + ["-p", "one", "-p", "two", "--temperature", "1", "-s", "3", "--json-schema", str(path)]) == 0
  for r in json.loads(capsys.readouterr().out)["results"]:
    _valid(r["text"], FLAT)
  assert main(common + ["-p", "x", "--json-object"]) == 0
  assert isinstance(json.loads(json.loads(capsys.readouterr().out)["text"]), dict)
  for text, words in [("[1, 2", "not JSON"), ("[1]", "got list [1]"), ('{"type": "foo"}', "Invalid type: foo")]:
    path.write_text(text)
    with pytest.raises(SystemExit) as e:
      main(common + ["-p", "x", "--json-schema", str(path)])
    message = str(e.value)
    assert message.startswith(f"error: --json-schema {str(path)!r}") and words in message and "\n" not in message
  with pytest.raises(SystemExit, match="cannot read --json-schema"):
    main(common + ["-p", "x", "--json-schema", str(tmp_path / "missing.json")])
