"""The functional API inside user jit/vmap/scan, batched generation, and scoring."""
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxllm
from agree import same_or_near_tie
from tiny import numpy_forward

DOC = Path(__file__).resolve().parent.parent / "docs" / "embedding.md"


@pytest.fixture(scope="module")
def qwen2(tiny_models):
  config, weights, tok = jaxllm.load(tiny_models["qwen2"], quant="none", dtype=jnp.float32, progress=False)
  return tiny_models["qwen2"], config, weights, tok


@pytest.mark.network
def test_embedding_doc_runs():
  """Every python block of docs/embedding.md, in order, in one namespace, as written (the demo model)."""
  blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
  assert len(blocks) >= 5
  ns = {}
  for block in blocks:
    exec(compile(block, str(DOC), "exec"), ns)
  engine_ids = [r.ids for r in ns["results"]]
  np.testing.assert_array_equal(np.asarray(ns["ids"]), np.asarray(engine_ids))   # jit+scan == engine
  np.testing.assert_array_equal(np.asarray(ns["firsts"]), np.asarray(ns["ids"])[:, 0])   # vmap == batch
  assert ns["logp"].shape == (2,) and np.all(ns["logp"] < 0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_batched_greedy_equals_alone(tiny_models, arch):
  config, weights, tok = jaxllm.load(tiny_models[arch], progress=False)
  engine = jaxllm.Engine(config, weights, tok, max_context=96, kernels="auto")
  prompts = [tok.encode(s) for s in ("hi", "the quick brown fox jumps", "一二三四五六七八九十 the end", "x")]
  batch = engine.generate_batch(prompts, 24, ignore_eos=True)
  for p, r in zip(prompts, batch):
    same_or_near_tie(engine, p, r.ids, engine.generate(p, 24, ignore_eos=True).ids)


def test_batched_stops_per_sequence(qwen2):
  _, config, weights, tok = qwen2
  engine = jaxllm.Engine(config, weights, tok, max_context=64)
  prompts = [tok.encode("ab"), tok.encode("hello there")]
  full = engine.generate_batch(prompts, 12, ignore_eos=True)
  stop = full[0].text[2:4]
  cut = engine.generate_batch(prompts, 12, ignore_eos=True, stop=[stop])
  assert cut[0].finish_reason == "stop" and cut[0].text == full[0].text[: full[0].text.index(stop)]
  # Sequence 1 stops at its own first occurrence of the stop string, or runs its full length without one.
  if stop in full[1].text:
    assert cut[1].finish_reason == "stop" and cut[1].text == full[1].text[: full[1].text.index(stop)]
  else:
    assert cut[1].ids == full[1].ids and cut[1].finish_reason == "length"


def test_score_matches_float64_reference(qwen2):
  path, config, weights, tok = qwen2
  prompts = [tok.encode("the cat"), tok.encode("x"), tok.encode("一二三 and more words here")]
  conts = [tok.encode(" sat on the mat"), tok.encode("yz"), tok.encode(" 四")]
  got = jaxllm.score(config, weights, prompts, conts)
  for p, c, g in zip(prompts, conts, got):
    logits = numpy_forward(path, p + c)                            # [T, V] float64
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    want = sum(logp[len(p) - 1 + i, tok_id] for i, tok_id in enumerate(c))
    assert abs(g - want) < 1e-3 * max(1.0, abs(want)), (g, want)


def test_score_rejects_bad_input(qwen2):
  _, config, weights, _ = qwen2
  with pytest.raises(ValueError, match="need as many prompts as continuations"):
    jaxllm.score(config, weights, [[1]], [[2], [3]])
  with pytest.raises(ValueError, match="needs >= 1 token"):
    jaxllm.score(config, weights, [[1]], [[]])


def test_decode_step_under_vmap_matches_batch(qwen2):
  """vmap of a batch-1 decode over independent states equals one batched decode step."""
  _, config, weights, _ = qwen2
  tokens = jnp.asarray([[5, 6, 7, 0], [9, 10, 11, 12]], jnp.int32)
  lengths = jnp.asarray([3, 4], jnp.int32)
  greedy = jaxllm.SamplingParams()
  # Both compiled, as inside a user's program (op by op, each op compiles by itself: 145 s on an H100).
  batched = jax.jit(lambda w: jaxllm.decode_step(config, w, jaxllm.prefill(
      config, w, jaxllm.create_cache(config, 2, 16), tokens, lengths, jaxllm.Sampler.create(greedy, 2))))(weights)

  def one(w, t, n):
    s = jaxllm.prefill(config, w, jaxllm.create_cache(config, 1, 16), t[None], n[None],
                       jaxllm.Sampler.create(greedy, 1))
    return jaxllm.decode_step(config, w, s).tokens[0]

  vmapped = jax.jit(jax.vmap(one, in_axes=(None, 0, 0)))(weights, tokens, lengths)
  np.testing.assert_array_equal(np.asarray(vmapped), np.asarray(batched.tokens))


@pytest.mark.network
def test_batched_greedy_equals_alone_smollm2():
  """The real SmolLM2-135M (W8A16, the default kernels): a batch of prompts of different lengths."""
  config, weights, tok = jaxllm.load("smollm2-135m", progress=False)
  engine = jaxllm.Engine(config, weights, tok, max_context=96)
  prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])),
             tok.encode("The capital of France is"), tok.encode("def fibonacci(n):"), tok.encode("Once")]
  batch = engine.generate_batch(prompts, 16, ignore_eos=True)
  for p, r in zip(prompts, batch):
    same_or_near_tie(engine, p, r.ids, engine.generate(p, 16, ignore_eos=True).ids)


def test_score_memory_does_not_grow_with_the_vocabulary_times_length():
  """The logits exist LOGIT_CHUNK positions at a time: going from 256 to 1024 positions adds to the compiled
  scorer's temporaries well under the [B, 768, V] f32 (403 MB) that whole logits would add, and chunking
  changes nothing in the result."""
  from jaxllm.presets import PRESETS
  from jaxllm.scoring import continuation_logprobs
  config = PRESETS["tiny"].replace(vocab_size=65536)
  weights = jaxllm.random_weights(config, seed=1, dtype=jnp.float32)
  b = 2
  # On the GPU, XLA's autotuning of these large full-precision f32 products (the whole vocabulary, HIGHEST)
  # takes minutes a program; the default configurations are as exact, and this test is about memory.
  options = {"xla_gpu_autotune_level": 0} if jax.default_backend() == "gpu" else None

  def scorer(chunk):    # the weights an argument, not constants folded into the program
    return jax.jit(lambda w, tk, p, q: continuation_logprobs(config, w, tk, p, q, chunk=chunk),
                   compiler_options=options)

  def temp(t):
    tokens = jax.ShapeDtypeStruct((b, t), jnp.int32)
    lens = jax.ShapeDtypeStruct((b,), jnp.int32)
    return scorer(64).lower(weights, tokens, lens, lens).compile().memory_analysis().temp_size_in_bytes
  grown = temp(1024) - temp(256)
  assert grown < b * 768 * config.vocab_size * 4 / 4, grown     # the forward itself grows by ~50 MB
  tokens = jax.random.randint(jax.random.PRNGKey(0), (b, 300), 0, config.vocab_size)
  lens = (jnp.asarray([3, 10]), jnp.asarray([300, 200]))
  chunked = scorer(64)(weights, tokens, *lens)
  whole = scorer(512)(weights, tokens, *lens)
  np.testing.assert_allclose(np.asarray(chunked), np.asarray(whole), rtol=1e-5)
