"""Against HF transformers loading the same GGUF file (dequantized to float32): tokenizer ids, greedy
tokens, teacher-forced top-1 agreement; and W8A16 against our float model.

SmolLM2 runs in CI; the Qwen model is opt-in (JAXLLM_TEST_QWEN=1) because of its 0.5 GB download.
"""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from jaxllm import Engine, GGUFFile, Tokenizer, create_cache, fetch_demo_model, sequence_logits  # noqa: E402
from jaxllm.weights import load_weights  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.network]   # the real models are demo-model downloads

TOKENIZER_STRINGS = [
    "Hello, world! How are you today?",
    "你好，世界。今天天气很好，我们去公园散步吧！",
    "emoji: 🎉🚀👍🏽 and 🇨🇳 flags",
    "runs    of     spaces   and\ttabs\t\tand\n\nnewlines\r\n  indented",
    "digits 1234567890 3.14159 1e-10 0x1F 2026-11-29",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>mixed<|im_end|> special tokens inline",
    "def f(x):\n    return x ** 2  # comment\n",
    "Ünïcödé çhàrs, ñ, ß, Ωμέγα, кириллица, العربية, हिन्दी",
]
LONG_TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by rewiring "
    "panels; later, stored programs let the same hardware run many tasks. Compilers turned human-readable "
    "code into machine instructions, and operating systems shared one computer among many users. "
    "Graphics processors began as fixed-function pipelines for drawing triangles, but by the late 2000s "
    "they exposed thousands of programmable cores. Researchers noticed that the dense linear algebra at "
    "the heart of neural networks mapped well onto this hardware, and deep learning took off. Today a "
    "single accelerator can run language models with billions of parameters, generating text one token "
    "at a time. Each token requires reading every weight of the model from memory, so decode speed is "
    "bound by memory bandwidth rather than arithmetic. Engines therefore quantize weights to eight or "
    "four bits, fuse small operations into larger kernels, and capture the whole decode step in a graph "
    "so the processor does not wait for the host between launches. 人工智能的发展离不开硬件的进步。"
    "def softmax(x):\n    m = max(x)\n    e = [math.exp(v - m) for v in x]\n    return [v / sum(e) for v in e]\n"
    "Rivers shape the land they cross. Over thousands of years a river carves a valley, deposits silt on "
    "its floodplain and builds a delta where it meets the sea. Farmers settled along such rivers because "
    "the soil was rich and water was close, and the first cities grew from those settlements. Trade moved "
    "along the water as well: boats carried grain, timber and stone far more cheaply than carts could.")
GREEDY_PROMPTS = ["The capital of France is", "def fibonacci(n):", None]  # None: chat template
CHAT = "Write a haiku about GPUs."
NEW_TOKENS = 24
MARGIN = 0.05


def _models():
  yield pytest.param("smollm2-135m", id="smollm2")
  yield pytest.param("qwen2.5-coder-0.5b", id="qwen", marks=pytest.mark.qwen)


@pytest.fixture(scope="module", params=list(_models()))
def both(request):
  path = fetch_demo_model(request.param)
  hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         dtype=torch.float32)
  hf.eval()
  gf = GGUFFile(path)
  tok = Tokenizer(gf.metadata)
  wf = load_weights(gf, quant="none", dtype=jnp.float32, progress=False)
  return dict(name=request.param, hf=hf, hf_tok=hf_tok, config=gf.config, tok=tok, wf=wf, gf=gf)


def test_tokenizer_matches_hf(both):
  tok, hf_tok = both["tok"], both["hf_tok"]
  for s in TOKENIZER_STRINGS + [LONG_TEXT]:
    ours = tok.encode(s)
    theirs = hf_tok(s, add_special_tokens=True).input_ids
    assert ours == theirs, s
    assert tok.decode(ours) == s


def _hf_greedy(hf, ids, n):
  """Greedy tokens and HF's logits [V] at each step."""
  out, rows = [], []
  with torch.no_grad():
    res = hf(torch.tensor([ids]), use_cache=True)
    for _ in range(n):
      logits = res.logits[0, -1]
      rows.append(logits.numpy().copy())
      nxt = int(torch.argmax(logits))
      out.append(nxt)
      res = hf(torch.tensor([[nxt]]), past_key_values=res.past_key_values, use_cache=True)
  return out, rows


def _check_against_hf(both, ids, ours, what):
  """Our greedy tokens against HF's from the same prompt ids: equal, or diverging where HF itself rates our
  token within MARGIN of its own (the two saw the same tokens up to there)."""
  theirs, hf_logits = _hf_greedy(both["hf"], ids, len(ours))
  first_diff = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
  if first_diff is None:
    print(f"{both['name']} {what}: {len(ours)} tokens identical")
    return
  row = hf_logits[first_diff]
  gap = float(row[theirs[first_diff]] - row[ours[first_diff]])
  assert gap < MARGIN, (f"{both['name']} {what}: diverged at step {first_diff}, where HF rates our token "
                        f"{gap:.3f} below its own (ours {ours}, HF {theirs})")
  print(f"{both['name']} {what}: diverged at {first_diff}, a near tie there (gap {gap:.4f})")


