"""Steps written for Auto mesh axes whose lines Explicit axes refuse: the
audit's printed fixes are pasted into a copy of this file and run
(tests/test_audit_fixes_paste.py).

Each ``*_case(mesh)`` returns ``(step, *abstract_args)`` on ``mesh``; the
test builds one on a mesh with Auto axes (the step as written) and one from
the fixed copy on the same devices with Explicit axes. Every line jax refuses
under Explicit axes ends with ``# refused``. Layouts are FSDP + TP:
parameters' ``embed`` over ``data``, ``mlp``, ``heads`` and ``vocab`` over
``model``; activations' ``batch`` over ``data``.
"""

import explicit_fix_helpers as helpers
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm

RULES = (
  ('batch', 'data'),
  ('embed', 'data'),
  ('mlp', 'model'),
  ('heads', 'model'),
  ('vocab', 'model'),
)
B, S, E, M, V = 8, 4, 16, 32, 64


def struct(mesh, shape, spec, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def sgd(loss):
  """A training step of ``loss(params, *batch)``: new params and the loss."""

  def step(params, *batch):
    value, grads = jax.value_and_grad(loss)(params, *batch)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

  return step


def embed_loss(params, tokens):
  x = jnp.take(params['table'], tokens, axis=0) + params['pos']  # refused
  return jnp.mean(jnp.tanh(x) ** 2)


def embed_case(mesh):
  params = {
    'table': struct(mesh, (V, E), P('model', 'data')),
    'pos': struct(mesh, (S, E), P()),
  }
  return sgd(embed_loss), params, struct(mesh, (B, S), P('data'), jnp.int32)


def index_loss(params, tokens):
  x = params['table'][tokens]  # refused
  return jnp.mean(jnp.tanh(x) ** 2)


def index_case(mesh):
  params = {'table': struct(mesh, (V, E), P('model', 'data'))}
  return sgd(index_loss), params, struct(mesh, (B, S), P('data'), jnp.int32)


def helper_loss(params, tokens):
  norms = helpers.token_norms(params['table'], tokens)
  return jnp.mean((norms - 1.0) ** 2)


def helper_case(mesh):
  params = {'table': struct(mesh, (V, E), P('model', 'data'))}
  return sgd(helper_loss), params, struct(mesh, (B, S), P('data'), jnp.int32)


def optax_loss(params, x):
  # Refused inside optax: a rank-3 product, while the call returns rank 2.
  similarity = optax.cosine_similarity(x, params['anchors'])  # refused
  return jnp.mean((similarity - 0.5) ** 2)


def optax_case(mesh):
  params = {'anchors': struct(mesh, (B, S, E), P('data', 'model'))}
  return sgd(optax_loss), params, struct(mesh, (B, S, E), P('data', None, 'model'))


def token_loss(params, x, labels):
  logits = x @ params['w_out']
  logp = jax.nn.log_softmax(logits)
  loss = -jnp.take_along_axis(logp, labels[:, None], axis=1).mean()  # refused
  return loss


def token_loss_case(mesh):
  params = {'w_out': struct(mesh, (E, V), P(None, 'model'))}
  x = struct(mesh, (B, E), P('data'))
  return sgd(token_loss), params, x, struct(mesh, (B,), P('data'), jnp.int32)


def grouped_attention(params, x):
  k = jnp.einsum('bse,ehd->bshd', x, params['wk'])
  v = jnp.einsum('bse,ehd->bshd', x, params['wv'])
  k, v = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)  # refused
  return jnp.mean((k * v) ** 2)


def repeat_case(mesh):
  w = struct(mesh, (E, 4, 2), P(None, 'model'))
  return sgd(grouped_attention), {'wk': w, 'wv': w}, struct(mesh, (B, S, E), P('data'))


def mlp_loss(params, x):
  h = jax.nn.relu(x @ params['w_in'])
  y = h @ params['w_out']  # refused
  z = jnp.einsum(  # refused
    'bsm,me->bse', h, params['w_gate']
  )
  return jnp.mean((y * z - x) ** 2)


def mlp_case(mesh):
  params = {
    'w_in': struct(mesh, (E, M), P('data', 'model')),
    'w_out': struct(mesh, (M, E), P('model', 'data')),
    'w_gate': struct(mesh, (M, E), P('model', None)),
  }
  return sgd(mlp_loss), params, struct(mesh, (B, S, E), P('data'))


def carry_loss(params, x):
  def body(carry, w):
    return jnp.tanh(carry @ w), None

  out, _ = jax.lax.scan(body, x, params['ws'])  # refused
  return jnp.mean(out**2)


def carry_case(mesh):
  params = {'ws': struct(mesh, (3, E, E), P(None, None, 'model'))}
  return sgd(carry_loss), params, struct(mesh, (B, E), P('data'))


def logical(names):
  return fsm.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class LinenDown(nn.Module):
  """A Dense layer made in ``setup``."""

  def setup(self):
    self.down = nn.Dense(E, kernel_init=logical(('mlp', 'embed')), use_bias=False)

  def __call__(self, h):
    return self.down(h)  # refused


class LinenMlp(nn.Module):
  """Dense layers made by name, in ``setup`` and inline."""

  @nn.compact
  def __call__(self, x):
    up = nn.Dense(M, kernel_init=logical(('embed', 'mlp')), use_bias=False)
    h = jax.nn.relu(up(x))
    y = LinenDown()(h)
    g = nn.Dense(E, kernel_init=logical(('mlp', 'embed')), use_bias=False)(h)  # refused
    gate = nn.Dense(M, kernel_init=logical(('embed', 'mlp')), use_bias=False)(y * g)
    out = nn.Dense(E, kernel_init=logical(('mlp', 'embed')), use_bias=False)
    return jnp.mean(out(gate) ** 2)  # refused


def linen_case(mesh):
  x = struct(mesh, (B, S, E), P('data'))
  with fsm.logical_axis_rules(RULES):
    abstract = jax.eval_shape(LinenMlp().init, jax.random.key(0), x)
    params = fsm.as_abstract(abstract['params'], mesh)
  return sgd(lambda p, x: LinenMlp().apply({'params': p}, x)), params, x


class NnxMlp(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    part, init = fsm.nnx.with_logical_partitioning, nnx.initializers.lecun_normal()
    self.up = nnx.Linear(
      E, M, use_bias=False, rngs=rngs, kernel_init=part(init, ('embed', 'mlp'))
    )
    self.down = nnx.Linear(
      M, E, use_bias=False, rngs=rngs, kernel_init=part(init, ('mlp', 'embed'))
    )

  def __call__(self, x):
    h = jax.nn.relu(self.up(x))
    return jnp.mean(self.down(h) ** 2)  # refused


def nnx_case(mesh):
  with fsm.logical_axis_rules(RULES):
    abstract = nnx.eval_shape(lambda: NnxMlp(nnx.Rngs(0)))
    graphdef, state = nnx.split(fsm.nnx.as_abstract(abstract, mesh))

  def loss(state, x):
    return nnx.merge(graphdef, state)(x)

  return sgd(loss), state, struct(mesh, (B, S, E), P('data'))
