"""Tensor-parallel decode over the devices of one host: the layers run sharded under `jax.shard_map`, and XLA
inserts the collectives (NCCL on GPUs).

The layout (Megatron's), N shards on the mesh axis AXIS:
- QKV column-parallel: shard s holds its H/N query heads and the key/value heads they read: G/N of them, or,
  when G < N, the one they share (held by N/G shards: replicated). Rows are reordered [q_s, k_s, v_s] shard
  after shard, so each shard's block is one contiguous slice (bqkv alike).
- O row-parallel (its input columns by query head) and one psum; gate/up column-parallel (rows reordered
  [gate_s, up_s]), down row-parallel and one psum.
- The embedding and the LM head vocabulary-parallel (V/N rows each): a lookup reads the shard's rows and a psum
  adds the one shard that holds the token. A greedy decode step without penalties, masks or biases takes each
  shard's argmax and reduces those (TensorParallel.greedy); otherwise (and for a prompt's first token) the
  logits are all-gathered, so the sampler sees the whole vocabulary as on one device. A tied head is the same
  sharded arrays.
- The KV cache [L, B, N * G_local, S, Dh] sharded by KV head (G_local = max(G/N, 1)).
- Norm weights, RoPE and the residual stream replicated; each shard runs the ordinary layer code (the FFI
  kernels included) on its slices, with a config of its local sizes (`TensorParallel.local`).

A Weights made by shard_weights() carries its TensorParallel (a static field); model.forward and model.logits
hand such weights to it. W8A16 and float weights only (the CPU's 4/5/6-bit blocks are not split).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxllm.cache import KVCache
from jaxllm.config import Config
from jaxllm.model import Weights, embed, forward as model_forward, logits as model_logits
from jaxllm.quant import GROUP, Linear

AXIS = "tp"


def make_mesh(n: int, devices=None) -> Mesh:
  """A one-axis mesh (AXIS) over the first n devices (of `devices`, default jax.devices())."""
  devices = list(jax.devices() if devices is None else devices)
  if not 1 <= n <= len(devices):
    hint = ""
    if devices and devices[0].platform == "cpu" and n > len(devices):    # the CPU's simulated devices
      hint = f" (on the CPU, XLA_FLAGS=--xla_force_host_platform_device_count={n} makes {n})"
    raise ValueError(f"tensor parallel over {n} devices needs 1 to {len(devices)} (the devices present), got {n}"
                     + hint)
  return Mesh(np.array(devices[:n]), (AXIS,))


@dataclasses.dataclass(frozen=True)
class TensorParallel:
  """How a model is split over a mesh: the global config and each shard's (local) sizes."""
  mesh: Mesh
  config: Config    # the model's
  local: Config     # one shard's: H/N query heads, G_local KV heads, F/N feed-forward (vocabulary: the model's)

  @property
  def n(self) -> int:
    return self.mesh.shape[AXIS]

  def forward(self, config: Config, weights: Weights, cache: KVCache, tokens, start, valid=None, *,
              kernels: str = "xla", layers: str | None = None):
    """model.forward on the mesh: hidden [B, T, D] f32 (replicated) and the sharded cache."""
    w_specs, c_specs = weight_specs(weights), cache_specs(cache)
    local = self.local

    def body(w, c, tokens, start, valid):
      w = dataclasses.replace(w, tp=None)
      return model_forward(local, w, c, tokens, start, valid, kernels=kernels, layers=layers,
                           embed_fn=_embed_shard, reduce=_psum)

    fn = jax.shard_map(body, mesh=self.mesh, in_specs=(w_specs, c_specs, P(), P(), P()),
                       out_specs=(P(), c_specs), check_vma=False)
    return fn(weights, cache, tokens, start, valid)

  def _on_head(self, weights: Weights, hidden, dtype, kernels: str, finish, out_specs):
    """finish(each shard's logits [..., V/N] f32 of hidden [..., D]) under shard_map over the vocabulary-parallel
    head: finish's collectives make its outputs the same on every shard (out_specs replicated)."""
    def body(head, hidden):
      return finish(model_logits(dataclasses.replace(weights, head=head, tp=None), hidden, dtype, kernels=kernels))
    fn = jax.shard_map(body, mesh=self.mesh, in_specs=(_vocab_spec(weights.head), P()), out_specs=out_specs,
                       check_vma=False)
    return fn(weights.head, hidden)

  def logits(self, weights: Weights, hidden, dtype, *, kernels: str = "xla"):
    """model.logits on the mesh: each shard's V/N logits, all-gathered to [..., V] f32 (replicated)."""
    return self._on_head(weights, hidden, dtype, kernels,
                         lambda local: jax.lax.all_gather(local, AXIS, axis=local.ndim - 1, tiled=True), P())

  def greedy(self, weights: Weights, hidden, dtype, *, kernels: str = "xla"):
    """The greedy tokens of hidden [B, D], vocabulary-parallel: (ids [B] int32, whether each row's logits are all
    finite [B] bool). Each shard takes the argmax of its V/N logits; all-gathers bring every shard's
    (largest logit, its id, all finite) [B] to each, and the token is the lowest id among the maxima equal to the
    largest (jnp.argmax's first maximum, as on one device): 3 x [B] values a shard cross the devices, where
    logits() gathers [B, V]."""
    def finish(local):
      at = jnp.argmax(local, axis=-1)                                              # [B], within the shard
      best = jnp.take_along_axis(local, at[:, None], axis=-1)[:, 0]
      ids = (at + jax.lax.axis_index(AXIS) * local.shape[-1]).astype(jnp.int32)
      best, ids, finite = jax.lax.all_gather((best, ids, jnp.all(jnp.isfinite(local), axis=-1)), AXIS)  # [N, B]
      top = jnp.max(best, axis=0)
      token = jnp.min(jnp.where(best == top, ids, jnp.iinfo(jnp.int32).max), axis=0)
      return token, jnp.all(finite, axis=0)
    return self._on_head(weights, hidden, dtype, kernels, finish, (P(), P()))


