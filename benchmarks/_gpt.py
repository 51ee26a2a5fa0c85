"""A small GPT written as a user would, for the estimate's error table.

Plain flax layers (``nn.Embed``, ``nn.Dense``, ``nn.LayerNorm``) annotated
with ``nn.with_logical_partitioning``, its layers unrolled in Python (no
``nn.scan``), the heads split out of the features by a reshape, causal
attention written out, an untied output layer and adamw: 27M parameters at
the default width (512, 8 heads, 6 layers, 8,192 tokens). The built-in
models and ``_shapes.py`` use fsm's own parameter helpers and scanned layers;
this one is what the estimate's band had not been measured on. Auto mesh
axes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax.training import train_state

import flax_shardmeta as fsm

RULES = (
  ('batch', 'data'),
  ('embed', None),
  ('heads', 'model'),
  ('mlp', 'model'),
  ('vocab', 'model'),
)
WIDTH, HEADS, VOCAB, LAYERS = 512, 8, 8192, 6


def _dense(features: int, names: tuple[str, str]) -> nn.Dense:
  init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)
  return nn.Dense(features, kernel_init=init)


class Block(nn.Module):
  """Pre-norm attention and a GELU MLP, each with its residual."""

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    h = nn.LayerNorm()(x)
    q, k, v = (
      _dense(d, ('embed', 'heads'))(h).reshape(b, t, HEADS, d // HEADS)
      for _ in range(3)
    )
    scores = jnp.einsum('bqhd,bkhd->bhqk', q, k) / (d // HEADS) ** 0.5
    causal = jnp.tril(jnp.ones((t, t), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    attended = jnp.einsum('bhqk,bkhd->bqhd', weights, v).reshape(b, t, d)
    x = x + _dense(d, ('heads', 'embed'))(attended)
    h = jax.nn.gelu(_dense(4 * d, ('embed', 'mlp'))(nn.LayerNorm()(x)))
    return x + _dense(d, ('mlp', 'embed'))(h)


class GPT(nn.Module):
  """Token embedding, ``layers`` blocks unrolled, norm, output layer."""

  layers: int = LAYERS
  remat: str = 'none'

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    init = nn.with_logical_partitioning(
      nn.initializers.normal(0.02), ('vocab', 'embed')
    )
    x = nn.Embed(VOCAB, WIDTH, embedding_init=init)(tokens)
    block = nn.remat(Block) if self.remat == 'full' else Block
    for _ in range(self.layers):
      x = block()(x)
    return _dense(VOCAB, ('embed', 'vocab'))(nn.LayerNorm()(x))


def train_step(
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
  *,
  remat: str = 'none',
  batch: int = 8,
  seq: int = 256,
  rules: Sequence[tuple[str, Any]] = RULES,
) -> tuple[fsm.JitWithContext, Any, jax.ShapeDtypeStruct]:
  """The GPT's adamw step on ``mesh`` (state donated), with abstract arguments."""
  module = GPT(remat=remat)
  tx = optax.adamw(1e-3)
  tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)

  def init(key: jax.Array) -> train_state.TrainState:
    params = module.init(key, jnp.zeros((1, seq), jnp.int32))['params']
    return train_state.TrainState.create(apply_fn=module.apply, params=params, tx=tx)

  def step(state: Any, tokens: jax.Array) -> tuple[Any, jax.Array]:
    def loss_fn(params: Any) -> jax.Array:
      logits = state.apply_fn({'params': params}, tokens[:, :-1])
      labels = tokens[:, 1:]
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  state = jax.eval_shape(init, jax.random.key(0))
  jitted = fsm.jit(
    step,
    mesh=mesh,  # pyright: ignore[reportArgumentType]
    rules=tuple(rules),
    in_shardings=(state, ('batch', None)),
    out_shardings=(state, None),
    donate_argnums=0,
  )
  return jitted, state, tokens
