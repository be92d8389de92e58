"""Which kernels the GPU's decode step launches, read from a device trace (CUPTI through jax.profiler, by
bench/step_profile.py's reader). Tokens cannot say which kernel ran: a dispatch that fell back to another
kernel (the GEMV at batch 64, XLA's dot at batch 1) gives the same ones, only slower. At the 0.5B and 7B
shapes (2 layers, the real vocabulary, so that the LM head takes its own kernel): at batch 1 the fused step,
per layer the one-kernel attention (with the QKV epilogue as its prologue) and four W8A16 GEMVs, then the
head's kernel (its own at 0.5B, a fifth GEMV at 7B); at batch 8 and 64 the tensor-core kernel for each layer's
four matmuls and the head."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = 2


def _step_profile():
  """bench/step_profile.py as a module, loaded from its file (bench/ stays off sys.path: test_scaling.py)."""
  spec = importlib.util.spec_from_file_location("step_profile", ROOT / "bench" / "step_profile.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _launches(name: str, batches, tmp_path) -> dict[int, dict[str, float]]:
  """{batch: {kernel: launches a step}} over 16 traced steps of each batch, on one engine."""
  from jaxllm.engine import Engine
  from jaxllm.presets import preset
  from jaxllm.weights import random_weights
  sp = _step_profile()
  config = preset(name).replace(n_layers=LAYERS)
  engine = Engine(config, random_weights(config, seed=3, quant="w8a16"), None, max_context=96, kernels="auto")
  prompt = [int(t) for t in np.random.default_rng(0).integers(0, config.vocab_size, 24)]
  out = {}
  for b in batches:
    summary = sp.profile(engine, b, prompt, 16, str(tmp_path / f"b{b}"))
    assert summary is not None, "the trace holds no device kernels"
    out[b] = {r["kernel"]: r["per_token"] for r in summary["rows"]}
  return out


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen2.5-7b"])
def test_each_batch_launches_the_kernels_its_shape_was_tuned_for(name, tmp_path):
  got = _launches(name, (1, 8, 64), tmp_path)
  # cuBLAS/cutlass kernel names (nvjet on Hopper, xmma, gemm, gemv, cutlass)
  library = ("gemm", "gemv", "cutlass", "nvjet", "xmma")
  gemm = {b: {k: v for k, v in kernels.items() if any(s in k.lower() for s in library)}
          for b, kernels in got.items()}
  assert gemm == {1: {}, 8: {}, 64: {}}, "XLA's matmuls ran where jaxllm's kernels should"
  one = got[1]
  assert one.get("jaxllm::attn1::Kernel") == LAYERS, one
  # The head on resident blocks (HeadKernel) where a warp's loads cover a row of K <= 2048 (0.5B); at 7B (K 3584)
  # the staged GEMV, a warp per 4 rows (w8a16::Dispatch's StreamFits<4>).
  from jaxllm.presets import preset
  resident = preset(name).d_model <= 2048
  # the layers call's kernels only: no QKV epilogue kernel of the per-op path, no other jaxllm kernel
  head = {"jaxllm::w8a16::HeadKernel"} if resident else set()
  ours = {k for k in one if k.startswith("jaxllm::")}
  assert ours == {"jaxllm::attn1::Kernel", "jaxllm::w8a16::Kernel"} | head, one
  assert one.get("jaxllm::w8a16::Kernel") == 4 * LAYERS + (0 if resident else 1), one
  assert one.get("jaxllm::w8a16::HeadKernel") == (1 if resident else None), one
  assert "jaxllm::w8a16::mma::Kernel" not in one, one
  for b in (8, 64):
    assert got[b].get("jaxllm::w8a16::mma::Kernel") == 4 * LAYERS + 1, (b, got[b])
    assert "jaxllm::w8a16::Kernel" not in got[b], (b, got[b])
