"""Building the Weights pytree: from a GGUF file (dequantize, fuse, re-quantize) or at random.

Matrices are fused where the model multiplies the same input by several of them (q/k/v, gate/up) and
stacked over layers, then quantized in groups of 64 inputs (jaxllm.quant). `quant="gguf"` keeps the file's
own blocks instead wherever a tensor is Q4_0, Q4_1, Q5_0, Q5_1 (jaxllm.quant.LowBit, exact), Q4_K (LowBit,
its scale products rounded to f16) or Q6_K (jaxllm.quant.Q6K, exact), W8A16 elsewhere; a matrix whose
layers differ (llama.cpp's Q4_K_M makes half the ffn_down layers Q6_K, the others Q4_K, some attn_v Q8_0)
becomes a jaxllm.quant.Mixed stack of such pieces (plan_pieces); `quant="auto"` is "gguf" on the CPU (whose decode is bound by
the bytes it reads) and "w8a16" on the GPU (whose fused kernels take W8A16). `quant="none"` keeps them
float for reference runs.

Loading streams: each stacked matrix is converted one layer at a time into a preallocated int8 array and
its scales (the embedding and head likewise), in blocks of rows that threads convert at once
(cores.pool_threads), so the float working set is a few blocks' floats, and each finished array goes to the
device before the next is built. The file's pages are released as they are read. Peak host memory: the
converted weights plus those blocks (plus, on the CPU, where the device is host memory, the device copy of
what is already done).
"""
from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import Config
from jaxllm.cores import pool_threads
from jaxllm.gguf import GGUFFile
from jaxllm.model import Weights
from jaxllm.quant import (GROUP, LOWBIT_BITS, LOWBIT_GROUP, Q6K, Linear, LowBit, Mixed, implicit_min_stack,
                          lowbit_bits, lowbit_from_blocks, q6k_from_blocks, quantize_int8)
from jaxllm.rope import llama3_rope_freqs

QUANT_CHOICES = ("auto", "w8a16", "gguf", "none")
BLOCK = 1 << 22    # the float elements one conversion task reads and converts (16 MB in float32)


