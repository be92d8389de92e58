"""The server on a real model, smollm2-135m (downloaded: marked network): concurrent chat streams on 2 slots,
each equal to the same request run alone, and an answer that makes sense."""
import asyncio

import openai
import pytest

from jaxllm import SamplingParams, load
from test_serve import serve_model

pytestmark = pytest.mark.network


@pytest.fixture(scope="module")
def served():
  config, weights, tok = load("smollm2-135m", progress=False)
  s = serve_model(config, weights, tok, slots=2, max_context=512, prefill_chunk=32, name="smollm2-135m")
  yield s
  s.stop()


def test_concurrent_chats_equal_to_alone(served):
  questions = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?",
               "Write one sentence about the sea.", "Who wrote Hamlet?", "Say hello in Spanish."]
  cases = []
  for i, q in enumerate(questions):
    messages = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": q}]
    sampled = i % 3 == 2
    params = SamplingParams(temperature=0.7, top_p=0.9) if sampled else SamplingParams()
    kw = {"temperature": 0.7, "top_p": 0.9, "seed": 5} if sampled else {"temperature": 0}
    cases.append((messages, kw, served.reference(served.chat_ids(messages), 24, params, seed=5 if sampled else 0)))
  client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)

  async def one(messages, kw):
    stream = await client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=24, stream=True,
                                                  **kw)
    parts = [(c.choices[0].delta.content or "", c.choices[0].finish_reason) async for c in stream]
    return "".join(p[0] for p in parts), [p[1] for p in parts if p[1]]

  async def run():
    return await asyncio.gather(*(one(m, kw) for m, kw, _ in cases))
  for (messages, _, (text, reason)), (got, reasons) in zip(cases, asyncio.run(run())):
    assert (got, reasons) == (text, [reason]), messages[-1]
  assert "Paris" in cases[0][2][0]
