"""The host-side API in one process: meshes, data layout, jit, shard/gather.

The same functions across real processes are in ``test_multihost.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta.examples.linen import MLP, MLP_RULES

# make_mesh
# ------------------------------------------------------------------------------


def test_make_mesh_fills_the_wildcard_and_takes_axis_types():
  mesh = fsm.make_mesh((-1, 2), ('data', 'model'), axis_types=(AxisType.Auto,) * 2)
  assert dict(mesh.shape) == {'data': 4, 'model': 2}
  assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
  explicit = fsm.make_mesh(
    (2, 4), ('data', 'model'), axis_types=(AxisType.Explicit,) * 2
  )
  assert explicit.axis_types == (AxisType.Explicit, AxisType.Explicit)


# The decision documented in make_mesh's docstring and the README; the code lands
# with make_mesh's rewrite (TPU topologies), when this marker goes.
def test_make_mesh_defaults_to_auto_axes():
  for dcn in (None, (1, 1)):
    mesh = fsm.make_mesh((2, 4), ('data', 'model'), dcn_axis_sizes=dcn)
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)


def test_make_mesh_with_dcn_sizes_on_one_host():
  mesh = fsm.make_mesh(
    (2, 4), ('data', 'model'), dcn_axis_sizes=(1, 1), axis_types=(AxisType.Auto,) * 2
  )
  assert dict(mesh.shape) == {'data': 2, 'model': 4}
  assert sorted(d.id for d in mesh.devices.flat) == list(range(8))
  assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)


@pytest.mark.parametrize(
  'sizes,dcn,match',
  [
    ((3, 4), None, r'does not fit 8 devices in 1 process\(es\).*axis_sizes=\(2, 4\)'),
    ((-1, 3), None, r'does not fit 8 devices.*axis_sizes='),
    ((-1, -1), None, 'at most one -1'),
    ((2, 4), (2, 1), r'product is 2, not the 1 hosts.*dcn_axis_sizes=\(1, 1\)'),
    ((2, 4), (1,), 'one positive entry per axis'),
  ],
)
def test_make_mesh_misfits_name_counts_and_a_fit(sizes, dcn, match):
  with pytest.raises(fsm.MeshShapeError, match=match):
    fsm.make_mesh(sizes, ('data', 'model'), dcn_axis_sizes=dcn)


def test_make_mesh_checks_names_against_sizes():
  with pytest.raises(fsm.MeshShapeError, match='one size per name'):
    fsm.make_mesh((8,), ('data', 'model'))


# data_layout, host_local_to_global
# ------------------------------------------------------------------------------


def test_data_layout_in_one_process():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  layout = fsm.data_layout(mesh, 32)
  assert layout == fsm.DataLayout(32, 0, 1, True)
  with pytest.raises(AttributeError):
    layout.batch_size = 1  # frozen


def test_data_layout_batch_axes_from_rules_or_given():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  # 'batch' -> ('data', 'model') is 8 ways: 12 rows cannot split.
  with pytest.raises(
    fsm.BatchLayoutError,
    match=r"12 rows does not divide.*\('data', 'model'\) \(8 ways\).*1.5 rows",
  ):
    fsm.data_layout(mesh, 12, rules=[('batch', ('data', 'model'))])
  with fsm.logical_axis_rules([('batch', 'model')]):
    with pytest.raises(fsm.BatchLayoutError, match=r"\('model',\) \(4 ways\)"):
      fsm.data_layout(mesh, 6)
  assert fsm.data_layout(mesh, 6, batch_axes='data').batch_size == 6
  with pytest.raises(fsm.BatchLayoutError, match=r"missing \['rows'\]"):
    fsm.data_layout(mesh, 8, batch_axes='rows')


def test_host_local_to_global_and_back():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  rows = np.arange(24.0).reshape(8, 3)
  tree = {'x': rows, 'y': rows[:, 0]}
  out = fsm.host_local_to_global(
    tree, mesh, {'x': ('batch', None), 'y': P('data')}, MLP_RULES
  )
  assert out['x'].sharding.spec == P('data', None)
  assert out['y'].sharding.spec == P('data')
  back = fsm.global_to_host_local(out)
  np.testing.assert_array_equal(back['x'], rows)
  np.testing.assert_array_equal(back['y'], rows[:, 0])


def test_host_local_to_global_names_the_leaf_that_cannot_split():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  with pytest.raises(
    fsm.ShardingError,
    match=r"x: shape \(3, 2\), names P\('data', None\).*dimension 0: this "
    r"process passed 3, and its devices hold 2 of the 2 shards over 'data'=2",
  ):
    fsm.host_local_to_global({'x': np.ones((3, 2))}, mesh, P('data', None))


def test_host_local_to_global_error_speaks_of_this_call():
  # Item 17: it showed names None though logical names were given, the
  # inferred global size, an empty path for a bare array, and
  # replicate_indivisible=True (then spelled fit=True), which
  # this function does not take.
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  with pytest.raises(fsm.ShardingError) as info:
    fsm.host_local_to_global(
      np.ones((7, 3)), mesh, ('batch', None), [('batch', 'data')]
    )
  (problem,) = info.value.problems
  assert problem.path == '<value>'
  assert problem.names == ('batch', None) and problem.spec == P('data', None)
  assert 'this process passed 7' in problem.reason and '3.5 each' in problem.reason
  assert 'fsm.data_layout(mesh, global_batch_size).batch_size' in problem.hint
  assert 'replicate_indivisible' not in problem.hint and '14' not in str(info.value)
  with pytest.raises(fsm.NoMeshError, match='host_local_to_global needs a mesh'):
    fsm.host_local_to_global(np.ones((8, 3)), None, ('batch', None))
  # Names as a list, as boxes take them.
  x = fsm.host_local_to_global(
    np.ones((8, 3)), mesh, ['batch', None], [('batch', 'data')]
  )
  assert x.sharding.spec == P('data', None)


# jit
# ------------------------------------------------------------------------------


def constrained(x):
  return fsm.with_logical_constraint(x * 2, ('batch', 'embed'))


def test_jit_applies_constraints_without_a_context_at_the_call(mesh):
  rules = [('batch', 'data'), ('embed', 'model')]
  f = fsm.jit(constrained, mesh=mesh, rules=rules)
  # No jax.set_mesh and no rule context here: the constraint still applies.
  assert fsm.get_logical_axis_rules() == ()
  y = f(jnp.ones((8, 4)))
  assert y.sharding.spec == P('data', 'model')
  np.testing.assert_array_equal(y, 2.0)
  text = f.lower(jnp.ones((8, 4))).as_text()
  assert 'sharding' in text
  assert f.trace(jnp.ones((8, 4))).jaxpr.out_avals[0].shape == (8, 4)
  shape = f.eval_shape(jnp.ones((8, 4)))
  assert shape.shape == (8, 4)
  if mesh.axis_types[0] == AxisType.Explicit:  # only Explicit types carry it
    assert shape.sharding.spec == P('data', 'model')


def test_plain_jax_jit_would_drop_the_constraint():
  # What fsm.jit is for: outside any context the constraint is a no-op.
  y = jax.jit(constrained)(jnp.ones((8, 4)))
  assert len(y.sharding.device_set) == 1


def test_jit_keeps_the_rules_in_force_when_it_was_made():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  with fsm.logical_axis_rules([('batch', 'model'), ('embed', 'data')]):
    f = fsm.jit(constrained, mesh=mesh)
  assert f(jnp.ones((8, 4))).sharding.spec == P('model', 'data')


@pytest.mark.parametrize('form', ['names', 'spec', 'named'])
def test_jit_sharding_forms(form):
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  rules = [('batch', 'data'), ('embed', 'model')]
  out = {
    'names': ('batch', 'embed'),
    'spec': P('data', 'model'),
    'named': NamedSharding(mesh, P('data', 'model')),
  }[form]
  f = fsm.jit(
    lambda x: x + 1, mesh=mesh, rules=rules, in_shardings=(out,), out_shardings=out
  )
  x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P('data', 'model')))
  assert f(x).sharding.spec == P('data', 'model')


def test_jit_with_annotated_abstract_state_and_donation():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  model = MLP(num_layers=2, depth=16)
  x = jnp.ones((4, 8))
  with fsm.logical_axis_rules(MLP_RULES):
    abstract = jax.eval_shape(model.init, jax.random.key(0), x)
    variables = fsm.sharded_init(model.init, mesh)(jax.random.key(0), x)
  f = fsm.jit(
    lambda v: jax.tree_util.tree_map(lambda a: a * 2, v),
    mesh=mesh,
    rules=MLP_RULES,
    in_shardings=(abstract,),
    out_shardings=abstract,
    donate_argnums=0,
  )
  out = f(variables)
  assert not fsm.verify(out, fsm.plan(abstract, mesh, MLP_RULES))


def test_jit_static_argnums():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  f = fsm.jit(lambda x, n: x * n, mesh=mesh, static_argnums=1)
  assert float(f(jnp.ones(()), 3)) == 3.0


# shard_tree, gather_tree
# ------------------------------------------------------------------------------


def test_shard_tree_and_gather_tree_round_trip_a_state():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  model = MLP(num_layers=2, depth=16)
  with fsm.logical_axis_rules(MLP_RULES):
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((4, 8)))
    target = fsm.as_abstract(abstract, mesh)
  host = jax.tree_util.tree_map(
    lambda s: np.random.default_rng(0).normal(size=s.shape).astype(s.dtype),
    fsm.unbox(abstract),
  )
  state = fsm.shard_tree(host, target)
  # Each device holds only its slice.
  kernel = state['params']['ScanDotReluDot_0']['W2']
  assert kernel.sharding.spec == P(None, 'model', None)
  assert kernel.addressable_shards[0].data.shape == (2, 4, 8)
  back = fsm.gather_tree(state)
  for a, b in zip(jax.tree_util.tree_leaves(host), jax.tree_util.tree_leaves(back)):
    assert isinstance(b, np.ndarray)
    np.testing.assert_array_equal(a, b)
  # Boxed host trees keep their boxes.
  boxed = fsm.shard_tree(fsm.replace_boxed(abstract, host), target)
  w2 = boxed['params']['ScanDotReluDot_0']['W2']
  assert isinstance(w2, fsm.LogicalPartitioned)
  assert w2.value.sharding.spec == P(None, 'model', None)


def test_shard_tree_takes_the_dtype_of_an_abstract_target():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  target = jax.ShapeDtypeStruct(
    (4, 8), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, 'model'))
  )
  out = fsm.shard_tree(np.ones((4, 8), np.float32), target)
  assert out.dtype == jnp.bfloat16 and out.sharding.spec == P(None, 'model')


def test_shard_tree_names_every_mismatch():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  target = {
    'a': jax.ShapeDtypeStruct(
      (4, 8), jnp.float32, sharding=NamedSharding(mesh, P(None, 'model'))
    ),
    'b': NamedSharding(mesh, P('model')),
  }
  with pytest.raises(fsm.ShardingError) as info:
    fsm.shard_tree({'a': np.ones((4, 4)), 'b': np.ones(6)}, target)
  message = str(info.value)
  assert 'a: shape (4, 4)' in message and 'expected shape (4, 8), got (4, 4)' in message
  assert 'b: shape (6,)' in message and "not divisible by 'model'=4" in message
  assert len(info.value.problems) == 2


def test_make_mesh_takes_a_mapping_and_names_the_mistakes():
  # As jax.make_mesh users try: names and sizes in one mapping.
  mesh = fsm.make_mesh({'data': -1, 'model': 2})
  assert dict(mesh.shape) == {'data': 4, 'model': 2}
  with pytest.raises(fsm.MeshShapeError, match='the mapping already names the axes'):
    fsm.make_mesh({'data': -1, 'model': 2}, ('data', 'model'))
  with pytest.raises(fsm.MeshShapeError, match="the size of 'data' is '-1'"):
    fsm.make_mesh({'data': '-1', 'model': 2})
  with pytest.raises(fsm.MeshShapeError, match='without axis_names'):
    fsm.make_mesh((2, 4))
  with pytest.raises(
    fsm.MeshShapeError, match="give a tuple of names, e.g. \\('data',\\)"
  ):
    fsm.make_mesh((8,), 'data')
  with pytest.raises(fsm.MeshShapeError, match='num_slices=2 needs topology='):
    fsm.make_mesh((8,), ('data',), num_slices=2)
