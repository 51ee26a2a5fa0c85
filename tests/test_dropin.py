"""A flax code base switching to fsm: boxes, tabulate, the bridge, reshaping
layers, forgotten rules and fsm.jit with NNX modules behave as flax's do, or
better. Meshes are (2, 4) ('data', 'model'), Auto or Explicit as each test says
(the ``mesh`` fixture runs both)."""

from __future__ import annotations

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.nnx import bridge
from jax.sharding import AxisType, PartitionSpec as P

import flax_shardmeta as fsm

lecun = nn.initializers.lecun_normal()
RULES = [('batch', 'data'), ('heads', 'model'), ('mlp', 'model')]


def auto_mesh(names=('data', 'model')):
  return jax.make_mesh((2, 4), names, axis_types=(AxisType.Auto,) * 2)


def values_equal(a, b) -> bool:
  leaves_a, leaves_b = jax.tree.leaves(fsm.unbox(a)), jax.tree.leaves(fsm.unbox(b))
  return len(leaves_a) == len(leaves_b) and all(
    np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(leaves_a, leaves_b)
  )


# 1. Boxes compare like flax's
# ------------------------------------------------------------------------------


def test_boxes_compare_by_value_as_flax_boxes_do():
  names = ('layers', 'in', None)
  assert fsm.Partitioned(tuple([8, 3, 3]), names) == fsm.Partitioned((8, 3, 3), names)
  assert nn.Partitioned(tuple([8, 3, 3]), names) == nn.Partitioned((8, 3, 3), names)
  assert fsm.LogicalPartitioned(
    tuple([8, 3]), ('a', None), rules=[('a', 'b')]
  ) == fsm.LogicalPartitioned((8, 3), ('a', None), rules=[('a', 'b')])
  assert fsm.Partitioned((8, 3), ('a', None)) != fsm.Partitioned((8, 4), ('a', None))
  assert fsm.Partitioned((8, 3), ('a', None)) != fsm.Partitioned((8, 3), (None, 'a'))
  assert fsm.Partitioned((8,), ('a',)) != fsm.LogicalPartitioned((8,), ('a',))
  # Arrays: element by element (flax's dataclass boxes cannot say).
  one = fsm.Partitioned(jnp.ones(3), ('x',))
  assert one == fsm.Partitioned(jnp.ones(3), ('x',))
  assert one != fsm.Partitioned(jnp.zeros(3), ('x',))
  assert one != fsm.Partitioned(jnp.ones(4), ('x',))


def test_flax_spelling_logically_partitioned_is_accepted():
  # Code ported from flax writes nn.LogicallyPartitioned; fsm's name for the
  # same box is LogicalPartitioned, and flax's spelling is the same class.
  assert fsm.LogicallyPartitioned is fsm.LogicalPartitioned
  box = fsm.LogicallyPartitioned(jnp.ones((8, 4)), ('batch', 'mlp'))
  assert isinstance(box, nn.LogicallyPartitioned)
  with fsm.logical_axis_rules(RULES):
    (sharding,) = jax.tree.leaves(fsm.get_sharding({'w': box}, auto_mesh()))
  assert sharding.spec == P('data', 'model')


