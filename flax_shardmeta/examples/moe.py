"""A mixture-of-experts example: a Mixtral-shaped decoder, experts on ``'expert'``.

Each layer is Llama's attention followed by a feed-forward of ``num_experts``
SwiGLU experts, each token routed to ``top_k`` of them (GShard's routing: a
fixed capacity per expert and batch row, tokens beyond it dropped, inputs
gathered by a one-hot dispatch tensor). The experts' weights carry the logical
name ``'expert'`` on their leading dimension (T5X's mixture-of-experts name),
which the ``ep`` and ``ep+tp`` rule presets of ``fsm.suggest`` lay over the
``expert`` mesh axis; the rest use Llama's names (``embed``, ``heads``,
``kv_heads``, ``mlp``, ``vocab``, ``layers``). Linen only.

``examples.train`` builds its training step like the built-in models'
(``train.train_step('moe-tiny', mesh)``, ``train.builder('mixtral-8x7b', ...)``).

Example:
  >>> from flax_shardmeta.examples import moe
  >>> sorted(moe.MOE_CONFIGS), moe.MOE_CONFIGS['mixtral-8x7b'].num_params
  (['mixtral-8x7b', 'moe-tiny'], 46702792704)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

import flax_shardmeta as fsm
from flax_shardmeta.examples._common import LAYER_INPUT, LlamaConfig, remat_policy
from flax_shardmeta.examples.linen import Llama, LlamaBlock, RMSNorm, gqa_attention


@dataclasses.dataclass(frozen=True)
class MoeConfig(LlamaConfig):
  """Shapes of a mixture-of-experts decoder: Llama's, and the experts'.

  Attributes:
    num_experts: experts per layer.
    top_k: experts each token is routed to.
    capacity_factor: an expert's buffer per batch row holds ``capacity_factor
      x top_k x length / num_experts`` tokens.

  Example:
    >>> MOE_CONFIGS['moe-tiny'].num_experts, MOE_CONFIGS['moe-tiny'].top_k
    (8, 2)
  """

  num_experts: int = 8
  top_k: int = 2
  capacity_factor: float = 1.25

  @property
  def num_params(self) -> int:
    """Parameter count implied by the shapes."""
    attention = self.dim * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
    experts = self.num_experts * 3 * self.dim * self.ffn_dim
    layer = attention + experts + self.dim * self.num_experts + 2 * self.dim
    return self.num_layers * layer + 2 * self.vocab_size * self.dim + self.dim


MOE_CONFIGS = {
  'mixtral-8x7b': MoeConfig(
    32000, 4096, 32, 32, 8, 128, 14336, rope_theta=1e6, num_experts=8, top_k=2
  ),
  'moe-tiny': MoeConfig(512, 128, 2, 4, 2, 32, 256, num_experts=8, top_k=2),
}
"""Mixtral 8x7B's published shapes, and a tiny one for quick checks."""

MOE_RULES = (
  ('batch', ('data', 'expert')),
  ('batch_no_exp', 'data'),
  ('expert', 'expert'),
  ('embed', None),
  ('layers', None),
)
"""Rules for the examples over a ('data', 'expert') mesh: the experts over
'expert', the batch over both axes, and the batch of the tokens routed to the
experts over 'data' alone (the ``ep`` preset's)."""


def routed_names() -> tuple[str | None, ...]:
  """The logical names of the tokens routed to the experts, ``(batch,
  experts, capacity, embed)``.

  Where the rules name ``'batch_no_exp'`` (the axes of the batch the experts
  do not use, MaxText's ``activation_batch_no_exp``; the ``ep`` presets do),
  the routed tokens' batch goes there and their experts' dimension is laid
  out as the experts are: XLA moves the tokens to the experts. Elsewhere the
  routed tokens stay on the batch's shards, whole over the experts, and the
  experts come to them (what ``why()`` calls not expert-parallel).

  Example:
    >>> import flax_shardmeta as fsm
    >>> with fsm.logical_axis_rules(MOE_RULES):
    ...   routed_names()
    ('batch_no_exp', 'expert', None, 'embed')
  """
  named = {name for name, _ in fsm.get_logical_axis_rules()}
  if 'batch_no_exp' in named:
    return ('batch_no_exp', 'expert', None, 'embed')
  return ('batch', None, None, 'embed')


