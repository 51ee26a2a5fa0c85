"""NNX versions of the example models, with the same shapes and logical names.

Layers are stacked with ``nnx.vmap`` (``transform_metadata`` adds the 'layers'
name) and applied with ``nnx.scan``, mirroring ``nn.scan`` in the Linen models,
so both front ends give the same plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import flax_shardmeta as fsm
from flax_shardmeta.examples._common import (
  LAYER_INPUT,
  LlamaConfig,
  attend,
  llama_config,
  out_sharding,
  remat_policy,
  rms_norm,
  rope,
)

_init = nnx.initializers.normal(0.02)
_STACK = {nnx.PARTITION_NAME: 'layers'}


def _param(
  rngs: nnx.Rngs,
  shape: tuple[int, ...],
  names: tuple[str, ...],
  dtype: Any,
  init: Any = _init,
) -> nnx.Param[jax.Array]:
  annotated = fsm.nnx.with_logical_partitioning(init, names)
  return nnx.Param(annotated(rngs.params(), shape, dtype))


class DotReluDot(nnx.Module):
  """The notebook's layer in NNX: ``relu(x @ W1) @ W2``."""

  def __init__(
    self, depth: int, width: int, dtype: Any = jnp.float32, *, rngs: nnx.Rngs
  ):
    init = nnx.initializers.xavier_normal()
    self.W1 = _param(rngs, (width, depth), ('embed', 'hidden'), dtype, init)
    self.W2 = _param(rngs, (depth, width), ('hidden', 'embed'), dtype, init)

  def __call__(self, x: jax.Array) -> jax.Array:
    y = fsm.with_logical_constraint(jax.nn.relu(x @ self.W1[...]), ('batch', 'hidden'))
    # Under Explicit axes the contracted 'hidden' dimension is sharded, so the
    # output layout must be spelled out.
    spec = out_sharding(fsm.logical_to_mesh_axes(('batch', 'embed')))
    return jnp.dot(y, self.W2[...], out_sharding=spec)


class MLP(nnx.Module):
  """A stack of :class:`DotReluDot` layers on a 'layers' axis."""

  def __init__(
    self,
    num_layers: int = 4,
    depth: int = 1024,
    width: int = 1024,
    dtype: Any = jnp.float32,
    *,
    rngs: nnx.Rngs,
    remat: str = 'none',
  ):
    self.remat = remat

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata=_STACK)
    def make(rngs: nnx.Rngs) -> DotReluDot:
      return DotReluDot(depth, width, dtype, rngs=rngs)

    self.layers = make(rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    def body(x: jax.Array, layer: DotReluDot) -> jax.Array:
      return layer(x)

    return _scan(body, self.remat)(x, self.layers)


class RMSNorm(nnx.Module):
  """RMSNorm with a learned scale named 'norm'."""

  def __init__(self, dim: int, eps: float, dtype: Any, *, rngs: nnx.Rngs):
    self.scale = _param(rngs, (dim,), ('norm',), dtype, nnx.initializers.ones)
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.scale[...], self.eps)


