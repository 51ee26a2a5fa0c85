"""Extraction, resolution and validation of shardings over whole trees."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm

KEY = jax.random.key(0)
RULES = (('batch', 'data'), ('hidden', 'model'), ('embed', None))


class DotReluDot(nn.Module):
  depth: int
  names1: tuple
  names2: tuple
  logical: bool = False

  @nn.compact
  def __call__(self, x):
    wrap = fsm.with_logical_partitioning if self.logical else fsm.with_partitioning
    init = nn.initializers.xavier_normal()
    y = nn.Dense(self.depth, use_bias=False, kernel_init=wrap(init, self.names1))(x)
    w2 = self.param('W2', wrap(init, self.names2), (self.depth, x.shape[-1]))
    return jax.nn.relu(y) @ w2


class Net(nn.Module):
  depth: int = 16
  names1: tuple = (None, 'model')
  names2: tuple = ('model', None)
  logical: bool = False

  @nn.compact
  def __call__(self, x):
    x = DotReluDot(self.depth, self.names1, self.names2, self.logical)(x)
    return nn.Dense(x.shape[-1], use_bias=True)(x)


def abstract_vars(model, width=8, batch=8):
  return jax.eval_shape(model.init, KEY, jnp.ones((batch, width)))


def make_state(model, tx, width=8):
  def init(key, x):
    params = model.init(key, x)['params']
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  return init, (KEY, jnp.ones((8, width)))


def spec_leaves(tree):
  return [
    s.spec if s is not None else None
    for s in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: x is None)
  ]


# get_partition_spec
# ------------------------------------------------------------------------------


def test_get_partition_spec_is_as_written():
  tree = {
    'mesh': fsm.Partitioned(jnp.zeros((2, 4)), (None, 'model')),
    'logical': fsm.LogicalPartitioned(jnp.zeros((2, 4)), ('embed', 'mlp')),
    'flax': nn.LogicallyPartitioned(jnp.zeros((2, 4)), ('embed', 'mlp')),
    'plain': jnp.zeros(3),
    'abstract': jax.ShapeDtypeStruct((4,), jnp.float32),
    'scalar': jnp.float32(1.0),
    'other': 'a string',
    'count': 3,
  }
  specs = fsm.get_partition_spec(tree)
  assert specs['mesh'] == P(None, 'model')
  assert specs['logical'] == P('embed', 'mlp')
  assert specs['flax'] == P('embed', 'mlp')
  assert specs['plain'] == P()
  assert specs['abstract'] == P()
  assert specs['scalar'] == P()
  assert specs['other'] is None
  assert specs['count'] is None


def test_get_partition_spec_of_model_variables():
  variables = abstract_vars(
    Net(logical=True, names1=('embed', 'hidden'), names2=('hidden', 'embed'))
  )
  specs = fsm.get_partition_spec(variables)
  assert specs['params']['DotReluDot_0']['Dense_0']['kernel'] == P('embed', 'hidden')
  assert specs['params']['DotReluDot_0']['W2'] == P('hidden', 'embed')
  assert specs['params']['Dense_0']['kernel'] == P()


# get_sharding
# ------------------------------------------------------------------------------


@pytest.mark.parametrize('logical', [False, True])
def test_get_sharding_on_eval_shape(mesh, logical):
  names = (
    (('embed', 'hidden'), ('hidden', 'embed'))
    if logical
    else ((None, 'model'), ('model', None))
  )
  variables = abstract_vars(Net(16, *names, logical=logical))
  shardings = fsm.get_sharding(variables, mesh, RULES)
  params = shardings['params']
  assert params['DotReluDot_0']['Dense_0']['kernel'] == NamedSharding(
    mesh, P(None, 'model')
  )
  assert params['DotReluDot_0']['W2'] == NamedSharding(mesh, P('model', None))
  assert params['Dense_0']['kernel'] == NamedSharding(mesh, P())
  assert params['Dense_0']['bias'] == NamedSharding(mesh, P())
  # The output has the input's structure, boxes included.
  assert isinstance(params['DotReluDot_0']['W2'], NamedSharding)
  assert jax.tree_util.tree_structure(
    jax.tree_util.tree_map(lambda _: 0, shardings)
  ) == jax.tree_util.tree_structure(
    jax.tree_util.tree_map(lambda _: 0, fsm.unbox(variables))
  )


def test_get_sharding_uses_context_rules(mesh):
  variables = abstract_vars(
    Net(16, ('embed', 'hidden'), ('hidden', 'embed'), logical=True)
  )
  with fsm.logical_axis_rules([('hidden', 'data')]):
    ctx = fsm.get_sharding(variables, mesh)
  assert ctx['params']['DotReluDot_0']['W2'].spec == P('data', None)
  # Explicit rules win over the context.
  with fsm.logical_axis_rules([('hidden', 'data')]):
    explicit = fsm.get_sharding(variables, mesh, RULES)
  assert explicit['params']['DotReluDot_0']['W2'].spec == P('model', None)
  # No rules at all: logical names are replicated, with one warning saying so.
  with pytest.warns(fsm.UnmappedNameWarning, match='2 array.* no logical axis rules'):
    none = fsm.get_sharding(variables, mesh)
  assert none['params']['DotReluDot_0']['W2'].spec == P(None, None)
  # Rules given as empty on purpose: replicated without a word.
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    fsm.get_sharding(variables, mesh, ())


def test_get_sharding_composes_per_variable_rules(mesh):
  tree = {
    'w': fsm.LogicalPartitioned(
      jax.ShapeDtypeStruct((8, 8), jnp.float32),
      ('embed', 'mlp'),
      rules=[('mlp', 'model')],
    ),
    'v': fsm.LogicalPartitioned(
      jax.ShapeDtypeStruct((8, 8), jnp.float32),
      ('embed', 'mlp'),
      rules=[('embed', 'data')],
    ),
  }
  out = fsm.get_sharding(
    {'w': tree['w']}, mesh, [('embed', 'model'), ('embed', 'data')]
  )
  # Global 'embed' takes 'model', so the local 'mlp' rule finds it used.
  assert out['w'].spec == P('model', None)
  # A conflict between global and per-variable rules is reported by path.
  with pytest.raises(fsm.ShardingError, match='conflicting first choices') as info:
    fsm.get_sharding(tree, mesh, [('embed', 'model')])
  (problem,) = info.value.problems
  assert problem.path == 'v'
  assert "('embed', 'model')" in problem.reason
  assert "('embed', 'data')" in problem.reason
  assert '.. Fix' not in str(info.value)


def test_duplicate_logical_name_is_reported_by_path(mesh):
  tree = {
    'layer': {
      'w': fsm.LogicalPartitioned(
        jax.ShapeDtypeStruct((8, 8), jnp.float32), ('embed', 'embed')
      )
    }
  }
  with pytest.raises(
    fsm.InvalidNamesError, match="layer/w: .*'embed' appears more than once"
  ) as info:
    fsm.get_sharding(tree, mesh, RULES)
  assert [p.path for p in info.value.problems] == ['layer/w']


def test_get_sharding_with_abstract_mesh():
  mesh = AbstractMesh((2, 4), ('data', 'model'))
  variables = abstract_vars(Net())
  out = fsm.get_sharding(variables, mesh)
  assert out['params']['DotReluDot_0']['W2'].spec == P('model', None)
  assert out['params']['DotReluDot_0']['W2'].mesh == mesh


def test_get_sharding_non_array_leaves_are_none(mesh):
  out = fsm.get_sharding({'a': 'text', 'b': None, 'c': jnp.zeros(2)}, mesh)
  assert out['a'] is None and out['b'] is None
  assert out['c'] == NamedSharding(mesh, P())


def test_get_sharding_flax_own_boxes(mesh):
  tree = {
    'mesh': nn.Partitioned(
      jax.ShapeDtypeStruct((8, 8), jnp.float32), ('data', 'model')
    ),
    'logical': nn.LogicallyPartitioned(
      jax.ShapeDtypeStruct((8, 8), jnp.float32),
      ('embed', 'hidden'),
      rules=(('embed', 'data'),),
    ),
  }
  out = fsm.get_sharding(tree, mesh, [('hidden', 'model')])
  assert out['mesh'].spec == P('data', 'model')
  # The box's own rules compose with the global ones.
  assert out['logical'].spec == P('data', 'model')
  with pytest.raises(fsm.ShardingError, match='conflicting first choices'):
    fsm.get_sharding(tree, mesh, [('embed', None)])


@pytest.mark.parametrize(
  'tx', [optax.adam(1e-3), optax.sgd(1e-2, momentum=0.9)], ids=['adam', 'sgd-momentum']
)
def test_get_sharding_train_state(mesh, tx):
  model = Net(16)
  init, args = make_state(model, tx)
  state = jax.eval_shape(init, *args)
  shardings = fsm.get_sharding(state, mesh)
  assert shardings.step == NamedSharding(mesh, P())
  kernel = NamedSharding(mesh, P(None, 'model'))
  assert shardings.params['DotReluDot_0']['Dense_0']['kernel'] == kernel
  # Every full-rank moment mirrors its parameter.
  moments = [
    leaf
    for path, leaf in jax.tree_util.tree_flatten_with_path(shardings.opt_state)[0]
    if 'DotReluDot_0' in jax.tree_util.keystr(path)
    and 'Dense_0' in jax.tree_util.keystr(path)
  ]
  assert moments and all(m == kernel for m in moments)
  real = jax.jit(init, out_shardings=shardings)(*args)
  for s, a in zip(
    jax.tree_util.tree_leaves(shardings), jax.tree_util.tree_leaves(real)
  ):
    assert a.sharding.is_equivalent_to(s, a.ndim)


class BiasedNet(nn.Module):
  """Rank-1 and rank-2 sharded parameters, large enough to be factored."""

  @nn.compact
  def __call__(self, x):
    dense = nn.Dense(
      256,
      kernel_init=fsm.with_partitioning(
        nn.initializers.lecun_normal(), ('data', 'model')
      ),
      bias_init=fsm.with_partitioning(nn.initializers.zeros, ('model',)),
    )
    return dense(x)


@pytest.mark.parametrize(
  'min_dim_size_to_factor', [128, 100_000], ids=['factored', 'unfactored']
)
def test_adafactor_state_gets_valid_shardings(mesh, min_dim_size_to_factor):
  tx = optax.adafactor(1e-3, min_dim_size_to_factor=min_dim_size_to_factor)
  init, args = make_state(BiasedNet(), tx, width=128)
  state = jax.eval_shape(init, *args)
  shardings = fsm.get_sharding(state, mesh)
  factored = shardings.opt_state[0]
  abstract = state.opt_state[0]
  for field in ('v_row', 'v_col', 'v'):
    for name in ('kernel', 'bias'):
      sharding = getattr(factored, field)['Dense_0'][name]
      leaf = getattr(abstract, field)['Dense_0'][name].value
      # jax accepts the sharding for that exact shape.
      placed = jax.device_put(jnp.zeros(leaf.shape, leaf.dtype), sharding)
      assert placed.sharding == sharding
  # Moments that still have the parameter's shape follow it.
  if min_dim_size_to_factor > 256:
    assert factored.v['Dense_0']['kernel'].spec == P('data', 'model')
  else:
    assert factored.v_row['Dense_0']['kernel'].spec == P()
    assert factored.v_col['Dense_0']['kernel'].spec == P()
  assert factored.v['Dense_0']['bias'].spec == P('model')
  assert factored.v_row['Dense_0']['bias'].spec == P()  # shape (1,)
  real = jax.jit(init, out_shardings=shardings)(*args)
  for s, a in zip(
    jax.tree_util.tree_leaves(shardings), jax.tree_util.tree_leaves(real)
  ):
    assert a.sharding.is_equivalent_to(s, a.ndim)


# ShardingError
# ------------------------------------------------------------------------------

KERNEL = 'params/DotReluDot_0/Dense_0/kernel'


@pytest.mark.parametrize(
  'names1, depth, reason',
  [
    (('data', None, 'model'), 16, '3 names for a rank-2 array'),
    (
      (None, 'expert'),
      16,
      r"mesh axis 'expert' \(dimension 1\) is not in the "
      r'mesh \(data=2, model=4\)',
    ),
    (
      ('model', 'model'),
      16,
      "mesh axis 'model' shards both dimension 0 and dimension 1",
    ),
    ((None, 'model'), 6, "dimension 1 of size 6 is not divisible by 'model'=4"),
    (
      (None, ('data', 'model')),
      12,
      r"dimension 1 of size 12 is not divisible by 'data'=2 x 'model'=4 \(= 8\)",
    ),
  ],
)
def test_sharding_error_names_the_parameter(mesh, names1, depth, reason):
  variables = abstract_vars(Net(depth, names1, (None, None)))
  with pytest.raises(fsm.ShardingError, match=reason) as info:
    fsm.get_sharding(variables, mesh)
  error = info.value
  assert isinstance(error, ValueError)
  (problem,) = error.problems
  assert problem.path == KERNEL
  assert problem.shape == (8, depth)
  assert problem.names == names1
  message = str(error)
  assert f'{KERNEL}: shape (8, {depth})' in message
  assert 'Fix: ' in message and problem.hint in message
  assert problem.reason in message
  if len(names1) == 2:
    assert problem.spec == P(*names1)
    assert 'spec P(' in message
  else:
    # More names than dimensions: no transform added one, so no word of nn.scan.
    assert 'metadata_params' not in problem.hint
    assert 'one name per dimension' in problem.hint


def test_sharding_error_logical_names_show_the_resolved_spec(mesh):
  variables = abstract_vars(
    Net(6, ('embed', 'hidden'), ('hidden', 'embed'), logical=True)
  )
  with pytest.raises(fsm.ShardingError, match='2 leaves cannot be sharded') as info:
    fsm.get_sharding(variables, mesh, RULES)
  problems = {p.path: p for p in info.value.problems}
  assert set(problems) == {KERNEL, 'params/DotReluDot_0/W2'}
  kernel = problems[KERNEL]
  assert kernel.names == ('embed', 'hidden')
  assert kernel.spec == P(None, 'model')
  assert "names ('embed', 'hidden'), spec P(None, 'model')" in str(info.value)


def test_several_bad_leaves_reported_together(mesh):
  variables = abstract_vars(Net(6, ('data', None, 'model'), ('model', 'expert')))
  with pytest.raises(fsm.ShardingError, match='^2 leaves cannot be sharded') as info:
    fsm.get_sharding(variables, mesh)
  problems = info.value.problems
  assert sorted(p.path for p in problems) == [
    'params/DotReluDot_0/Dense_0/kernel',
    'params/DotReluDot_0/W2',
    'params/DotReluDot_0/W2',
  ]
  reasons = ' | '.join(p.reason for p in problems)
  assert '3 names for a rank-2 array' in reasons
  assert "mesh axis 'expert'" in reasons
  assert 'dimension 0 of size 6 is not divisible' in reasons
  # A header, a line per problem and the errors page's section.
  assert len(str(info.value).splitlines()) == 5


def test_problem_to_dict(mesh):
  variables = abstract_vars(Net(6))
  with pytest.raises(fsm.ShardingError, match='not divisible') as info:
    fsm.get_sharding(variables, mesh)
  record = info.value.problems[0].to_dict()
  assert record['path'] in (KERNEL, 'params/DotReluDot_0/W2')
  assert set(record) == {'path', 'shape', 'names', 'spec', 'reason', 'hint'}


def test_box_that_lost_its_rank_after_a_transform_is_reported(mesh):
  # jax.vmap knows nothing of boxes: it stacks the values, the names stay.
  model = Net(16)
  keys = jax.random.split(KEY, 2)
  variables = jax.eval_shape(
    jax.vmap(model.init, in_axes=(0, None)), keys, jnp.ones((8, 8))
  )
  box = variables['params']['DotReluDot_0']['W2']
  assert box.value.shape == (2, 16, 8) and box.names == ('model', None)
  with pytest.raises(fsm.ShardingError, match='2 names for a rank-3 array') as info:
    fsm.get_sharding(variables, mesh)
  paths = sorted(p.path for p in info.value.problems)
  assert paths == [KERNEL, 'params/DotReluDot_0/W2']
  assert all('metadata_params' in p.hint for p in info.value.problems)


def test_flax_lifted_vmap_keeps_names_in_step(mesh):
  layer = nn.vmap(
    DotReluDot,
    in_axes=0,
    out_axes=0,
    variable_axes={'params': 0},
    split_rngs={'params': True},
    metadata_params={fsm.PARTITION_NAME: 'data'},
  )
  model = layer(16, (None, 'model'), ('model', None))
  variables = jax.eval_shape(model.init, KEY, jnp.ones((2, 4, 8)))
  out = fsm.get_sharding(variables, mesh)
  assert out['params']['W2'].spec == P('data', 'model', None)


# logical_to_mesh, logical_to_mesh_sharding
# ------------------------------------------------------------------------------


def test_logical_to_mesh():
  tree = {'w': P('embed', 'hidden'), 'b': P('hidden'), 'n': None}
  out = fsm.logical_to_mesh(tree, RULES)
  assert out == {'w': P(None, 'model'), 'b': P('model'), 'n': None}
  # A bare string is no spec: flax reads it letter by letter, fsm names it.
  with pytest.raises(fsm.InvalidNamesError, match=r"\['s'\]|s="):
    fsm.logical_to_mesh({**tree, 's': 'x'}, RULES)
  with fsm.logical_axis_rules([('hidden', 'data')]):
    assert fsm.logical_to_mesh(tree)['b'] == P('data')


def test_logical_to_mesh_of_partition_specs_from_boxes():
  variables = abstract_vars(
    Net(16, ('embed', 'hidden'), ('hidden', 'embed'), logical=True)
  )
  specs = fsm.logical_to_mesh(fsm.get_partition_spec(variables), RULES)
  assert specs['params']['DotReluDot_0']['W2'] == P('model', None)
  assert specs['params']['Dense_0']['kernel'] == P()


def test_logical_to_mesh_sharding(mesh):
  out = fsm.logical_to_mesh_sharding(
    {'x': P('batch', 'embed'), 'w': P('embed', 'hidden')}, mesh, RULES
  )
  assert out['x'] == NamedSharding(mesh, P('data', None))
  assert out['w'] == NamedSharding(mesh, P(None, 'model'))


def test_logical_to_mesh_sharding_reports_missing_axes(mesh):
  with pytest.raises(fsm.ShardingError, match="mesh axis 'expert'") as info:
    fsm.logical_to_mesh_sharding(
      {'moe': P('experts', 'hidden')},
      mesh,
      [('experts', 'expert'), ('hidden', 'model')],
    )
  assert info.value.problems[0].path == 'moe'
  assert info.value.problems[0].spec == P('expert', 'model')


# replicate_indivisible=True
# ------------------------------------------------------------------------------


def test_replicate_indivisible_replicates_and_warns(mesh):
  variables = abstract_vars(Net(6, (None, 'model'), ('model', 'expert')))
  with pytest.warns(fsm.IndivisibleDimensionWarning) as record:
    out = fsm.get_sharding(variables, mesh, replicate_indivisible=True)
  params = out['params']['DotReluDot_0']
  assert params['Dense_0']['kernel'].spec == P(None, None)
  assert params['W2'].spec == P(None, None)
  (warning,) = record
  text = str(warning.message)
  assert '3 dimension(s) could not be sharded as annotated and were replicated' in text
  assert f"{KERNEL}: dimension 1: 'model' -> None" in text
  assert "params/DotReluDot_0/W2: dimension 1: 'expert' -> None" in text


def test_replicate_indivisible_keeps_what_divides_and_is_silent_otherwise(mesh):
  variables = abstract_vars(Net(8, ('data', 'model'), ('model', None)))
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    out = fsm.get_sharding(variables, mesh, replicate_indivisible=True)
  assert out['params']['DotReluDot_0']['Dense_0']['kernel'].spec == P('data', 'model')


def test_replicate_indivisible_cannot_fix_a_rank_mismatch(mesh):
  variables = abstract_vars(Net(16, ('data', None, 'model'), (None, None)))
  with pytest.raises(fsm.ShardingError, match='3 names for a rank-2 array'):
    fsm.get_sharding(variables, mesh, replicate_indivisible=True)


def test_shardings_place_real_arrays(mesh):
  model = Net(16)
  variables = jax.jit(model.init)(KEY, jnp.ones((8, 8)))
  shardings = fsm.get_sharding(variables, mesh)
  placed = jax.device_put(fsm.unbox(variables), fsm.unbox(shardings))
  w2 = placed['params']['DotReluDot_0']['W2']
  assert w2.sharding == NamedSharding(mesh, P('model', None))
  np.testing.assert_array_equal(w2, variables['params']['DotReluDot_0']['W2'].value)


# strict=, the mesh-axis-name warning, UNCONSTRAINED, large fits
# ------------------------------------------------------------------------------


def _logical_tree(n, names=('embed', 'data')):
  return {
    f'layer_{i}': {
      'w': fsm.LogicalPartitioned(jax.ShapeDtypeStruct((8, 8), jnp.float32), names)
    }
    for i in range(n)
  }


def test_mesh_axis_name_as_logical_name_warns_once_per_name(mesh):
  tree = _logical_tree(12, ('model', 'data'))
  with pytest.warns(fsm.UnmappedMeshAxisNameWarning) as record:
    out = fsm.get_sharding(tree, mesh, [('embed', None)])
  assert out['layer_0']['w'].spec == P(None, None)
  assert len(record) == 2  # 'model' and 'data', not one per leaf
  first = str(record[0].message)
  assert "Logical name 'model'" in first
  assert (
    'did you mean mesh-axis annotations (`with_partitioning`) or a rule '
    "('model', 'model')?" in first
  )
  assert 'layer_0/w, layer_1/w, layer_10/w' in first and 'and 2 more' in first
  # A name that is no mesh axis is replicated silently, as documented.
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    fsm.get_sharding(_logical_tree(2, ('embed', 'mlp')), mesh, [])


def test_issue_example_logical_to_mesh_sharding_warns(mesh):
  with pytest.warns(fsm.UnmappedMeshAxisNameWarning, match="'data'.*Concerned: w"):
    out = fsm.logical_to_mesh_sharding({'w': P('data', None)}, mesh, [('x', None)])
  assert out['w'].spec == P(None, None)
  # With no rules at all, one warning says that, and names the mesh axis too.
  with pytest.warns(
    fsm.UnmappedNameWarning, match="no logical axis rules.*'data' is also a mesh"
  ):
    fsm.logical_to_mesh_sharding({'w': P('data', None)}, mesh)


def test_strict_get_sharding_lists_every_unmapped_name(mesh):
  tree = {
    'a': fsm.LogicalPartitioned(
      jax.ShapeDtypeStruct((8, 8), jnp.float32), ('batch', 'length')
    ),
    'b': fsm.LogicalPartitioned(
      jax.ShapeDtypeStruct((8, 8), jnp.float32), ('data', None)
    ),
  }
  with pytest.raises(fsm.ShardingError) as info:
    fsm.get_sharding(tree, mesh, RULES, strict=True)
  problems = {(p.path, p.reason.split("'")[1]) for p in info.value.problems}
  assert problems == {('a', 'length'), ('b', 'data')}
  by_path = {p.path: p for p in info.value.problems}
  assert "rule ('data', 'data')" in by_path['b'].hint
  assert "('length', None)" in by_path['a'].hint
  # Rules that map every name pass.
  rules = RULES + (('length', None), ('data', 'data'))
  out = fsm.get_sharding(tree, mesh, rules, strict=True)
  assert out['b'].spec == P('data', None)


def test_strict_leaves_mesh_axis_annotations_alone(mesh):
  variables = abstract_vars(Net(16))
  out = fsm.get_sharding(variables, mesh, strict=True)
  assert out['params']['DotReluDot_0']['W2'].spec == P('model', None)


def test_unconstrained_is_a_problem_for_named_shardings(mesh):
  tree = {
    'w': fsm.Partitioned(
      jax.ShapeDtypeStruct((8, 6), jnp.float32), ('data', P.UNCONSTRAINED)
    )
  }
  with pytest.raises(
    fsm.ShardingError, match='UNCONSTRAINED .*only valid in a sharding constraint'
  ):
    fsm.get_sharding(tree, mesh)
  with pytest.warns(fsm.IndivisibleDimensionWarning, match='UNCONSTRAINED -> None'):
    out = fsm.get_sharding(tree, mesh, replicate_indivisible=True)
  assert out['w'].spec == P('data', None)
  # What jit refused before is now accepted.
  y = jax.jit(lambda: jnp.zeros((8, 6)), out_shardings=out['w'])()
  assert y.sharding.is_equivalent_to(out['w'], 2)


def test_large_replication_warning_summarises_and_lists_lazily(mesh):
  tree = {
    f'layer_{i}': {
      'w': fsm.Partitioned(jax.ShapeDtypeStruct((6,), jnp.float32), ('model',)),
      'v': fsm.Partitioned(jax.ShapeDtypeStruct((3, 8), jnp.float32), ('data', None)),
      'ok': fsm.Partitioned(jax.ShapeDtypeStruct((8,), jnp.float32), ('model',)),
    }
    for i in range(30)
  }
  with pytest.warns(fsm.IndivisibleDimensionWarning) as record:
    fsm.get_sharding(tree, mesh, replicate_indivisible=True)
  (warning,) = record
  text = str(warning.message)
  assert '60 dimension(s) could not be sharded' in text
  assert "30 x dimension 0: 'data' -> None" in text
  assert 'layer_0/v, layer_1/v, layer_10/v, ...' in text
  assert text.count('\n') < 10
  full = warning.message.adjustments
  assert len(full) == 60
  assert full[0].startswith("layer_0/v: dimension 0: 'data' -> None")
  assert full[-1].startswith("layer_9/w: dimension 0: 'model' -> None")


def _laid_out_by(call, mesh, **option):
  """``call`` on a 6-row value sharded over the 4-way 'model' axis."""
  rules = [('rows', 'model')]
  if call in ('get_sharding', 'plan'):
    tree = {
      'w': fsm.LogicalPartitioned(jax.ShapeDtypeStruct((6,), jnp.float32), ('rows',))
    }
    out = getattr(fsm, call)(tree, mesh, rules, **option)
    return out.entry('w').spec if call == 'plan' else out['w'].spec
  x = jnp.ones(6)
  out = getattr(fsm, call)(x, ('rows',), rules, mesh=mesh, **option)
  return out.sharding.spec


CALLS = ['get_sharding', 'plan', 'shard_value', 'with_logical_constraint']


@pytest.mark.parametrize('call', CALLS)
def test_fit_is_the_deprecated_spelling_of_replicate_indivisible(mesh, call):
  # fit= kept its meaning for one release; fsm.fit is the memory check.
  with pytest.warns(fsm.IndivisibleDimensionWarning):
    new = _laid_out_by(call, mesh, replicate_indivisible=True)
  with (
    pytest.deprecated_call(match=f'{call}.fit=.... is deprecated: pass '),
    pytest.warns(fsm.IndivisibleDimensionWarning),
  ):
    old = _laid_out_by(call, mesh, fit=True)
  assert old == new == P(None)


def test_sharding_fit_warning_is_the_deprecated_name_of_the_new_class():
  with pytest.deprecated_call(match='use fsm.IndivisibleDimensionWarning'):
    old = fsm.ShardingFitWarning
  assert old is fsm.IndivisibleDimensionWarning
  with pytest.raises(AttributeError, match='ShardingFitWarnin'):
    from flax_shardmeta import _errors

    _errors.ShardingFitWarnin  # noqa: B018


def test_few_paths_are_found_without_flattening_the_tree():
  from flax_shardmeta import _annotation

  tree = {
    'a': [jnp.ones(2), None, (jnp.ones(1), {'b': jnp.ones(3)})],
    'c': fsm.Partitioned(jnp.ones(3), ('x',)),
    'd': {},
    'e': optax.adam(1e-3).init({'w': jnp.ones(2)}),
  }
  expected = [
    _annotation.path_str(k)
    for k, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_annotation._stop)[0]
  ]
  leaves, _ = _annotation.walk(tree)
  # Read in reverse so each is found by descent before any full flattening.
  descended = [lf.path for lf in reversed(leaves)][::-1]
  assert len(leaves) < _annotation._KeyPaths.DESCENTS
  assert descended[:4] == expected[:4]
  assert 'e/0/mu/w' in descended
  # Made in the flattening pass, when every path will be read: the same.
  eager, _ = _annotation.walk(tree, every_path=True)
  assert [lf.path for lf in eager] == descended


def test_error_header_counts_leaves_not_problems():
  mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
  tree = {
    'w': fsm.Partitioned(jax.ShapeDtypeStruct((3, 5), jnp.float32), ('data', 'model'))
  }
  with pytest.raises(fsm.ShardingError, match='^1 leaf cannot be sharded') as info:
    fsm.get_sharding(tree, mesh)
  assert len(info.value.problems) == 2  # both dimensions, one leaf


# Names and meshes that are not what they should be: named errors
# ------------------------------------------------------------------------------


def test_integer_and_nested_names_are_invalid_names_naming_the_parameter(mesh):
  # Item 5: (0, 'model') was silently replicated, (1, 'model') raised jax's
  # "Resource axis: 1 ... is not found in mesh" with no path. Item 10: a
  # nested tuple raised jax's "cannot contain a nested tuple".
  sds = jax.ShapeDtypeStruct((8, 8), jnp.float32)
  tree = {
    'a': {'kernel': nn.Partitioned(sds, (0, 'model'))},  # flax's boxes take anything
    'b': nn.LogicallyPartitioned(sds, ((('data',), 'model'), None)),
    'ok': fsm.Partitioned(sds, ('data', None)),
  }
  with pytest.raises(fsm.InvalidNamesError) as info:
    fsm.get_sharding(tree, mesh)
  assert [p.path for p in info.value.problems] == ['a/kernel', 'b']
  message = str(info.value)
  assert "a/kernel: shape (8, 8), names (0, 'model')" in message
  assert 'int 0 is no name' in message and 'not another tuple' in message
  plan = fsm.plan(tree, mesh)  # a plan lists them instead of raising
  assert {p.path for p in plan.problems} == {'a/kernel', 'b'}
  # fsm's own boxes and initializers refuse them at once.
  with pytest.raises(fsm.InvalidNamesError, match='int 1 is no name'):
    fsm.Partitioned(sds, (1, 'model'))
  with pytest.raises(fsm.InvalidNamesError, match='int 3 is no name'):
    fsm.with_logical_partitioning(nn.initializers.zeros, ('embed', 3))
  with pytest.raises(fsm.InvalidNamesError, match=r"dimension 1 of names \('a', 3\)"):
    fsm.logical_to_mesh_axes(('a', 3), [('a', 'data')])


def test_get_sharding_without_a_mesh_is_a_named_error():
  tree = {'a': jnp.ones(3)}
  with pytest.raises(fsm.NoMeshError, match='get_sharding needs a mesh, got None'):
    fsm.get_sharding(tree, None)  # type: ignore[arg-type]
  with pytest.raises(fsm.NoMeshError, match='looks like logical axis rules'):
    fsm.get_sharding(tree, [('batch', 'data')])  # type: ignore[arg-type]
  with pytest.raises(fsm.NoMeshError, match='plan needs a mesh, got None'):
    fsm.plan(tree, None)  # type: ignore[arg-type]


def test_no_rules_at_all_is_said_once_per_call(mesh):
  # Issue 15: logical annotations with no rules anywhere were replicated
  # without a word.
  tree = _logical_tree(3, ('embed', 'mlp'))
  with pytest.warns(fsm.UnmappedNameWarning) as record:
    out = fsm.get_sharding(tree, mesh)
  assert len(record) == 1
  message = str(record[0].message)
  assert message.startswith("3 array(s) have logical names ('embed', 'mlp') but no")
  assert 'fsm.logical_axis_rules' in message and 'strict=True' in message
  assert 'Concerned: layer_0/w, layer_1/w, layer_2/w.' in message
  assert out['layer_0']['w'].spec == P(None, None)
  with pytest.raises(fsm.ShardingError, match='no logical axis rules are given or set'):
    fsm.get_sharding(tree, mesh, strict=True)
  with pytest.warns(fsm.UnmappedNameWarning, match='no logical axis rules'):
    plan = fsm.plan(tree, mesh)
  assert 'no rules are given or set' in str(plan.entries[0].explain[0])


def test_a_name_close_to_a_rules_name_asks_did_you_mean(mesh):
  # Issue 15: 'mpl' for 'mlp' was replicated silently.
  tree = _logical_tree(2, ('embed', 'mpl'))
  rules = [('embed', 'data'), ('mlp', 'model')]
  with pytest.warns(
    fsm.UnmappedNameWarning,
    match=r"'mpl' is not mapped by any rule, so it was replicated; did you mean "
    r"'mlp' \(rule \('mlp', 'model'\)\)\? Concerned: layer_0/w, layer_1/w\.",
  ):
    fsm.get_sharding(tree, mesh, rules)
  with pytest.raises(fsm.ShardingError, match=r"Fix: did you mean 'mlp'"):
    fsm.get_sharding(tree, mesh, rules, strict=True)
  # A name that is no slip of a rule's name stays silent, as documented.
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    fsm.get_sharding(_logical_tree(1, ('embed', 'baz')), mesh, [('bar', 'model')])


def test_a_rule_whose_axis_is_taken_is_not_called_missing(mesh):
  # Item 14: the rule ('model', 'model') exists; dimension 0 has its axis.
  rules = [('embed', 'model'), ('model', 'model')]
  tree = _logical_tree(1, ('embed', 'model'))
  with pytest.warns(fsm.UnmappedMeshAxisNameWarning) as record:
    fsm.get_sharding(tree, mesh, rules)
  message = str(record[0].message)
  assert (
    "'model' was replicated: every rule for it was skipped (rule #1 ('model', "
    "'model'): mesh axis 'model' is already used by dimension 0 ('embed'))"
  ) in message
  assert 'not mapped by any rule' not in message and 'or a rule' not in message
  with pytest.raises(fsm.ShardingError) as info:
    fsm.get_sharding(tree, mesh, rules, strict=True)
  (problem,) = info.value.problems
  assert "every rule for logical name 'model' was skipped" in problem.reason
  assert 'add a rule' not in problem.hint and 'put the rule first' in problem.hint