def capacity(length: int, top_k: int, experts: int, capacity_factor: float) -> int:
  """Slots of each expert's buffer per batch row, as :func:`route` makes them.

  Example:
    >>> capacity(2048, 2, 8, 1.25)
    640
  """
  return max(1, math.ceil(top_k * length * capacity_factor / experts))


def dropped_share(config: MoeConfig, length: int, capacity_factor: float) -> float:
  """The share of routed tokens a capacity factor drops when the router
  spreads them evenly: each expert is sent ``top_k x length / experts`` per
  batch row and keeps its :func:`capacity` of them. A router that favours some
  experts drops more.

  Example:
    >>> dropped_share(MOE_CONFIGS['moe-tiny'], 2048, 1.0)
    0.0
    >>> dropped_share(MOE_CONFIGS['moe-tiny'], 2048, 0.5)
    0.5
  """
  sent = config.top_k * length / config.num_experts
  kept = capacity(length, config.top_k, config.num_experts, capacity_factor)
  return max(0.0, 1 - kept / sent)


def route(
  logits: jax.Array, top_k: int, capacity_factor: float
) -> tuple[jax.Array, jax.Array]:
  """GShard's top-k routing within each batch row: ``(dispatch, combine)``.

  Both are ``(batch, length, experts, capacity)``: ``dispatch`` is 1 where a
  token takes a slot of an expert's buffer, ``combine`` that slot's gate
  weight. A token's first choices take their slots before any second choice;
  tokens past an expert's capacity are dropped (their rows are zero).

  Example:
    >>> import jax.numpy as jnp
    >>> logits = jnp.array([[[4.0, 0.0], [4.0, 0.0], [4.0, 0.0]]])
    >>> dispatch, combine = route(logits, top_k=1, capacity_factor=1.0)
    >>> dispatch.shape, dispatch.sum(axis=(2, 3)).tolist()  # capacity 2: one dropped
    ((1, 3, 2, 2), [[1.0, 1.0, 0.0]])
  """
  batch, length, experts = logits.shape
  slots = capacity(length, top_k, experts, capacity_factor)
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  gates, index = jax.lax.top_k(probs, top_k)  # (batch, length, k)
  gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  choice = jax.nn.one_hot(index, experts, dtype=jnp.int32)  # (b, s, k, e)
  # Count places choice by choice: every token's first choice, then second...
  by_rank = choice.transpose(0, 2, 1, 3).reshape(batch, top_k * length, experts)
  place = jnp.cumsum(by_rank, axis=1) - 1
  place = place.reshape(batch, top_k, length, experts).transpose(0, 2, 1, 3)
  place = jnp.sum(place * choice, axis=-1)  # (b, s, k)
  # one_hot of a place past the capacity is all zeros: the token is dropped.
  slot = jax.nn.one_hot(place, slots, dtype=jnp.float32)  # (b, s, k, c)
  chosen = choice.astype(jnp.float32)
  dispatch = jnp.einsum('bske,bskc->bsec', chosen, slot)
  combine = jnp.einsum('bske,bskc->bsec', chosen * gates[..., None], slot)
  return dispatch, combine