def test_greedy_matches_hf(both):
  tok = both["tok"]
  engine = Engine(both["config"], both["wf"], tok, max_context=256, kernels="xla", dtype=jnp.float32)
  for prompt in GREEDY_PROMPTS:
    text = prompt if prompt is not None else tok.apply_chat_template([{"role": "user", "content": CHAT}])
    ids = tok.encode(text)
    _check_against_hf(both, ids, engine.generate(ids, NEW_TOKENS, ignore_eos=True).ids, repr(prompt))


def test_chunked_prefill_of_a_long_prompt_matches_hf(both):
  """A prompt of 5 chunks (64 tokens each; the last one padded) through the engine's chunked prefill, on
  both kernel paths, against HF on the same prompt."""
  tok = both["tok"]
  ids = tok.encode(LONG_TEXT)[:300]
  for kernels in ("xla", "ffi"):
    engine = Engine(both["config"], both["wf"], tok, max_context=512, kernels=kernels, dtype=jnp.float32,
                    prefill_chunk=64)
    ours = engine.generate(ids, NEW_TOKENS, ignore_eos=True).ids
    assert ("extend", 1, 64) in engine.executables()
    _check_against_hf(both, ids, ours, f"300-token prompt in chunks of 64, {kernels} path")


def _our_logits(config, weights, ids):
  cache = create_cache(config, 1, len(ids), jnp.float32)
  out, _ = sequence_logits(config, weights, cache, jnp.asarray([ids], jnp.int32), jnp.zeros((1,), jnp.int32))
  return np.asarray(out[0])


@pytest.fixture(scope="module")
def teacher_forced(both):
  ids = both["tok"].encode(LONG_TEXT)
  assert len(ids) >= 257
  with torch.no_grad():
    hf_logits = both["hf"](torch.tensor([ids])).logits[0].numpy()
  wq = load_weights(both["gf"], quant="w8a16", dtype=jnp.float32, progress=False)
  return dict(ids=ids, hf=hf_logits, ours=_our_logits(both["config"], both["wf"], ids),
              quant=_our_logits(both["config"], wq, ids), wq=wq)


def test_teacher_forced_agreement_with_hf(both, teacher_forced):
  ours, hf = teacher_forced["ours"], teacher_forced["hf"]
  agree = float(np.mean(ours.argmax(-1) == hf.argmax(-1)))
  rel = float(np.linalg.norm(ours - hf) / np.linalg.norm(hf))
  print(f"{both['name']}: float vs HF over {len(ours)} positions: top-1 agreement {agree:.4f}, rel err {rel:.2e}")
  assert len(ours) >= 256 and agree >= 0.99


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _agreement(ref, got):
  """Top-1 agreement, relative L2 error of the logits and mean KL(ref || got) in nats over the rows."""
  agree = float(np.mean(ref.argmax(-1) == got.argmax(-1)))
  rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
  lr, lg = _log_softmax(ref.astype(np.float64)), _log_softmax(got.astype(np.float64))
  return agree, rel, float(np.mean(np.sum(np.exp(lr) * (lr - lg), axis=-1)))


def test_w8a16_agreement_with_float(both, teacher_forced):
  agree, rel, kl = _agreement(teacher_forced["ours"], teacher_forced["quant"])
  print(f"{both['name']}: W8A16 vs float over {len(teacher_forced['ours'])} positions: top-1 agreement "
        f"{agree:.4f}, logits rel err {rel:.4f}, mean KL {kl:.5f} nats")
  assert agree >= 0.95 and rel < 0.1 and kl < 0.05


def test_fused_decode_agrees_with_hf(both, teacher_forced, lab_switches):
  """The fused decode step (the GPU's decode path; lab switch JAXLLM_FUSED_CPU=1 runs it on the CPU's fused handlers),
  W8A16, fed the text one token at a time after a 64-token prompt, against HF's float logits at the same
  positions: within test_w8a16_agreement_with_float's bounds."""
  import jax
  from jaxllm.kernels import fused
  from jaxllm.model import forward_decode_fused
  lab_switches.setenv("JAXLLM_FUSED_CPU", "1")
  config, wq, ids = both["config"], teacher_forced["wq"], teacher_forced["ids"]
  prompt, steps = 64, 128
  cache = create_cache(config, 1, prompt + steps + 1, jnp.float32)
  assert fused.fused_decode_reason(config, wq, cache, 1) is None, fused.fused_decode_reason(config, wq, cache, 1)
  _, cache = sequence_logits(config, wq, cache, jnp.asarray([ids[:prompt]], jnp.int32), jnp.zeros((1,), jnp.int32),
                             kernels="ffi")

  def step(weights, cache, token, pos):
    x, cache = forward_decode_fused(config, weights, cache, token, pos, jnp.ones((1,), bool))
    return fused.norm_linear(x, weights.out_norm, config.rms_eps, weights.head, dtype=cache.compute_dtype), cache
  run = jax.jit(step, donate_argnums=(1,))
  rows = []
  for pos in range(prompt, prompt + steps):
    out, cache = run(wq, cache, jnp.asarray([ids[pos]], jnp.int32), jnp.full((1,), pos, jnp.int32))
    rows.append(np.asarray(out[0], np.float32))
  agree, rel, kl = _agreement(teacher_forced["hf"][prompt:prompt + steps], np.stack(rows))
  print(f"{both['name']}: fused decode (W8A16) vs HF over {steps} steps: top-1 agreement {agree:.4f}, "
        f"logits rel err {rel:.4f}, mean KL {kl:.5f} nats")
  assert agree >= 0.95 and rel < 0.1 and kl < 0.05