def test_scanned_metadata_checks_as_flax_tests_write_them():
  # flax's own scan tests compare boxed shapes with expected boxes.
  class Body(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      init = fsm.with_partitioning(lecun, ('in', None))
      return nn.Dense(3, kernel_init=init, use_bias=False)(x), None

  scanned = nn.scan(
    Body,
    variable_axes={'params': 0},
    split_rngs={'params': True},
    length=8,
    metadata_params={fsm.PARTITION_NAME: 'layers'},
  )
  variables = jax.eval_shape(scanned().init, jax.random.key(0), jnp.ones((2, 3)), None)
  shapes = jax.tree.map(jnp.shape, variables)
  assert shapes == {
    'params': {
      'Dense_0': {'kernel': fsm.Partitioned((8, 3, 3), ('layers', 'in', None))}
    }
  }


def test_nnx_metadata_of_equal_models_is_equal():
  def make():
    init = fsm.nnx.with_logical_partitioning(lecun, ('embed', 'mlp'), rules=RULES)
    return nnx.Linear(3, 4, kernel_init=init, rngs=nnx.Rngs(0))

  a, b = nnx.state(make()), nnx.state(make())
  assert a['kernel'].get_metadata() == b['kernel'].get_metadata()
  assert jax.tree.structure(a) == jax.tree.structure(b)


# 2. Module.tabulate
# ------------------------------------------------------------------------------


@pytest.mark.parametrize(
  'ours, flax_own',
  [
    (fsm.with_partitioning, nn.with_partitioning),
    (fsm.with_logical_partitioning, nn.with_logical_partitioning),
  ],
  ids=['mesh-axes', 'logical'],
)
def test_tabulate_shows_fsm_boxes_as_flax_boxes(ours, flax_own):
  names = (None, 'model') if ours is fsm.with_partitioning else ('embed', 'mlp')
  x, key = jnp.ones((2, 3)), jax.random.key(0)
  kwargs = {'console_kwargs': {'width': 120, 'force_terminal': False}}
  table = nn.Dense(8, kernel_init=ours(lecun, names)).tabulate(key, x, **kwargs)
  flax_table = nn.Dense(8, kernel_init=flax_own(lecun, names)).tabulate(
    key, x, **kwargs
  )
  assert table == flax_table
  shown = ', '.join('None' if n is None else n for n in names)
  assert f'kernel: float32[3,8] P({shown})' in table


# 3. nnx.bridge
# ------------------------------------------------------------------------------


@pytest.mark.parametrize('which', ['fsm-mesh-axes', 'flax', 'fsm-logical'])
def test_annotations_through_to_linen_are_read(which):
  mesh = auto_mesh(('in', 'out'))
  init = nnx.initializers.lecun_normal()
  kernel_init = {
    'fsm-mesh-axes': fsm.nnx.with_partitioning(init, ('in', 'out')),
    'flax': nnx.with_partitioning(init, ('in', 'out')),
    'fsm-logical': fsm.nnx.with_logical_partitioning(init, ('a', 'b')),
  }[which]
  model = bridge.to_linen(nnx.Linear, 32, 64, kernel_init=kernel_init)
  rules = [('a', 'in'), ('b', 'out')]
  with jax.set_mesh(mesh), fsm.logical_axis_rules(rules), nn.logical_axis_rules(rules):
    variables = model.init(jax.random.key(0), jnp.ones((4, 32)))
    written = fsm.get_partition_spec(variables)['params']['kernel']
    sharding = fsm.get_sharding(variables, mesh)['params']['kernel']
    flax_spec = nn.get_partition_spec(variables)['params']['kernel']
  assert type(variables['params']['kernel']).__name__ == 'NNXMeta'
  assert written == (P('a', 'b') if which == 'fsm-logical' else P('in', 'out'))
  assert sharding.spec == P('in', 'out') == flax_spec


def test_to_nnx_keeps_fsm_linen_annotations():
  mesh = auto_mesh(('in', 'out'))
  rules = [('a', 'in'), ('b', 'out')]
  linen = nn.Dense(64, kernel_init=fsm.with_logical_partitioning(lecun, ('a', 'b')))
  with jax.set_mesh(mesh), fsm.logical_axis_rules(rules):
    module = bridge.ToNNX(linen, rngs=nnx.Rngs(0))
    bridge.lazy_init(module, jnp.ones((4, 32)))
    state = nnx.state(module)
    assert fsm.get_partition_spec(state)['kernel'].get_value() == P('a', 'b')
    assert fsm.get_sharding(state, mesh)['kernel'].get_value().spec == P('in', 'out')


# 4. fsm.nnx.eval_shape and as_abstract
# ------------------------------------------------------------------------------


def test_eval_shape_takes_flax_annotated_variables(mesh):
  def create():
    metadata = {'out_sharding': ('data', 'model')}
    return nnx.Linear(8, 16, kernel_metadata=metadata, rngs=nnx.Rngs(0))

  with jax.set_mesh(mesh):
    flax_abstract = nnx.eval_shape(create)
    ours = fsm.nnx.eval_shape(create, mesh=mesh)
  assert flax_abstract.kernel.get_value().sharding.spec == P('data', 'model')
  assert ours.kernel.get_value().sharding.spec == P('data', 'model')
  # The same Variables as flax's (their metadata is part of the state's structure).
  assert jax.tree.structure(nnx.state(ours)) == jax.tree.structure(
    nnx.state(flax_abstract)
  )
  # On an AbstractMesh, with no context set.
  abstract_mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
  spec = fsm.nnx.eval_shape(create, mesh=abstract_mesh).kernel.get_value().sharding
  assert spec.spec == P('data', 'model')


def test_eval_shape_replicates_flax_names_flax_itself_refuses(mesh):
  # 'embed' is no mesh axis: flax's eager sharding refuses it; fsm's reading
  # replicates a name no rule maps, or maps it through the rules given.
  def create():
    metadata = {'out_sharding': ('embed', 'model')}
    return nnx.Linear(8, 16, kernel_metadata=metadata, rngs=nnx.Rngs(0))

  with jax.set_mesh(mesh), pytest.raises(ValueError):
    nnx.eval_shape(create)
  abstract = fsm.nnx.eval_shape(create, mesh=mesh, rules=[('embed', 'data')])
  assert abstract.kernel.get_value().sharding.spec == P('data', 'model')
  assert abstract.kernel.get_metadata()['eager_sharding'] is True  # as flax sets it


def test_as_abstract_on_variables_holding_trees_and_variables():
  mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
  holding_tree = nnx.Param(
    {'x': jnp.ones((4, 8)), 'y': jnp.ones((4, 8))},
    out_sharding=('data', None),
    eager_sharding=False,
  )
  inner = nnx.Param(
    jnp.ones((4, 8)), out_sharding=('data', 'model'), eager_sharding=False
  )
  out = fsm.nnx.as_abstract({'tree': holding_tree, 'nested': nnx.Variable(inner)}, mesh)
  tree_value = out['tree'].get_value()
  assert {k: v.sharding.spec for k, v in tree_value.items()} == {
    'x': P('data', None),
    'y': P('data', None),
  }
  nested = out['nested'].get_value().get_value()
  assert nested.sharding.spec == P('data', 'model') and nested.shape == (4, 8)
  # A tree value whose arrays the annotation does not fit is named by path.
  bad = nnx.Param({'x': jnp.ones((4, 8))}, out_sharding=('data',), eager_sharding=False)
  with pytest.raises(fsm.ShardingError, match=r'bad/x: shape \(4, 8\)'):
    fsm.nnx.as_abstract({'bad': bad}, mesh)


def test_hijax_variables_are_read_and_laid_out(mesh):
  abstract_mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
  flax_own = nnx.Param(
    jnp.ones((4, 8)), out_sharding=('data', 'model'), eager_sharding=False, hijax=True
  )
  assert fsm.get_sharding(flax_own, abstract_mesh).spec == P('data', 'model')
  ours = nnx.Param(
    fsm.nnx.with_partitioning(lambda: jnp.ones((4, 8)), ('data', 'model'))(),
    hijax=True,
  )
  assert fsm.get_sharding({'w': ours}, abstract_mesh)['w'].spec == P('data', 'model')
  abstract = fsm.nnx.as_abstract({'w': ours}, abstract_mesh)['w']
  assert abstract.get_value().sharding.spec == P('data', 'model')
  assert abstract.get_metadata()['hijax'] is True
  with jax.set_mesh(mesh):
    eager = nnx.Param(
      fsm.nnx.with_partitioning(lambda: jnp.ones((4, 8)), ('data', 'model'))(),
      hijax=True,
    )
  assert eager.get_value().sharding.spec == P('data', 'model')


# 5. Layers that reshape their kernels
# ------------------------------------------------------------------------------


def attention(partitioning):
  return nn.MultiHeadDotProductAttention(
    num_heads=4,
    qkv_features=16,
    kernel_init=partitioning(lecun, ('embed', 'heads', 'kv')),
    out_kernel_init=partitioning(lecun, ('heads', 'kv', 'embed')),
  )


def test_linen_attention_with_per_head_names_inits_and_trains(mesh):
  model, x, key = attention(fsm.with_logical_partitioning), jnp.ones((4, 8, 16)), None
  key = jax.random.key(0)
  reference = attention(nn.with_logical_partitioning).init(key, x)  # no mesh
  with fsm.logical_axis_rules(RULES):
    variables = fsm.sharded_init(model.init, mesh)(key, x)
  assert values_equal(variables, reference)
  params = variables['params']
  assert params['query']['kernel'].names == ('embed', 'heads', 'kv')
  assert params['query']['kernel'].value.sharding.spec == P(None, 'model', None)
  assert params['out']['kernel'].value.sharding.spec == P('model', None, None)
  if mesh.axis_types[0] == AxisType.Explicit:
    return  # flax's attention takes no out_sharding for its einsums

  def step(params, x):
    def loss(p):
      return jnp.mean(model.apply({'params': p}, x) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

  train = fsm.jit(step, mesh=mesh, rules=RULES, out_shardings=(params, None))
  new, loss = train(params, x)
  assert np.isfinite(loss)
  assert new['out']['kernel'].value.sharding.spec == P('model', None, None)


def test_dense_general_values_equal_flax_and_jit_init_works(mesh):
  def dense(partitioning):
    return nn.DenseGeneral(
      (4, 4),
      kernel_init=partitioning(lecun, ('embed', 'heads', 'kv')),
      bias_init=partitioning(nn.initializers.normal(), ('heads', 'kv')),
    )

  x, key = jnp.ones((2, 16)), jax.random.key(1)
  # Compared with the same program (jit) of flax's own boxes, no mesh. A plain
  # jax.jit under a mesh is XLA's program, partitioned as XLA likes, so equal
  # up to rounding (bit-identical values are fsm.sharded_init's promise).
  reference = jax.jit(dense(nn.with_logical_partitioning).init)(key, x)
  with jax.set_mesh(mesh), fsm.logical_axis_rules(RULES):
    variables = jax.jit(dense(fsm.with_logical_partitioning).init)(key, x)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
    fsm.unbox(variables),
    fsm.unbox(reference),
  )
  shardings = fsm.get_sharding(variables, mesh, RULES)['params']
  assert shardings['kernel'].spec == P(None, 'model', None)
  assert shardings['bias'].spec == P('model', None)


def test_wrong_rank_is_still_named_where_it_is_laid_out():
  mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
  init = fsm.with_partitioning(lecun, ('data', None, 'model'))
  variables = jax.eval_shape(
    nn.Dense(8, kernel_init=init).init, jax.random.key(0), jnp.ones((2, 4))
  )
  with pytest.raises(fsm.ShardingError) as info:
    fsm.get_sharding(variables, mesh)
  message = str(info.value)
  assert 'params/kernel: shape (4, 8)' in message
  assert '3 names for a rank-2 array' in message
  assert 'nn.scan' not in message  # no transform is involved


@pytest.mark.parametrize('kind', ['linear-general', 'attention'])
def test_nnx_layers_that_reshape_kernels_are_laid_out(mesh, kind):
  init = nnx.initializers.lecun_normal()

  def build(kernel_init, out_kernel_init, bias_init=None):
    bias_init = bias_init or nnx.initializers.zeros_init()
    if kind == 'linear-general':
      return nnx.LinearGeneral(
        16, (4, 4), kernel_init=kernel_init, bias_init=bias_init, rngs=nnx.Rngs(0)
      )
    return nnx.MultiHeadAttention(
      num_heads=4,
      in_features=16,
      qkv_features=16,
      decode=False,
      kernel_init=kernel_init,
      out_kernel_init=out_kernel_init,
      rngs=nnx.Rngs(0),
    )

  reference = build(init, init)
  names, out_names = ('embed', 'heads', 'kv'), ('heads', 'kv', 'embed')
  with jax.set_mesh(mesh), fsm.logical_axis_rules(RULES):
    ours = build(
      fsm.nnx.with_logical_partitioning(init, names),
      fsm.nnx.with_logical_partitioning(init, out_names),
      fsm.nnx.with_logical_partitioning(nnx.initializers.zeros_init(), ('heads', 'kv')),
    )
    flax_own = build(
      nnx.with_partitioning(init, (None, 'model', None)),
      nnx.with_partitioning(init, ('model', None, None)),
    )
  first = ours if kind == 'linear-general' else ours.query
  flax_first = flax_own if kind == 'linear-general' else flax_own.query
  reference_first = reference if kind == 'linear-general' else reference.query
  assert first.kernel.get_value().sharding.spec == P(None, 'model', None)
  assert flax_first.kernel.get_value().sharding.spec == P(None, 'model', None)
  if kind == 'linear-general':
    assert first.bias.get_value().sharding.spec == P('model', None)
  assert np.array_equal(first.kernel.get_value(), reference_first.kernel.get_value())
  if kind == 'attention':
    assert ours.out.kernel.get_value().sharding.spec == P('model', None, None)
    assert np.array_equal(ours.out.kernel.get_value(), reference.out.kernel.get_value())


def test_nnx_wrong_rank_is_an_error_when_the_variable_is_made(mesh):
  init = fsm.nnx.with_partitioning(lecun, ('data', None, 'model'))
  with (
    jax.set_mesh(mesh),
    pytest.raises(fsm.ShardingError, match='3 names for a rank-2'),
  ):
    nnx.Linear(4, 8, kernel_init=init, rngs=nnx.Rngs(0))


# 6. Forgetting the rules is never silent
# ------------------------------------------------------------------------------


def test_nnx_construction_without_rules_warns_once_per_line(mesh):
  init = fsm.nnx.with_logical_partitioning(lecun, ('embed', 'mlp'))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('default')
    with jax.set_mesh(mesh):
      for _ in range(3):
        nnx.Linear(4, 8, kernel_init=init, rngs=nnx.Rngs(0))  # one line, 3 times
  (warning,) = [w for w in caught if w.category is fsm.UnmappedNameWarning]
  assert "('embed', 'mlp')" in str(warning.message)
  assert warning.filename == __file__  # the user's line, not flax's
  # Rules set, rules=() on purpose, or no mesh: nothing to say.
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    with jax.set_mesh(mesh), fsm.logical_axis_rules(RULES):
      nnx.Linear(4, 8, kernel_init=init, rngs=nnx.Rngs(0))
    on_purpose = fsm.nnx.with_logical_partitioning(lecun, ('embed', 'mlp'), rules=())
    with jax.set_mesh(mesh):
      nnx.Linear(4, 8, kernel_init=on_purpose, rngs=nnx.Rngs(0))
    nnx.Linear(4, 8, kernel_init=init, rngs=nnx.Rngs(0))


def test_fsm_jit_with_logical_shardings_and_no_rules_warns(mesh):
  with pytest.warns(fsm.UnmappedNameWarning, match=r"fsm.jit .*\('batch'\)") as caught:
    fsm.jit(lambda x: x, mesh=mesh, in_shardings=(('batch', None),))
  assert caught[0].filename == __file__
  tree = {
    'w': fsm.LogicalPartitioned(
      jax.ShapeDtypeStruct((8, 4), jnp.float32), ('mlp', None)
    )
  }
  with pytest.warns(fsm.UnmappedNameWarning, match="'mlp'"):
    fsm.jit(lambda w: w, mesh=mesh, out_shardings=tree)
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    fsm.jit(lambda x: x, mesh=mesh, rules=(), in_shardings=(('batch', None),))
    fsm.jit(lambda x: x, mesh=mesh, rules=RULES, in_shardings=(('batch', None),))


# 9. fsm.jit with NNX modules
# ------------------------------------------------------------------------------


class Mlp(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.up = nnx.Linear(
      4,
      16,
      kernel_init=fsm.nnx.with_logical_partitioning(lecun, ('embed', 'mlp')),
      rngs=rngs,
    )
    self.down = nnx.Linear(
      16,
      1,
      kernel_init=fsm.nnx.with_logical_partitioning(lecun, ('mlp', 'embed')),
      rngs=rngs,
    )

  def __call__(self, x):
    return self.down(jax.nn.relu(self.up(x)))


def train_step(model, optimizer, x):
  def loss_fn(m):
    return jnp.mean((m(x) - 1.0) ** 2)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def test_fsm_jit_takes_modules_and_writes_their_updates_back():
  mesh = auto_mesh()  # flax's Linear takes no out_sharding here: Auto axes
  with jax.set_mesh(mesh), fsm.logical_axis_rules(RULES):
    model = Mlp(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  step = fsm.jit(
    train_step, mesh=mesh, rules=RULES, in_shardings=(None, None, ('batch', None))
  )
  x = jnp.ones((8, 4))
  before = np.asarray(model.up.kernel.get_value())
  losses = [float(step(model, optimizer, x)) for _ in range(3)]
  assert losses[0] > losses[1] > losses[2]
  assert not np.array_equal(before, model.up.kernel.get_value())
  assert model.up.kernel.get_value().sharding.spec == P(None, 'model')
  mu = optimizer.opt_state[0].mu['up']['kernel'].get_value()
  assert mu.sharding.spec == P(None, 'model')
  assert int(optimizer.step.get_value()) == 3


def test_fsm_jit_refuses_what_it_cannot_update():
  mesh = auto_mesh()
  with jax.set_mesh(mesh), fsm.logical_axis_rules(RULES):
    model = Mlp(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  x = jnp.ones((8, 4))
  closed = fsm.jit(lambda x: train_step(model, optimizer, x), mesh=mesh, rules=RULES)
  with pytest.raises(fsm.NnxJitError, match=re.escape('step(model, optimizer, batch)')):
    closed(x)
  nested = fsm.jit(lambda pair, x: train_step(*pair, x), mesh=mesh, rules=RULES)
  with pytest.raises(fsm.NnxJitError, match='inside argument 0'):
    nested((model, optimizer), x)
  sharded = fsm.jit(train_step, mesh=mesh, rules=RULES, in_shardings=(P(), None, None))
  with pytest.raises(fsm.NnxJitError, match='pass None at that position'):
    sharded(model, optimizer, x)


def test_explanations_print_one_dimension_per_line():
  mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
  tree = {
    'w': fsm.LogicalPartitioned(
      jax.ShapeDtypeStruct((8, 16), jnp.float32), ('embed', 'mlp')
    )
  }
  plan = fsm.plan(tree, mesh, [('mlp', 'model'), ('embed', 'model')])
  assert str(plan.entry('w').explain).splitlines() == [
    "dim 0 'embed' -> None: rule #1 ('embed', 'model') skipped: mesh axis 'model' "
    "already used by dimension 1 ('mlp'); every rule was skipped, so replicated",
    "dim 1 'mlp' -> 'model': rule #0 ('mlp', 'model') gave: 'model'",
  ]
  assert len(fsm.explain_resolution(('embed', 'mlp'), [('mlp', 'model')])) == 2
  assert 'DimExplanation' not in str(fsm.explain_resolution(('mlp',), [('mlp', 'x')]))
