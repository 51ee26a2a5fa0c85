"""Models written for Auto mesh axes, for the Explicit-axes audit's tests.

Their lines are what the audit must name: each line jax refuses ends with a
``refused`` comment. Layouts are FSDP + TP: parameters'
``embed`` over ``data``, ``mlp`` and ``heads`` over ``model``; activations'
``batch`` over ``data``.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import flax_shardmeta as fsm

RULES = (
  ('batch', 'data'),
  ('embed', 'data'),
  ('mlp', 'model'),
  ('heads', 'model'),
  ('kv', None),
  ('seq', None),
)
EMBED, HEADS, KV, MLP = 32, 4, 8, 64


def logical(names):
  return fsm.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class LinenBlock(nn.Module):
  """Attention and an MLP, as written for Auto axes (no out_sharding)."""

  @nn.compact
  def __call__(self, x):
    dense = lambda f, names: nn.DenseGeneral(  # noqa: E731
      f, kernel_init=logical(names), use_bias=False
    )
    q = dense((HEADS, KV), ('embed', 'heads', 'kv'))(x)
    k = dense((HEADS, KV), ('embed', 'heads', 'kv'))(x)
    scores = jnp.einsum('bqhd,bkhd->bhqk', q, k)
    probs = jax.nn.softmax(scores, axis=-1)
    v = dense((HEADS, KV), ('embed', 'heads', 'kv'))(x)
    out = jnp.einsum('bhqk,bkhd->bqhd', probs, v)
    out = out.reshape(out.shape[0], out.shape[1], HEADS * KV)
    mlp_in = nn.Dense(MLP, kernel_init=logical(('embed', 'mlp')), use_bias=False)
    h = mlp_in(out)  # refused
    h = jax.nn.gelu(h)
    w = self.param('w_out', logical(('mlp', 'embed')), (MLP, EMBED))
    return x + h @ w  # refused


def linen_loss(params, x):
  y = LinenBlock().apply({'params': params}, x)
  return jnp.mean((y - jnp.tanh(x)) ** 2)


class NnxBlock(nnx.Module):
  """The MLP half, in NNX, as written for Auto axes."""

  def __init__(self, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    part = fsm.nnx.with_logical_partitioning
    self.up = nnx.Linear(
      EMBED, MLP, use_bias=False, rngs=rngs, kernel_init=part(init, ('embed', 'mlp'))
    )
    self.down = nnx.Linear(MLP, EMBED, use_bias=False, rngs=rngs,
                           kernel_init=part(init, ('mlp', 'embed')))  # fmt: skip

  def __call__(self, x):
    h = self.up(x)
    h = jax.nn.relu(h)
    y = self.down(h)  # refused
    flat = y.reshape(-1)
    return jnp.sum(flat**2) / flat.shape[0]