class MoeBlock(LlamaBlock):
  """Llama's attention, then ``num_experts`` SwiGLU experts and a router."""

  config: MoeConfig  # pyright: ignore[reportIncompatibleVariableOverride]

  @nn.compact
  def __call__(self, x: jax.Array, _: Any = None) -> tuple[jax.Array, None]:
    c = self.config
    x = checkpoint_name(x, LAYER_INPUT)  # what an offloading policy moves
    x = gqa_attention(self, x)
    # The router's expert dimension is small: replicated, as in T5X.
    init = fsm.with_logical_partitioning(nn.initializers.normal(0.02), ('embed', None))
    router = self.param('router', init, (c.dim, c.num_experts), self.param_dtype)
    shape = (c.num_experts, c.dim, c.ffn_dim)
    w1 = self._param('w1', shape, ('expert', 'embed', 'mlp'))
    w3 = self._param('w3', shape, ('expert', 'embed', 'mlp'))
    w2 = self._param(
      'w2', (c.num_experts, c.ffn_dim, c.dim), ('expert', 'mlp', 'embed')
    )
    h = RMSNorm(c.norm_eps, self.param_dtype, name='ffn_norm')(x)
    dispatch, combine = route(h @ router, c.top_k, c.capacity_factor)
    inputs = jnp.einsum('bsec,bsd->becd', dispatch.astype(h.dtype), h)
    inputs = fsm.with_logical_constraint(inputs, routed_names())
    gated = jax.nn.silu(jnp.einsum('becd,edf->becf', inputs, w1))
    hidden = gated * jnp.einsum('becd,edf->becf', inputs, w3)
    outputs = jnp.einsum('becf,efd->becd', hidden, w2)
    outputs = fsm.with_logical_constraint(outputs, routed_names())
    x = x + jnp.einsum('becd,bsec->bsd', outputs, combine.astype(h.dtype))
    x = fsm.with_logical_constraint(x, ('batch', 'length', 'embed'))
    return x, None


class MoeTransformer(Llama):
  """The decoder with :class:`MoeBlock` layers (stacked by ``nn.scan``).

  Example:
    >>> import jax, flax_shardmeta as fsm
    >>> module, tokens = model('moe-tiny')
    >>> v = jax.eval_shape(module.init, jax.random.key(0), tokens)
    >>> fsm.get_partition_spec(v)['params']['layers']['w1']
    P('layers', 'expert', 'embed', 'mlp')
  """

  block = MoeBlock


def model(
  name: str,
  dtype: Any = jnp.float32,
  *,
  remat: str = 'none',
  num_layers: int | None = None,
  offloaded: Sequence[str] = (),
  capacity_factor: float | None = None,
) -> tuple[MoeTransformer, Any]:
  """An example mixture-of-experts model and an abstract input for its ``init``.

  Args:
    name: one of :data:`MOE_CONFIGS`.
    dtype: the parameters' dtype.
    remat: the rematerialisation policy of each layer (``REMAT_POLICIES``).
    num_layers: another depth than the model's own.
    offloaded: checkpoint names each layer offloads to host memory.
    capacity_factor: another capacity factor than the model's own.

  Raises:
    ValueError: an unknown name or remat policy.

  Example:
    >>> module, tokens = model('mixtral-8x7b', num_layers=2)
    >>> module.config.num_layers, module.config.num_experts, tokens.shape
    (2, 8, (1, 1))
  """
  remat_policy(remat)  # unknown policies fail here, not deep inside init
  if name not in MOE_CONFIGS:
    raise ValueError(f'Unknown model {name!r}; choose from {", ".join(MOE_CONFIGS)}.')
  config = MOE_CONFIGS[name]
  if num_layers is not None:
    config = dataclasses.replace(config, num_layers=num_layers)
  if capacity_factor is not None:
    config = dataclasses.replace(config, capacity_factor=capacity_factor)
  module = MoeTransformer(config, dtype, remat, tuple(offloaded))
  return module, jax.ShapeDtypeStruct((1, 1), jnp.int32)


__all__ = [
  'MOE_CONFIGS',
  'MOE_RULES',
  'MoeBlock',
  'MoeConfig',
  'MoeTransformer',
  'capacity',
  'dropped_share',
  'model',
  'route',
  'routed_names',
]