def _row_blocks(rows: int, k: int) -> list[tuple[int, int]]:
  """[r0, r1) row ranges of about BLOCK elements covering `rows` rows of k."""
  step = max(1, BLOCK // k)
  return [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]


def _check_quant(quant: str) -> None:
  if quant not in QUANT_CHOICES:
    raise ValueError(f"quant must be one of {QUANT_CHOICES}, got {quant!r}")


def resolve_quant(quant: str, tensor_parallel: bool = False) -> str:
  """The quantization "auto" means on the default backend: "gguf" on the CPU, "w8a16" elsewhere; under
  tensor parallel "w8a16" everywhere (jaxllm.parallel splits W8A16 or float weights, not the CPU's blocks)."""
  _check_quant(quant)
  if quant != "auto":
    return quant
  return "gguf" if jax.default_backend() == "cpu" and not tensor_parallel else "w8a16"


def _layer_parts(c: Config) -> dict[str, tuple[str, ...]]:
  """Stacked weight -> the GGUF tensors of one layer it concatenates (rows of q, k, v, and gate, up)."""
  parts = {"attn_norm": ("attn_norm.weight",), "wqkv": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
           "wo": ("attn_output.weight",), "ffn_norm": ("ffn_norm.weight",),
           "w_gate_up": ("ffn_gate.weight", "ffn_up.weight"), "w_down": ("ffn_down.weight",)}
  if c.qkv_bias:
    parts["bqkv"] = ("attn_q.bias", "attn_k.bias", "attn_v.bias")
  if c.qk_norm:
    parts["q_norm"] = ("attn_q_norm.weight",)
    parts["k_norm"] = ("attn_k_norm.weight",)
  return parts


MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")


def plan_pieces(types: dict[int, list[tuple[str, str]]]) -> list[list[tuple[tuple, list[str]]]]:
  """How quant "gguf" holds a stacked matrix, layer by layer: types[i] is layer i's tensors (name, GGUF type)
  in row order. Consecutive tensors that LowBit holds (jaxllm.quant.LOWBIT_BITS) form one LowBit piece,
  consecutive Q6_K ones a Q6K piece, the others one W8A16 piece. Returns, per layer, its pieces as (kind,
  tensor names); kind = (position in the layer, ("lowbit", bits, store_min), ("q6k", 6, False) or ("w8a16",
  0, False), tensor names): the layers of one kind share a stack."""
  def held(ggml_type: str) -> str:
    return "lowbit" if ggml_type in LOWBIT_BITS else "q6k" if ggml_type == "Q6_K" else "w8a16"
  plan = []
  for i in sorted(types):
    runs: list[list[tuple[str, str]]] = []
    for t, ggml_type in types[i]:
      if runs and held(runs[-1][0][1]) == held(ggml_type):
        runs[-1].append((t, ggml_type))
      else:
        runs.append([(t, ggml_type)])
    pieces = []
    for at, run in enumerate(runs):
      names, kinds = [t for t, _ in run], [k for _, k in run]
      bits = lowbit_bits(kinds)
      how = (("lowbit", bits, not implicit_min_stack(kinds, bits)) if bits is not None else
             ("q6k", 6, False) if held(kinds[0]) == "q6k" else ("w8a16", 0, False))
      pieces.append(((at, how, tuple(names)), names))
    plan.append(pieces)
  return plan


def progress_total(c: Config) -> int:
  """The units convert() reports progress in: layers of each stacked array, rows of the embedding/head."""
  return len(_layer_parts(c)) * c.n_layers + c.vocab_size * (1 if c.tied_embeddings else 2)


def convert(gf: GGUFFile, quant: str = "w8a16", dtype=jnp.float32,
            on_progress: Callable[[int], None] | None = None,
            sink: Callable[[str, np.ndarray], object] | None = None) -> dict[str, object]:
  """The model's arrays by name ("wqkv.w", "wqkv.scale", "attn_norm", ...), built one at a time on the host.

  Matrices become int8 with float32 scales (quant "w8a16") or stay float in `dtype` (quant "none");
  norms and biases are float32. Each finished array goes to sink(name, array), whose result is what the
  dict holds (default: the host array itself; e.g. jnp.asarray to move it to the device at once, so its
  host copy can go). on_progress(n) reports n more units of progress_total(config) done (a layer of a
  stacked array, or rows of the embedding or head) as each is done. The tied
  head is not repeated ("head.*" absent when the config ties it).
  """
  quant = resolve_quant(quant)
  c = gf.config
  out: dict[str, object] = {}
  float_dtype = jnp.dtype(dtype) if quant == "none" else None

  def done(name, array):
    out[name] = array if sink is None else sink(name, array)
  parts = _layer_parts(c)

  def layer_rows(name: str, i: int) -> np.ndarray:
    rows = [gf.tensor(f"blk.{i}.{t}") for t in parts[name]]
    for t in parts[name]:
      gf.release(f"blk.{i}.{t}")
    return rows[0] if len(rows) == 1 else np.concatenate(rows)

  def lowbit_matrix(name: str) -> bool:
    """Converts matrix `name` layer by layer as plan_pieces says: one LowBit or W8A16 stack where every layer
    is alike, else a Mixed stack ("name.p<k>.*" parts, "name.layout"). False, nothing kept, where it has no
    LowBit piece or a scale or min overflows f16 (the whole matrix is then W8A16, as with quant "w8a16";
    the pages released so far are read again from the file)."""
    plan = plan_pieces({i: [(t, gf.tensor_type(f"blk.{i}.{t}")) for t in parts[name]] for i in range(c.n_layers)})
    if all(kind[1][0] == "w8a16" for pieces in plan for kind, _ in pieces):
      return False
    keys = sorted({kind for pieces in plan for kind, _ in pieces}, key=str)
    count = {k: sum(kind == k for pieces in plan for kind, _ in pieces) for k in keys}
    stacks: dict[tuple, list[np.ndarray]] = {}
    layout = np.full((c.n_layers, max(len(p) for p in plan), 2), -1, np.int32)   # [L, pieces, (part, index)]
    for i, pieces in enumerate(plan):
      for at, (kind, tensors) in enumerate(pieces):
        how, bits, store_min = kind[1]
        if how == "lowbit":
          arrays = []
          for t in tensors:
            a = lowbit_from_blocks(gf.tensor_blocks(f"blk.{i}.{t}"), gf.tensor_type(f"blk.{i}.{t}"), bits, store_min)
            if a is None:
              return False
            arrays.append(a)
          arrays = [np.concatenate(a) for a in zip(*arrays)]
        elif how == "q6k":
          arrays = [np.concatenate(a) for a in zip(*(q6k_from_blocks(gf.tensor_blocks(f"blk.{i}.{t}")) for t in tensors))]
        else:
          arrays = list(quantize_int8(np.concatenate([gf.tensor(f"blk.{i}.{t}") for t in tensors])))
        p = keys.index(kind)
        if kind not in stacks:
          stacks[kind] = [np.empty((count[kind], *a.shape), a.dtype) for a in arrays]
        j = int(np.sum(layout[:i, :, 0] == p))
        for dst, a in zip(stacks[kind], arrays):
          dst[j] = a
        layout[i, at] = (p, j)
      for t in parts[name]:
        gf.release(f"blk.{i}.{t}")
    if on_progress:
      on_progress(c.n_layers)
    for p, kind in enumerate(keys):
      fields = {"lowbit": ("q", "high", "scale", "min"), "q6k": ("ql", "qh", "sc", "d")}.get(kind[1][0], ("w", "scale"))
      prefix = name if len(keys) == 1 else f"{name}.p{p}"
      for field, a in zip(fields, stacks[kind]):
        done(f"{prefix}.{field}", a)
    if len(keys) > 1:
      done(f"{name}.layout", layout)
    return True

  def put(tensor: str, r0: int, r1: int, w: np.ndarray, s: np.ndarray | None) -> int:
    """Rows [r0, r1) of a tensor into w (float) or w and its scales s (int8); returns the rows done."""
    rows = gf.tensor_rows(tensor, r0, r1)
    if s is None:
      w[...] = rows.astype(w.dtype)
    else:
      w[...], s[...] = quantize_int8(rows)
    return r1 - r0

  def new_matrix(n: int, k: int, layers: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray | None]:
    if quant == "none":
      return np.empty((*layers, n, k), float_dtype), None
    return np.empty((*layers, n, k), np.int8), np.empty((*layers, n, k // GROUP), np.float32)

  def done_matrix(name: str, w: np.ndarray, s: np.ndarray | None) -> None:
    done(name + ".w", w)
    if s is not None:
      done(name + ".scale", s)

  # numpy's dequantizing and quantizing release the GIL, so the conversion scales with the cores (a 7B Q8_0 file
  # took 109 s on one); each thread holds a block's floats and their temporaries (~100 MB).
  with ThreadPoolExecutor(pool_threads()) as pool:
    def blocks(tensor: str, at: int, w: np.ndarray, s: np.ndarray | None) -> list:
      """Tasks converting the tensor's rows, in blocks, into rows at.. of w and s."""
      rows, k = gf.tensor_shape(tensor)
      return [pool.submit(put, tensor, r0, r1, w[at + r0:at + r1], None if s is None else s[at + r0:at + r1])
              for r0, r1 in _row_blocks(rows, k)]

    for name in parts:
      if name in MATRICES and quant == "gguf" and lowbit_matrix(name):
        continue
      if name in MATRICES:
        heights = [gf.tensor_shape(f"blk.0.{t}")[0] for t in parts[name]]        # rows of q, k, v (gate, up)
        offsets = np.cumsum([0] + heights[:-1]).tolist()                        # where each starts in the fusion
        w, s = new_matrix(sum(heights), gf.tensor_shape(f"blk.0.{parts[name][0]}")[1], (c.n_layers,))
        for i in range(c.n_layers):
          tasks = [job for t, at in zip(parts[name], offsets)
                   for job in blocks(f"blk.{i}.{t}", at, w[i], None if s is None else s[i])]
          for task in tasks:
            task.result()
          for t in parts[name]:
            gf.release(f"blk.{i}.{t}")
          if on_progress:
            on_progress(1)
        done_matrix(name, w, s)
      else:
        first = layer_rows(name, 0)
        v = np.empty((c.n_layers, *first.shape), np.float32)
        for i in range(c.n_layers):
          v[i] = first if i == 0 else layer_rows(name, i)
        done(name, v)
        if on_progress:
          on_progress(c.n_layers)
    heads = ["token_embd.weight"] + ([] if c.tied_embeddings else ["output.weight"])
    for tensor, name in zip(heads, ("embed", "head")):
      w, s = new_matrix(*gf.tensor_shape(tensor))
      for task in blocks(tensor, 0, w, s):
        rows = task.result()
        if on_progress:
          on_progress(rows)
      gf.release(tensor)
      done_matrix(name, w, s)
  done("out_norm", gf.tensor("output_norm.weight"))
  if "rope_freqs.weight" in gf:
    done("rope_freqs", gf.tensor("rope_freqs.weight"))
  return out


def assemble(arrays: dict[str, object]) -> Weights:
  """The Weights pytree from named arrays (convert's, or the model cache's), put on the device where they
  are not yet; each is dropped from `arrays` once it is there, so a host copy can be freed. jax.device_put, not
  jnp.asarray: on jax 0.10-0.11 jnp.asarray of a numpy array runs a compiled copy program, one compile for
  each new shape (13 for a 2-layer model)."""
  def take(name):
    return jax.device_put(arrays.pop(name)) if name in arrays else None

  def linear(name):
    if name + ".layout" in arrays:
      layout = np.asarray(arrays.pop(name + ".layout"))
      n_parts = int(layout[..., 0].max()) + 1
      return Mixed(parts=tuple(linear(f"{name}.p{p}") for p in range(n_parts)),
                   layout=tuple(tuple((int(p), int(j)) for p, j in row if p >= 0) for row in layout))
    if name + ".ql" in arrays:
      return Q6K(ql=take(name + ".ql"), qh=take(name + ".qh"), sc=take(name + ".sc"), d=take(name + ".d"))
    if name + ".q" in arrays:
      return LowBit(q=take(name + ".q"), high=take(name + ".high"), scale=take(name + ".scale"),
                    min=take(name + ".min"))
    w = take(name + ".w")
    return None if w is None else Linear(w=w, scale=take(name + ".scale"))

  embed = linear("embed")
  head = linear("head")
  return Weights(embed=embed, attn_norm=take("attn_norm"), wqkv=linear("wqkv"), wo=linear("wo"),
                 ffn_norm=take("ffn_norm"), w_gate_up=linear("w_gate_up"), w_down=linear("w_down"),
                 out_norm=take("out_norm"), head=embed if head is None else head, bqkv=take("bqkv"),
                 q_norm=take("q_norm"), k_norm=take("k_norm"), rope_freqs=take("rope_freqs"))


def load_weights(gf: GGUFFile, quant: str = "w8a16", dtype=jnp.float32, progress: bool = True) -> Weights:
  """Reads, fuses and quantizes the model's weights (see convert) and puts them on the device.

  Args:
    gf: an open GGUF file.
    quant: "auto", "w8a16" (int8 weights, group scales), "gguf" (the file's own blocks where jaxllm holds
      their type, else W8A16) or "none" (float weights in `dtype`).
    dtype: activation dtype; float weights are stored in it.
    progress: show a progress bar over the conversion.
  """
  from tqdm.auto import tqdm
  c = gf.config
  with tqdm(total=progress_total(c), desc=f"convert {c.arch}", unit="row", disable=None if progress else True,
            leave=False) as bar:
    arrays = convert(gf, quant, dtype, bar.update, sink=lambda name, a: jax.device_put(a))
  return assemble(arrays)


_SLICE = 1 << 21     # elements a random integer array is drawn in at a time (arrays of more than 16 slices)


@functools.partial(jax.jit, static_argnames=("shape", "lo", "hi", "dtype", "slices"))
def _randint_sliced(key: jax.Array, shape: tuple[int, ...], lo: int, hi: int, dtype, slices: int) -> jax.Array:
  """Uniform integers in [lo, hi) of `shape`, drawn as `slices` equal row blocks one after another in a loop."""
  rows = int(np.prod(shape[:-1])) // slices
  draw = lambda k: jax.random.randint(k, (rows, shape[-1]), lo, hi, jnp.int32).astype(dtype)
  return jax.lax.map(draw, jax.random.split(key, slices)).reshape(shape)


def _randint(key: jax.Array, shape: tuple[int, ...], lo: int, hi: int, dtype) -> jax.Array:
  """jax.random.randint(key, shape, lo, hi) as `dtype`, with a peak near the result's bytes: JAX's threefry draws
  32 bits an element and holds several such arrays while it does, so drawing a 1.5B shape's weights whole peaked
  at 18.8 GB of memory for a 1.9 GB model (on the GPU, a 7B's at ~21 GB, which the bench reported as the
  model's peak). A large array is drawn in row blocks of about _SLICE elements (the fewest that divide its rows;
  a row a block where rows are longer than that)."""
  size, rows = int(np.prod(shape)), int(np.prod(shape[:-1]))
  if size <= 16 * _SLICE:
    return jax.random.randint(key, shape, lo, hi, jnp.int32).astype(dtype)
  slices = next((b for b in range(-(-size // _SLICE), rows + 1) if rows % b == 0), rows)
  return _randint_sliced(key, tuple(shape), lo, hi, dtype, slices)


def random_weights(config: Config, seed: int = 0, quant: str = "w8a16", dtype=jnp.bfloat16) -> Weights:
  """Random weights of the model's real shapes, made on the device (for benchmarks: same cost to run).

  Float weights are N(0, 0.02) like a freshly initialized model; norms are 1. quant "gguf" makes the
  layers' matrices 4-bit LowBit (the bytes of a Q4_1 file), the embedding and head W8A16.
  """
  quant = resolve_quant(quant)
  c = config
  keys = iter(jax.random.split(jax.random.PRNGKey(seed), 16))

  def lin(*shape, layers=False):
    if quant == "gguf" and layers:
      *lead, n, k = shape
      g = k // LOWBIT_GROUP
      q = _randint(next(keys), (*lead, n, k // 2), 0, 256, jnp.uint8)
      return LowBit(q=q, high=jnp.zeros((*lead, n, 0), jnp.uint32),
                    scale=jnp.full((*lead, n, g), 0.02 / 4.6, jnp.float16),   # std of U{0..15} ~ 4.6
                    min=jnp.full((*lead, n, g), -0.02 * 7.5 / 4.6, jnp.float16))
    if quant == "none":
      return Linear(w=(0.02 * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype))
    q = _randint(next(keys), shape, -127, 128, jnp.int8)
    groups = (*shape[:-1], shape[-1] // GROUP)
    return Linear(w=q, scale=jnp.full(groups, 0.02 / 73.0, jnp.float32))  # std of U(-127,127) ~ 73

  L, qkv = c.n_layers, c.q_dim + 2 * c.kv_dim
  embed = lin(c.vocab_size, c.d_model)
  return Weights(
      embed=embed,
      attn_norm=jnp.ones((L, c.d_model), jnp.float32),
      wqkv=lin(L, qkv, c.d_model, layers=True),
      wo=lin(L, c.d_model, c.q_dim, layers=True),
      ffn_norm=jnp.ones((L, c.d_model), jnp.float32),
      w_gate_up=lin(L, 2 * c.d_ff, c.d_model, layers=True),
      w_down=lin(L, c.d_model, c.d_ff, layers=True),
      out_norm=jnp.ones((c.d_model,), jnp.float32),
      head=embed if c.tied_embeddings else lin(c.vocab_size, c.d_model),
      bqkv=0.02 * jax.random.normal(next(keys), (L, qkv), jnp.float32) if c.qkv_bias else None,
      q_norm=jnp.ones((L, c.head_dim), jnp.float32) if c.qk_norm else None,
      k_norm=jnp.ones((L, c.head_dim), jnp.float32) if c.qk_norm else None,
      rope_freqs=llama3_rope_freqs(c) if c.rope_scaling == "llama3" else None,
  )
