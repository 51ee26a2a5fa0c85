"""Explicit mesh axes: ``logical_out_sharding``; jax's sharding type errors explained.

Meshes here say their axis types: Explicit (sharding in types, where jax refuses
ambiguous contractions), Auto, and one mixed mesh.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta import _explicit as explicit

RULES = [('batch', 'data'), ('mlp', 'model'), ('embed', None)]
EXPLICIT = (AxisType.Explicit,) * 2
AUTO = (AxisType.Auto,) * 2


def _mesh(types):
  return jax.make_mesh((2, 4), ('data', 'model'), axis_types=types)


def _init(names):
  return fsm.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class MLP(nn.Module):
  """Dense -> relu -> Dense sharded over 'model': the second matmul contracts it."""

  out_sharding: bool = False

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(16, kernel_init=_init(('embed', 'mlp')))(x))
    dot = jax.lax.dot_general
    if self.out_sharding:
      spec = fsm.logical_out_sharding(('batch', 'embed'))
      dot = functools.partial(jax.lax.dot_general, out_sharding=spec)
    return nn.Dense(4, kernel_init=_init(('mlp', 'embed')), dot_general=dot)(x)


def _batch(mesh):
  x = jnp.arange(32, dtype=jnp.float32).reshape(8, 4) / 32
  return jax.device_put(x, NamedSharding(mesh, P('data', None)))


# logical_out_sharding
# ------------------------------------------------------------------------------


def test_out_sharding_keeps_explicit_axes_only():
  names = ('batch', 'mlp')
  with jax.set_mesh(_mesh(EXPLICIT)):
    assert fsm.logical_out_sharding(names, rules=RULES) == P('data', 'model')
  with jax.set_mesh(_mesh((AxisType.Explicit, AxisType.Auto))):
    assert fsm.logical_out_sharding(names, rules=RULES) == P('data', None)
  with jax.set_mesh(_mesh(AUTO)):
    assert fsm.logical_out_sharding(names, rules=RULES) is None
  assert fsm.logical_out_sharding(names, rules=RULES) is None  # no mesh


def test_out_sharding_reads_the_context_rules():
  with jax.set_mesh(_mesh(EXPLICIT)), fsm.logical_axis_rules(RULES):
    assert fsm.logical_out_sharding(('mlp', 'batch')) == P('model', 'data')


def test_out_sharding_drops_a_tuple_entrys_auto_axes():
  rules = [('batch', ('data', 'model'))]
  with jax.set_mesh(_mesh((AxisType.Auto, AxisType.Explicit))):
    assert fsm.logical_out_sharding(('batch', None), rules=rules) == P('model', None)


def test_linen_model_with_out_sharding_runs_on_both_axis_types():
  results = {}
  for name, types in (('explicit', EXPLICIT), ('auto', AUTO)):
    mesh = _mesh(types)
    model, x = MLP(out_sharding=True), _batch(mesh)
    with fsm.logical_axis_rules(RULES):
      variables = fsm.sharded_init(model.init, mesh)(jax.random.key(0), x)
      apply = fsm.jit(model.apply, mesh=mesh, in_shardings=(variables, ('batch', None)))
      y = apply(variables, x)
    assert y.sharding.spec[0] == 'data'
    results[name] = np.asarray(y)
  np.testing.assert_allclose(results['explicit'], results['auto'], rtol=1e-6)


def test_nnx_layer_takes_a_logical_out_sharding():
  mesh = _mesh(EXPLICIT)
  x = _batch(mesh)
  with jax.set_mesh(mesh), fsm.logical_axis_rules(RULES):
    up = nnx.Linear(4, 16, rngs=nnx.Rngs(0), kernel_init=_nnx_init(('embed', 'mlp')))
    down = nnx.Linear(16, 4, rngs=nnx.Rngs(1), kernel_init=_nnx_init(('mlp', 'embed')))

    @jax.jit
    def forward(x):
      h = nnx.relu(up(x))
      return down(h, out_sharding=fsm.logical_out_sharding(('batch', 'embed')))

    y = forward(x)
  assert y.sharding.spec == P('data', None)


def _nnx_init(names):
  return fsm.nnx.with_logical_partitioning(nnx.initializers.lecun_normal(), names)


# Sharding type errors, explained
# ------------------------------------------------------------------------------


def test_fsm_jit_explains_an_ambiguous_contraction():
  mesh = _mesh(EXPLICIT)
  model, x = MLP(), _batch(mesh)
  with fsm.logical_axis_rules(RULES):
    variables = fsm.sharded_init(model.init, mesh)(jax.random.key(0), x)
    apply = fsm.jit(model.apply, mesh=mesh, in_shardings=(variables, ('batch', None)))
    with pytest.raises(fsm.ExplicitShardingError, match='dot_general') as info:
      apply(variables, x)
  e = info.value
  assert e.operation == 'fsm.jit'
  assert e.operands == ('float32[8@data,16@model]', 'float32[16@model,4]')
  assert 'flax/linen/linear.py' in e.source
  message = str(e)
  # The user's line (this file) and the operation's line in flax are named.
  assert f'{__file__.rsplit("/", 1)[-1]}:' in message and 'in __call__' in message
  assert 'Contracting dimensions are sharded' in e.jax_message
  assert 'AxisType.Auto' in message and 'fsm.logical_out_sharding' in message
  assert type(e.__cause__).__name__ == 'ShardingTypeError'


def test_sharded_init_explains_a_spec_it_cannot_take():
  # A PartitionSpec written for Explicit axes meets sharded_init's tracing with
  # no mesh and with Auto axes; logical_out_sharding adapts, a spec does not.
  class Fixed(nn.Module):
    @nn.compact
    def __call__(self, x):
      dot = functools.partial(jax.lax.dot_general, out_sharding=P('data', None))
      return nn.Dense(4, kernel_init=_init(('embed', 'mlp')), dot_general=dot)(x)

  mesh = _mesh(EXPLICIT)
  with fsm.logical_axis_rules(RULES):
    init = fsm.sharded_init(Fixed().init, mesh)
    with pytest.raises(fsm.ExplicitShardingError, match='logical_out_sharding') as info:
      init(jax.random.key(0), _batch(mesh))
  assert info.value.operation == 'fsm.sharded_init'
  assert 'dot_general was given an out_sharding' in str(info.value)


def test_explained_outside_jit_reads_the_operands_from_locals():
  # Around jax.jit, jax has filtered its own frames out of the traceback.
  mesh = _mesh(EXPLICIT)
  x = jax.device_put(jnp.ones((4, 16)), NamedSharding(mesh, P(None, 'model')))
  w = jax.device_put(jnp.ones((16, 2)), NamedSharding(mesh, P('model', None)))

  def matmul(lhs, rhs):
    return lhs @ rhs

  with jax.set_mesh(mesh):
    with pytest.raises(fsm.ExplicitShardingError, match='my_step') as info:
      with fsm.explain_sharding_type_errors('my_step'):
        jax.jit(matmul)(x, w)
  assert 'lhs: float32[4,16@model]' in info.value.operands
  assert 'return lhs @ rhs' in info.value.source


def test_other_errors_pass_through():
  with pytest.raises(ZeroDivisionError, match='division'):
    with fsm.explain_sharding_type_errors('fsm.jit'):
      _ = 1 / 0
  with pytest.raises(ValueError, match='plain') as info:
    with fsm.explain_sharding_type_errors('fsm.jit'):
      raise ValueError('plain')
  assert not isinstance(info.value, fsm.FlaxShardmetaError)


# Reading jax's frames: the probe of what _explicit relies on, and its fallback
# ------------------------------------------------------------------------------


def _nnx_contraction_error():
  """A real ShardingTypeError from an NNX layer under fsm.jit, explained: the
  second Linear contracts 'model', sharded on both of its operands."""
  mesh = _mesh(EXPLICIT)
  x = _batch(mesh)
  with jax.set_mesh(mesh), fsm.logical_axis_rules(RULES):
    up = nnx.Linear(4, 16, rngs=nnx.Rngs(0), kernel_init=_nnx_init(('embed', 'mlp')))
    down = nnx.Linear(16, 4, rngs=nnx.Rngs(1), kernel_init=_nnx_init(('mlp', 'embed')))

  def forward(up, down, x):
    return down(nnx.relu(up(x)))

  with pytest.raises(fsm.ExplicitShardingError) as info:
    fsm.jit(forward, mesh=mesh, rules=RULES)(up, down, x)
  return info.value


def test_jax_frames_still_hold_the_primitive_and_its_operands():
  # Fails when a jax release moves the locals operands_from_frames reads.
  e = _nnx_contraction_error()
  assert e.operands == ('float32[8@data,16@model]', 'float32[16@model,4]')
  assert str(e).startswith('fsm.jit: jax cannot infer the sharding of dot_general')
  assert 'flax/nnx/nn/linear.py' in e.source
  assert type(e.__cause__) is explicit._JaxShardingTypeError


def test_jax_still_raises_its_sharding_type_error_where_it_is_imported():
  # If it moved, jax's errors would pass through unexplained.
  assert explicit._JaxShardingTypeError is not explicit._NeverRaised
  assert explicit._JaxShardingTypeError.__name__ == 'ShardingTypeError'


def test_renamed_jax_locals_fall_back_to_the_operations_own_locals(monkeypatch):
  monkeypatch.setattr(explicit, '_AVALS_LOCAL', 'no_such_local')
  e = _nnx_contraction_error()
  # flax's Linear.__call__ holds its operands as `inputs` and `kernel`.
  assert 'inputs: float32[8@data,16@model]' in e.operands
  assert 'kernel: float32[16@model,4]' in e.operands
  assert 'operands: inputs: float32[8@data,16@model]' in str(e)


def test_unreadable_frames_still_explain_the_error_without_operands(monkeypatch):
  def unreadable(value):
    raise AttributeError('an aval of another kind')

  monkeypatch.setattr(explicit, '_type_of', unreadable)
  e = _nnx_contraction_error()
  assert e.operands == ()
  message = str(e)
  assert 'operands:' not in message
  assert message.startswith('fsm.jit: jax cannot infer the sharding of')
  assert 'flax/nnx/nn/linear.py' in e.source
  assert 'Contracting dimensions are sharded' in e.jax_message
  assert 'AxisType.Auto' in message and 'fsm.logical_out_sharding' in message


# A TrainState whose static fields differ from the abstract one
# ------------------------------------------------------------------------------


def _state_flow(mesh):
  model = nn.Dense(8, kernel_init=_init(('embed', 'mlp')))

  def init_fn(key):  # builds its optimizer: every call makes another tx
    params = model.init(key, jnp.ones((1, 4)))['params']
    return train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.adam(1e-2)
    )

  def step(state, x):
    def loss_fn(params):
      return jnp.mean(state.apply_fn({'params': params}, x) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  key = jax.random.key(0)
  with fsm.logical_axis_rules(RULES):
    abstract = jax.eval_shape(init_fn, key)
    state = fsm.sharded_init(init_fn, mesh)(key)
  return abstract, state, step


def test_documented_flow_accepts_another_static_tx(axis_type):
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(axis_type,) * 2)
  abstract, state, step = _state_flow(mesh)
  assert state.tx is not abstract.tx  # what jax alone refuses
  train = fsm.jit(
    step,
    mesh=mesh,
    rules=RULES,
    in_shardings=(abstract, ('batch', None)),
    out_shardings=(abstract, None),
  )
  x = _batch(mesh)
  compiled = train.lower(state, x).compile()  # lower follows the same structure
  n_out = len(jax.tree.leaves(compiled.output_shardings))
  assert n_out == len(jax.tree.leaves(state)) + 1
  losses = []
  for _ in range(3):
    state, loss = train(state, x)
    losses.append(float(loss))
  assert losses[2] < losses[0]
  kernel = state.params['kernel'].value
  assert kernel.sharding.spec == P(None, 'model')
  assert state.opt_state[0].mu['kernel'].value.sharding.spec == P(None, 'model')


def test_a_real_structure_mismatch_is_still_refused():
  mesh = _mesh(AUTO)
  abstract, state, step = _state_flow(mesh)
  train = fsm.jit(step, mesh=mesh, rules=RULES, in_shardings=(abstract, None))
  other = state.replace(params={'extra': state.params})
  with pytest.raises(ValueError, match='pytree'):
    train.lower(other, _batch(mesh))
