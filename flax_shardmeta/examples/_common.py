"""Pieces the Linen and NNX example models share: shapes, rules and math."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from flax_shardmeta.examples._model_names import (
  LLAMA_RULES as LLAMA_RULES,  # re-exported
  MLP_RULES as MLP_RULES,  # re-exported
  MODEL_NAMES,
)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Shapes of a Llama-3 model (grouped-query attention, untied embeddings).

  Example:
    >>> LLAMA_CONFIGS['llama3-70b'].num_params
    70553706496
  """

  vocab_size: int
  dim: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  ffn_dim: int
  norm_eps: float = 1e-5
  rope_theta: float = 500_000.0

  @property
  def num_params(self) -> int:
    """Parameter count implied by the shapes."""
    attention = self.dim * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
    layer = attention + 3 * self.dim * self.ffn_dim + 2 * self.dim
    return self.num_layers * layer + 2 * self.vocab_size * self.dim + self.dim


LLAMA_CONFIGS = {
  'llama3-8b': LlamaConfig(128256, 4096, 32, 32, 8, 128, 14336),
  'llama3-70b': LlamaConfig(128256, 8192, 80, 64, 8, 128, 28672),
  'llama3-405b': LlamaConfig(128256, 16384, 126, 128, 8, 128, 53248),
}
"""The published Llama-3 / 3.1 shapes."""

REMAT_POLICIES = ('none', 'full', 'dots')
"""Rematerialisation of each layer: ``'none'`` keeps every activation the
backward pass needs; ``'full'`` keeps only the layer's input and recomputes the
rest (``jax.checkpoint_policies.nothing_saveable``); ``'dots'`` keeps the
matmul results (``checkpoint_dots``). Any other name of
``jax.checkpoint_policies`` is accepted too."""

LAYER_INPUT = 'decoder_layer_input'
"""The checkpoint name of each decoder layer's input (MaxText's name)."""


def remat_policy(name: str, offloaded: Sequence[str] = ()) -> tuple[bool, Any]:
  """``(rematerialise?, jax.checkpoint policy)`` for a policy name; with
  ``offloaded`` checkpoint names, the policy moves those values to host
  memory for the backward pass and decides the rest as ``name`` says.

  Example:
    >>> remat_policy('none'), remat_policy('full')[0]
    ((False, None), True)
    >>> remat_policy('none', offloaded=[LAYER_INPUT])[0]
    True
  """
  if name == 'none':
    remat, policy = False, None
  elif name == 'full':
    remat, policy = True, jax.checkpoint_policies.nothing_saveable
  elif name == 'dots':
    remat, policy = True, jax.checkpoint_policies.checkpoint_dots
  else:
    policy = getattr(jax.checkpoint_policies, name, None)
    if policy is None or name.startswith('_'):
      raise ValueError(
        f'Unknown remat policy {name!r}; choose from {", ".join(REMAT_POLICIES)} '
        'or a name of jax.checkpoint_policies.'
      )
    remat = True
  if not offloaded:
    return remat, policy
  return True, offloading(
    policy or jax.checkpoint_policies.everything_saveable, offloaded
  )


def offloading(base: Any, names: Sequence[str]) -> Any:
  """A remat policy that offloads the values named ``names`` to pinned host
  memory and decides every other value as ``base`` does.

  Example:
    >>> import jax
    >>> policy = offloading(jax.checkpoint_policies.nothing_saveable, ['h'])
    >>> callable(policy)
    True
  """
  offload = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=list(names),
    offload_src='device',
    offload_dst='pinned_host',
  )
  wanted = frozenset(names)

  def policy(prim: Any, *args: Any, **params: Any) -> Any:
    # `name` is checkpoint_name's primitive; its `name` parameter the name.
    if getattr(prim, 'name', None) == 'name' and params.get('name') in wanted:
      return offload(prim, *args, **params)
    return base(prim, *args, **params)

  return policy


def llama_config(name: str, num_layers: int | None = None) -> LlamaConfig:
  """A built-in Llama config, optionally with another number of layers."""
  if name not in LLAMA_CONFIGS:
    raise ValueError(f'Unknown model {name!r}; choose from {", ".join(MODEL_NAMES)}.')
  config = LLAMA_CONFIGS[name]
  return (
    config if num_layers is None else dataclasses.replace(config, num_layers=num_layers)
  )


def out_sharding(spec: jax.sharding.PartitionSpec) -> jax.sharding.PartitionSpec | None:
  """``spec`` under an all-Explicit mesh (else None, the compiler's choice).

  Under Explicit axes a matmul whose contracting dimension is sharded needs
  its output sharding spelled out; under Auto axes the compiler chooses.
  """
  mesh = jax.sharding.get_abstract_mesh()
  explicit = jax.sharding.AxisType.Explicit
  if not mesh.empty and all(t == explicit for t in mesh.axis_types):
    return spec
  return None


def rope(x: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding."""
  # x: (batch, length, heads, head_dim); rotates pairs of the last dimension.
  half = x.shape[-1] // 2
  freqs = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half)
  angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freqs
  cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
  return out.astype(x.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """Causal grouped-query attention; k and v have fewer heads than q."""
  groups = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
  scores = jnp.einsum('bqhd,bkhd->bhqk', q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
  length = q.shape[1]
  causal = jnp.tril(jnp.ones((length, length), dtype=bool))
  scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
  weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
  return jnp.einsum('bhqk,bkhd->bqhd', weights, v)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """Root-mean-square normalisation with a learned scale."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * scale).astype(x.dtype)
