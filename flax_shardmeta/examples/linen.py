"""Linen example models: the scale-up notebook MLP and Llama-3, with logical names."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta.examples._common import (
  LAYER_INPUT,
  LLAMA_CONFIGS,
  LLAMA_RULES,
  MLP_RULES,
  MODEL_NAMES,
  REMAT_POLICIES,
  LlamaConfig,
  attend,
  llama_config,
  out_sharding,
  remat_policy,
  rms_norm,
  rope,
)


class DotReluDot(nn.Module):
  """The Flax scale-up notebook's layer: ``relu(x @ W1) @ W2``.

  Annotated with logical names (``embed``, ``hidden``) resolved by rules, or,
  with ``mesh_axes=True``, directly with the mesh axes the notebook starts
  from (``(None, 'model')`` and ``('model', None)``).
  """

  depth: int
  dense_init: nn.initializers.Initializer = nn.initializers.xavier_normal()
  param_dtype: Any = jnp.float32
  mesh_axes: bool = False

  def _constrain(
    self, x: jax.Array, names: tuple[str, str], axes: tuple[str | None, ...]
  ) -> jax.Array:
    if self.mesh_axes:
      try:
        return fsm.shard_value(x, axes)
      except fsm.NoMeshError:  # no mesh set: nothing to lay the value out over
        return x
    return fsm.with_logical_constraint(x, names)

  @nn.compact
  def __call__(self, x):
    if self.mesh_axes:
      w1 = fsm.with_partitioning(self.dense_init, (None, 'model'))
      w2_init = fsm.with_partitioning(self.dense_init, ('model', None))
      z_sharding = P('data', None)
    else:
      w1 = fsm.with_logical_partitioning(self.dense_init, ('embed', 'hidden'))
      w2_init = fsm.with_logical_partitioning(self.dense_init, ('hidden', 'embed'))
      z_sharding = fsm.logical_to_mesh_axes(('batch', 'embed'))
    y = nn.Dense(
      self.depth, kernel_init=w1, use_bias=False, param_dtype=self.param_dtype
    )(x)
    y = jax.nn.relu(y)
    y = self._constrain(y, ('batch', 'hidden'), ('data', 'model'))
    w2 = self.param('W2', w2_init, (self.depth, x.shape[-1]), self.param_dtype)
    z = jnp.dot(y, w2, out_sharding=out_sharding(z_sharding))
    z = self._constrain(z, ('batch', 'embed'), ('data', None))
    return z, None


class MLP(nn.Module):
  """A stack of DotReluDot layers, unrolled or with ``nn.scan``.

  With ``nn.scan`` the stacked parameters get a leading layer axis, named
  ``'layers'`` for logical annotations (replicated by ``MLP_RULES``) and left
  unsharded for mesh-axis ones.

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> model = MLP(num_layers=2, depth=16)
    >>> v = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((4, 8)))
    >>> fsm.get_partition_spec(v)['params']['ScanDotReluDot_0']['W2']
    P('layers', 'hidden', 'embed')
  """

  num_layers: int = 4
  depth: int = 1024
  use_scan: bool = True
  param_dtype: Any = jnp.float32
  mesh_axes: bool = False
  remat: str = 'none'

  @nn.compact
  def __call__(self, x):
    layer = _rematted(DotReluDot, self.remat)
    if self.use_scan:
      x, _ = nn.scan(
        layer,
        length=self.num_layers,
        variable_axes={'params': 0},
        split_rngs={'params': True},
        metadata_params={fsm.PARTITION_NAME: None if self.mesh_axes else 'layers'},
      )(self.depth, param_dtype=self.param_dtype, mesh_axes=self.mesh_axes)(x)
    else:
      for _ in range(self.num_layers):
        x, _ = layer(
          self.depth, param_dtype=self.param_dtype, mesh_axes=self.mesh_axes
        )(x)
    return x


# Llama 3
# ------------------------------------------------------------------------------

_init = nn.initializers.normal(0.02)


class RMSNorm(nn.Module):
  """RMSNorm with a learned scale named 'norm' (replicated by the rules)."""

  eps: float = 1e-5
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param(
      'scale',
      fsm.with_logical_partitioning(nn.initializers.ones, ('norm',)),
      (x.shape[-1],),
      self.param_dtype,
    )
    return rms_norm(x, scale, self.eps)


class LlamaBlock(nn.Module):
  """One Llama decoder layer: pre-norm GQA attention and a SwiGLU MLP."""

  config: LlamaConfig
  param_dtype: Any = jnp.float32

  def _param(self, name: str, shape: tuple[int, ...], names: tuple[str, ...]):
    return self.param(
      name, fsm.with_logical_partitioning(_init, names), shape, self.param_dtype
    )

  @nn.compact
  def __call__(self, x: jax.Array, _: Any = None) -> tuple[jax.Array, None]:
    c = self.config
    x = checkpoint_name(x, LAYER_INPUT)  # what an offloading policy moves
    x = gqa_attention(self, x)
    w1 = self._param('w1', (c.dim, c.ffn_dim), ('embed', 'mlp'))
    w3 = self._param('w3', (c.dim, c.ffn_dim), ('embed', 'mlp'))
    w2 = self._param('w2', (c.ffn_dim, c.dim), ('mlp', 'embed'))
    h = RMSNorm(c.norm_eps, self.param_dtype, name='ffn_norm')(x)
    x = x + (jax.nn.silu(h @ w1) * (h @ w3)) @ w2
    x = fsm.with_logical_constraint(x, ('batch', 'length', 'embed'))
    return x, None


def gqa_attention(block: LlamaBlock, x: jax.Array) -> jax.Array:
  """``x`` plus ``block``'s pre-norm grouped-query attention over it: its
  parameters ``wq``, ``wk``, ``wv``, ``wo`` and its ``attention_norm``. A
  function, not a method, so that the ops keep the layer's own name scope;
  the mixture-of-experts layer (``examples.moe``) shares it."""
  c = block.config
  wq = block._param(
    'wq', (c.dim, c.num_heads, c.head_dim), ('embed', 'heads', 'head_dim')
  )
  wk = block._param(
    'wk', (c.dim, c.num_kv_heads, c.head_dim), ('embed', 'kv_heads', 'head_dim')
  )
  wv = block._param(
    'wv', (c.dim, c.num_kv_heads, c.head_dim), ('embed', 'kv_heads', 'head_dim')
  )
  wo = block._param(
    'wo', (c.num_heads, c.head_dim, c.dim), ('heads', 'head_dim', 'embed')
  )
  h = RMSNorm(c.norm_eps, block.param_dtype, name='attention_norm')(x)
  q = rope(jnp.einsum('bse,ehd->bshd', h, wq), c.rope_theta)
  k = rope(jnp.einsum('bse,ehd->bshd', h, wk), c.rope_theta)
  v = jnp.einsum('bse,ehd->bshd', h, wv)
  return x + jnp.einsum('bshd,hde->bse', attend(q, k, v), wo)


class Llama(nn.Module):
  """Llama-3 decoder with its layers stacked by ``nn.scan`` on a 'layers' axis.

  ``remat`` rematerialises each layer (see ``REMAT_POLICIES``); ``offloaded``
  checkpoint names (``LAYER_INPUT``, each layer's input) go to host memory
  for the backward pass instead; ``block`` is the layer (``examples.moe``
  swaps in a mixture-of-experts one).
  """

  block: ClassVar[type[LlamaBlock]] = LlamaBlock

  config: LlamaConfig
  param_dtype: Any = jnp.float32
  remat: str = 'none'
  offloaded: tuple[str, ...] = ()

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    c = self.config
    embedding = self.param(
      'embedding',
      fsm.with_logical_partitioning(_init, ('vocab', 'embed')),
      (c.vocab_size, c.dim),
      self.param_dtype,
    )
    x = jnp.take(embedding, tokens, axis=0)
    x, _ = nn.scan(
      _rematted(self.block, self.remat, self.offloaded),
      length=c.num_layers,
      variable_axes={'params': 0},
      split_rngs={'params': True},
      metadata_params={fsm.PARTITION_NAME: 'layers'},
    )(c, self.param_dtype, name='layers')(x, None)
    x = RMSNorm(c.norm_eps, self.param_dtype, name='norm')(x)
    lm_head = self.param(
      'lm_head',
      fsm.with_logical_partitioning(_init, ('embed', 'vocab')),
      (c.dim, c.vocab_size),
      self.param_dtype,
    )
    return x @ lm_head


def _rematted(
  layer: type[nn.Module], policy_name: str, offloaded: Sequence[str] = ()
) -> Any:
  remat, policy = remat_policy(policy_name, offloaded)
  # prevent_cse=False: inside a scan the loop already keeps XLA from merging
  # the recomputation away, and the barrier would cost speed.
  return nn.remat(layer, policy=policy, prevent_cse=False) if remat else layer


def model(
  name: str,
  dtype: Any = jnp.float32,
  *,
  remat: str = 'none',
  num_layers: int | None = None,
  offloaded: Sequence[str] = (),
) -> tuple[nn.Module, Any]:
  """A built-in Linen model and an abstract example input for its ``init``.

  Args:
    name: one of ``MODEL_NAMES``.
    dtype: the parameters' dtype.
    remat: the rematerialisation policy of each layer (``REMAT_POLICIES``).
    num_layers: another depth than the model's own.
    offloaded: checkpoint names each layer offloads to host memory
      (``LAYER_INPUT``); Llama only.

  Example:
    >>> module, x = model('llama3-8b', remat='full', num_layers=2)
    >>> module.config.num_layers, module.remat, x.shape
    (2, 'full', (1, 1))
  """
  remat_policy(remat)  # unknown policies fail here, not deep inside init
  if name == 'mlp' and offloaded:
    raise ValueError(
      f'offloaded={tuple(offloaded)!r}: the MLP names no activation to offload; '
      'the Llama models name each layer input LAYER_INPUT.'
    )
  if name == 'mlp':
    # The notebook's sizes: 4 layers of depth 1024 on a batch of 8.
    return MLP(
      num_layers=num_layers or 4,
      depth=1024,
      use_scan=True,
      param_dtype=dtype,
      remat=remat,
    ), jax.ShapeDtypeStruct((8, 1024), jnp.float32)
  config = llama_config(name, num_layers)
  return Llama(config, dtype, remat, tuple(offloaded)), jax.ShapeDtypeStruct(
    (1, 1), jnp.int32
  )


__all__ = [
  'LAYER_INPUT',
  'LLAMA_CONFIGS',
  'LLAMA_RULES',
  'MLP',
  'MLP_RULES',
  'MODEL_NAMES',
  'REMAT_POLICIES',
  'DotReluDot',
  'Llama',
  'LlamaBlock',
  'LlamaConfig',
  'RMSNorm',
  'model',
]