class LlamaBlock(nnx.Module):
  """One Llama decoder layer; parameters named as in the Linen model."""

  def __init__(self, c: LlamaConfig, dtype: Any, *, rngs: nnx.Rngs):
    self.config = c
    self.attention_norm = RMSNorm(c.dim, c.norm_eps, dtype, rngs=rngs)
    self.wq = _param(
      rngs, (c.dim, c.num_heads, c.head_dim), ('embed', 'heads', 'head_dim'), dtype
    )
    self.wk = _param(
      rngs,
      (c.dim, c.num_kv_heads, c.head_dim),
      ('embed', 'kv_heads', 'head_dim'),
      dtype,
    )
    self.wv = _param(
      rngs,
      (c.dim, c.num_kv_heads, c.head_dim),
      ('embed', 'kv_heads', 'head_dim'),
      dtype,
    )
    self.wo = _param(
      rngs, (c.num_heads, c.head_dim, c.dim), ('heads', 'head_dim', 'embed'), dtype
    )
    self.ffn_norm = RMSNorm(c.dim, c.norm_eps, dtype, rngs=rngs)
    self.w1 = _param(rngs, (c.dim, c.ffn_dim), ('embed', 'mlp'), dtype)
    self.w3 = _param(rngs, (c.dim, c.ffn_dim), ('embed', 'mlp'), dtype)
    self.w2 = _param(rngs, (c.ffn_dim, c.dim), ('mlp', 'embed'), dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    theta = self.config.rope_theta
    x = checkpoint_name(x, LAYER_INPUT)  # what an offloading policy moves
    h = self.attention_norm(x)
    q = rope(jnp.einsum('bse,ehd->bshd', h, self.wq[...]), theta)
    k = rope(jnp.einsum('bse,ehd->bshd', h, self.wk[...]), theta)
    v = jnp.einsum('bse,ehd->bshd', h, self.wv[...])
    x = x + jnp.einsum('bshd,hde->bse', attend(q, k, v), self.wo[...])
    h = self.ffn_norm(x)
    x = x + (jax.nn.silu(h @ self.w1[...]) * (h @ self.w3[...])) @ self.w2[...]
    return fsm.with_logical_constraint(x, ('batch', 'length', 'embed'))


class Llama(nnx.Module):
  """Llama-3 decoder; layers stacked with ``nnx.vmap`` on a 'layers' axis.

  ``remat`` rematerialises each layer (see ``REMAT_POLICIES``);
  ``offloaded`` checkpoint names go to host memory for the backward pass.
  """

  def __init__(
    self,
    c: LlamaConfig,
    dtype: Any = jnp.float32,
    *,
    rngs: nnx.Rngs,
    remat: str = 'none',
    offloaded: Sequence[str] = (),
  ):
    self.remat = remat
    self.offloaded = tuple(offloaded)
    self.embedding = _param(rngs, (c.vocab_size, c.dim), ('vocab', 'embed'), dtype)

    @nnx.split_rngs(splits=c.num_layers)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata=_STACK)
    def make(rngs: nnx.Rngs) -> LlamaBlock:
      return LlamaBlock(c, dtype, rngs=rngs)

    self.layers = make(rngs)
    self.norm = RMSNorm(c.dim, c.norm_eps, dtype, rngs=rngs)
    self.lm_head = _param(rngs, (c.dim, c.vocab_size), ('embed', 'vocab'), dtype)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = jnp.take(self.embedding[...], tokens, axis=0)

    def body(x: jax.Array, layer: LlamaBlock) -> jax.Array:
      return layer(x)

    x = _scan(body, self.remat, self.offloaded)(x, self.layers)
    return self.norm(x) @ self.lm_head[...]


def _scan(body: Any, policy_name: str, offloaded: Sequence[str] = ()) -> Any:
  """``body`` over the stacked layers, each rematerialised as ``policy_name``
  says, ``offloaded`` names moved to host memory."""
  remat, policy = remat_policy(policy_name, offloaded)
  if remat:
    body = nnx.remat(body, policy=policy, prevent_cse=False)
  return nnx.scan(
    in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata=_STACK
  )(body)


def model(
  name: str,
  dtype: Any = jnp.float32,
  *,
  rngs: nnx.Rngs,
  remat: str = 'none',
  num_layers: int | None = None,
  offloaded: Sequence[str] = (),
) -> nnx.Module:
  """A built-in NNX model (call inside ``nnx.eval_shape`` to stay abstract).

  Args:
    name: one of ``MODEL_NAMES``.
    dtype: the parameters' dtype.
    rngs: the random streams.
    remat: the rematerialisation policy of each layer (``REMAT_POLICIES``).
    num_layers: another depth than the model's own.
    offloaded: checkpoint names each layer offloads to host memory
      (``LAYER_INPUT``); Llama only.

  Example:
    >>> m = nnx.eval_shape(lambda: model('mlp', rngs=nnx.Rngs(0)))
    >>> m.layers.W1.shape
    (4, 1024, 1024)
  """
  remat_policy(remat)  # unknown policies fail here, not deep inside the model
  if name == 'mlp' and offloaded:
    raise ValueError(
      f'offloaded={tuple(offloaded)!r}: the MLP names no activation to offload; '
      'the Llama models name each layer input LAYER_INPUT.'
    )
  if name == 'mlp':
    return MLP(num_layers or 4, 1024, 1024, dtype, rngs=rngs, remat=remat)
  config = llama_config(name, num_layers)
  return Llama(config, dtype, rngs=rngs, remat=remat, offloaded=offloaded)