def _psum(x):
  return jax.lax.psum(x, AXIS)


def _embed_shard(weights: Weights, tokens):
  """embed() of a vocabulary shard: the shard holding a token gives its row, the others zeros; summed."""
  rows = weights.embed.w.shape[0]
  local = tokens - jax.lax.axis_index(AXIS) * rows
  held = (local >= 0) & (local < rows)
  x = embed(weights, jnp.where(held, local, 0))
  return jax.lax.psum(jnp.where(held[..., None], x, 0.0), AXIS)


def plan(config: Config, mesh: Mesh) -> TensorParallel:
  """The split of `config` over `mesh`; a ValueError saying what does not divide."""
  n = mesh.shape[AXIS]
  c = config
  problems = []
  if c.n_heads % n:
    problems.append(f"{c.n_heads} query heads")
  if c.n_kv_heads % n and n % c.n_kv_heads:
    problems.append(f"{c.n_kv_heads} key/value heads (nor does {n} divide by them)")
  if c.d_ff % n or (c.d_ff // n) % GROUP:
    problems.append(f"the feed-forward width {c.d_ff} into multiples of {GROUP}")
  if c.vocab_size % n:
    problems.append(f"the vocabulary of {c.vocab_size}")
  if not c.n_heads % n and (c.q_dim // n) % GROUP:
    problems.append(f"the query width {c.q_dim} into multiples of {GROUP}")
  if problems:
    raise ValueError(f"tensor parallel over {n} devices needs each split evenly; {n} does not divide "
                     + ", ".join(problems))
  local = c.replace(n_heads=c.n_heads // n, n_kv_heads=max(c.n_kv_heads // n, 1), d_ff=c.d_ff // n)
  return TensorParallel(mesh=mesh, config=config, local=local)


def kv_heads_of(tp: TensorParallel, shard: int) -> list[int]:
  """The key/value heads shard `shard` holds: its G/N, or the one its query heads share when G < N."""
  c, g = tp.config, tp.local.n_kv_heads
  if c.n_kv_heads >= tp.n:
    return list(range(shard * g, (shard + 1) * g))
  return [shard * c.n_kv_heads // tp.n]


def _qkv_rows(tp: TensorParallel) -> np.ndarray:
  """Rows of the fused QKV weight, in the sharded order: [q_s, k_s, v_s] for s = 0 .. N-1."""
  c, dh, hl = tp.config, tp.config.head_dim, tp.local.n_heads
  rows = []
  for s in range(tp.n):
    rows.append(np.arange(s * hl * dh, (s + 1) * hl * dh))
    for base in (c.q_dim, c.q_dim + c.kv_dim):
      rows += [base + np.arange(j * dh, (j + 1) * dh) for j in kv_heads_of(tp, s)]
  return np.concatenate(rows)


def _gate_up_rows(tp: TensorParallel) -> np.ndarray:
  """Rows of the fused gate/up weight, in the sharded order: [gate_s, up_s] for s = 0 .. N-1."""
  f, fl = tp.config.d_ff, tp.local.d_ff
  return np.concatenate([np.arange(base + s * fl, base + (s + 1) * fl) for s in range(tp.n) for base in (0, f)])


def _take_rows(lin: Linear, rows: np.ndarray) -> Linear:
  idx = jnp.asarray(rows)
  return Linear(w=jnp.take(lin.w, idx, axis=-2), scale=None if lin.scale is None else jnp.take(lin.scale, idx, axis=-2))


def _vocab_spec(lin: Linear) -> Linear:
  return Linear(w=P(AXIS, None), scale=None if lin.scale is None else P(AXIS, None))


def _column_spec(lin: Linear) -> Linear:      # [L, N, K]: outputs split
  return Linear(w=P(None, AXIS, None), scale=None if lin.scale is None else P(None, AXIS, None))


def _row_spec(lin: Linear) -> Linear:         # [L, N, K]: inputs split (a single scale group stays whole)
  whole = lin.scale is not None and lin.scale.shape[-1] == 1
  return Linear(w=P(None, None, AXIS), scale=None if lin.scale is None else P() if whole else P(None, None, AXIS))


def weight_specs(weights: Weights) -> Weights:
  """The PartitionSpec of each array of sharded weights (the module docstring's layout)."""
  opt = lambda a, spec: None if a is None else spec  # noqa: E731
  return dataclasses.replace(
      weights, embed=_vocab_spec(weights.embed), attn_norm=P(), wqkv=_column_spec(weights.wqkv),
      wo=_row_spec(weights.wo), ffn_norm=P(), w_gate_up=_column_spec(weights.w_gate_up),
      w_down=_row_spec(weights.w_down), out_norm=P(), head=_vocab_spec(weights.head),
      bqkv=opt(weights.bqkv, P(None, AXIS)), q_norm=opt(weights.q_norm, P()), k_norm=opt(weights.k_norm, P()),
      rope_freqs=opt(weights.rope_freqs, P()))


def cache_specs(cache: KVCache):
  """The KV cache's arrays split by KV head ([L, B, G, S, Dh]); the rest of it as it is."""
  return jax.tree.map(lambda a: P(None, None, AXIS) if a is cache.k or a is cache.v else P(), cache)


def shard_weights(weights: Weights, tp: TensorParallel) -> Weights:
  """weights (one device's, W8A16 or float) laid out and placed on tp's mesh; the result carries tp (weights
  already laid out for tp come back as they are: their rows are in the sharded order already)."""
  if weights.tp is not None:
    if weights.tp == tp:
      return weights
    raise ValueError(f"these weights are laid out over another mesh ({weights.tp.n} devices); give one "
                     "device's weights")
  for name in ("embed", "wqkv", "wo", "w_gate_up", "w_down", "head"):
    if not isinstance(getattr(weights, name), Linear):
      raise ValueError(f"tensor parallel takes W8A16 or float weights (--quant w8a16 or none); {name} is a "
                       f"{type(getattr(weights, name)).__name__}")
  rows = _qkv_rows(tp)
  w = dataclasses.replace(weights, wqkv=_take_rows(weights.wqkv, rows),
                          w_gate_up=_take_rows(weights.w_gate_up, _gate_up_rows(tp)),
                          bqkv=None if weights.bqkv is None else jnp.take(weights.bqkv, jnp.asarray(rows), axis=-1))
  specs = weight_specs(w)
  placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(tp.mesh, s)), w, specs)
  return dataclasses.replace(placed, tp=tp)


def cache_config(tp: TensorParallel) -> Config:
  """The config a sharded KV cache is made from: N * G_local key/value heads (create_cache(cache_config(tp), ...))."""
  return tp.config.replace(n_kv_heads=tp.n * tp.local.n_kv_heads)


def shard_cache(cache: KVCache, tp: TensorParallel) -> KVCache:
  """A cache made from cache_config(tp), placed on tp's mesh split by KV head."""
  return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(tp.mesh, s)), cache, cache_specs(cache))


def cache_spec(spec: KVCache, tp: TensorParallel) -> KVCache:
  """A cache's ShapeDtypeStructs (made from cache_config(tp)) with the shardings shard_cache() gives."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(tp.mesh, s)),
                      spec, cache_specs(spec))


def on_mesh(tree, tp: TensorParallel):
  """The leaves of tree (arrays or ShapeDtypeStructs) laid out on tp's mesh: those already there keep their
  sharding, the rest are replicated (the per-step values: tokens, positions, the sampler's rows)."""
  everywhere = NamedSharding(tp.mesh, P())

  def one(a):
    if isinstance(getattr(a, "sharding", None), NamedSharding) and a.sharding.mesh == tp.mesh:
      return a
    if isinstance(a, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=everywhere)
    return jax.device_put(a, everywhere)
  return jax.tree.map(one, tree)


def placing(compiled):
  """A compiled program that first puts its arguments where it takes them (a no-op for those already there:
  the engine's own state, which the program's outputs were; the host's new values are copied over)."""
  shardings = compiled.input_shardings[0]

  def call(*args):
    return compiled(*jax.device_put(args, shardings))
  return call
