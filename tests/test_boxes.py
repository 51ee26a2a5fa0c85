"""Boxes: AxisMetadata protocol, pytree behaviour, lifted transforms."""

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax.core import meta
from hypothesis import given, settings, strategies as st
from jax.sharding import PartitionSpec as P

import flax_shardmeta as fsm

BOXES = [
  lambda v: fsm.Partitioned(v, (None, 'model')),
  lambda v: fsm.LogicalPartitioned(v, ('embed', 'mlp'), rules=[('mlp', 'model')]),
]


@pytest.mark.parametrize('make', BOXES, ids=['mesh', 'logical'])
def test_box_is_axis_metadata_and_pytree(make):
  value = jnp.arange(8.0).reshape(2, 4)
  box = make(value)
  assert isinstance(box, meta.AxisMetadata)
  leaves, treedef = jax.tree_util.tree_flatten(box)
  assert len(leaves) == 1 and leaves[0] is value
  rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
  assert type(rebuilt) is type(box)
  assert rebuilt == box
  doubled = jax.tree_util.tree_map(lambda x: x * 2, box)
  assert type(doubled) is type(box)
  assert doubled.names == box.names and doubled.rules == box.rules
  assert jnp.array_equal(doubled.value, value * 2)


@pytest.mark.parametrize('make', BOXES, ids=['mesh', 'logical'])
def test_key_path_names_the_value(make):
  box = make(jnp.zeros((2, 4)))
  ((path, _),) = jax.tree_util.tree_flatten_with_path({'w': box})[0]
  assert jax.tree_util.keystr(path) == "['w'].value"


def test_static_metadata_is_part_of_the_treedef():
  v = jnp.zeros((2, 4))
  a = jax.tree_util.tree_structure(fsm.Partitioned(v, (None, 'model')))
  b = jax.tree_util.tree_structure(fsm.Partitioned(v, ('model', None)))
  c = jax.tree_util.tree_structure(
    fsm.LogicalPartitioned(v, (None, 'model'), rules=[('x', 'data')])
  )
  assert a != b
  assert a != c


def test_boxes_pass_through_jit_and_eval_shape():
  box = fsm.LogicalPartitioned(jnp.ones((2, 4)), ('embed', 'mlp'))
  out = jax.jit(lambda b: jax.tree_util.tree_map(lambda x: x + 1, b))(box)
  assert isinstance(out, fsm.LogicalPartitioned)
  assert out.names == ('embed', 'mlp')
  abstract = jax.eval_shape(lambda: box)
  assert abstract.value == jax.ShapeDtypeStruct((2, 4), jnp.float32)


def test_names_must_be_a_sequence_not_a_string():
  with pytest.raises(ValueError, match=r"write \('model',\)"):
    fsm.Partitioned(jnp.zeros(4), 'model')


def test_list_entries_become_tuples():
  box = fsm.Partitioned(jnp.zeros((4, 4)), [['data', 'model'], None])
  assert box.names == (('data', 'model'), None)
  assert box.get_partition_spec() == P(('data', 'model'), None)


def test_get_partition_spec_is_as_written():
  box = fsm.LogicalPartitioned(jnp.zeros((2, 4)), ('embed', 'mlp'))
  assert box.get_partition_spec() == P('embed', 'mlp')
  assert box.is_logical and not fsm.Partitioned(jnp.zeros(1), (None,)).is_logical


def test_unbox_without_mesh_returns_value():
  value = jnp.zeros((2, 4))
  box = fsm.Partitioned(value, (None, 'model'))
  assert box.unbox() is value
  assert box.unbox(apply_constraint=False) is value


def test_unbox_with_mesh_applies_layout(mesh):
  box = fsm.Partitioned(jnp.zeros((2, 8)), (None, 'model'), mesh=mesh)
  out = box.unbox()
  assert out.sharding.is_equivalent_to(
    jax.sharding.NamedSharding(mesh, P(None, 'model')), 2
  )


def test_replace_boxed_keeps_metadata():
  box = fsm.LogicalPartitioned(
    jnp.zeros((2, 4)), ('embed', 'mlp'), rules=[('mlp', 'model')]
  )
  new = box.replace_boxed(jnp.ones((2, 4)))
  assert type(new) is fsm.LogicalPartitioned
  assert (new.names, new.rules, new.mesh) == (box.names, box.rules, box.mesh)
  assert float(new.value.sum()) == 8.0
  assert float(box.value.sum()) == 0.0  # the original is untouched


def test_tree_unbox_replace_boxed_round_trip():
  tree = {
    'a': fsm.Partitioned(jnp.zeros((2, 4)), (None, 'model')),
    'b': {'c': fsm.LogicalPartitioned(jnp.zeros(3), ('embed',)), 'd': jnp.zeros(5)},
    'e': nn.Partitioned(jnp.zeros(2), ('data',)),
  }
  raw = fsm.unbox(tree)
  assert not any(
    isinstance(x, meta.AxisMetadata)
    for x in jax.tree_util.tree_leaves(
      raw, is_leaf=lambda x: isinstance(x, meta.AxisMetadata)
    )
  )
  assert raw['a'].shape == (2, 4) and raw['b']['d'].shape == (5,)
  updated = jax.tree_util.tree_map(lambda x: x + 1, raw)
  back = fsm.replace_boxed(tree, updated)
  assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(tree)
  assert back['a'].names == (None, 'model')
  assert type(back['e']) is nn.Partitioned
  assert float(back['b']['c'].value.sum()) == 3.0
  assert fsm.unbox(back)['b']['d'].sum() == 5.0


# add_axis / remove_axis
# ------------------------------------------------------------------------------


@pytest.mark.parametrize(
  'params, inserted',
  [
    ({fsm.PARTITION_NAME: 'layers'}, 'layers'),
    ({fsm.PARTITION_NAME: None}, None),
    ({}, None),
    (None, None),
  ],
)
@pytest.mark.parametrize('index', [0, 1, 2])
def test_add_then_remove_axis(params, inserted, index):
  box = fsm.LogicalPartitioned(jnp.zeros((2, 4)), ('embed', 'mlp'), rules=[('a', 'b')])
  added = box.add_axis(index, params)
  expected = list(box.names)
  expected.insert(index, inserted)
  assert added.names == tuple(expected)
  assert added.rules == box.rules
  assert added.remove_axis(index, params) == box


def test_remove_axis_with_the_wrong_name_raises():
  box = fsm.Partitioned(jnp.zeros((3, 2, 4)), ('layers', None, 'model'))
  with pytest.raises(ValueError, match="named 'stack'.*holds 'layers'"):
    box.remove_axis(0, {fsm.PARTITION_NAME: 'stack'})
  with pytest.raises(ValueError, match="named None.*holds 'layers'"):
    box.remove_axis(0, {})


def test_remove_axis_out_of_range_raises():
  box = fsm.Partitioned(jnp.zeros(4), ('model',))
  with pytest.raises(ValueError, match='only 1 names'):
    box.remove_axis(3, {})


NAME = st.one_of(st.none(), st.sampled_from(['data', 'model', 'embed', 'mlp']))


@settings(max_examples=60, deadline=None)
@given(
  names=st.lists(NAME, max_size=4),
  layer=NAME,
  data=st.data(),
  logical=st.booleans(),
)
def test_add_axis_then_remove_axis_is_identity(names, layer, data, logical):
  index = data.draw(st.integers(0, len(names)))
  cls = fsm.LogicalPartitioned if logical else fsm.Partitioned
  box = cls(jnp.zeros(()), names)
  params = {fsm.PARTITION_NAME: layer}
  added = box.add_axis(index, params)
  assert len(added.names) == len(names) + 1
  assert added.names[index] == layer
  assert added.remove_axis(index, params) == box


# Lifted transforms
# ------------------------------------------------------------------------------


class Layer(nn.Module):
  box: str = 'fsm'

  @nn.compact
  def __call__(self, x, _=None):
    if self.box == 'fsm':
      init = fsm.with_logical_partitioning(
        nn.initializers.lecun_normal(), ('embed', 'mlp')
      )
    else:
      init = nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ('embed', 'mlp')
      )
    return nn.Dense(4, kernel_init=init, use_bias=False)(x), None


@pytest.mark.parametrize(
  'partition_name, expected',
  [
    ('layers', ('layers', 'embed', 'mlp')),
    (None, (None, 'embed', 'mlp')),
  ],
)
def test_nn_scan_inserts_layer_axis(partition_name, expected):
  stack = nn.scan(
    Layer,
    length=3,
    variable_axes={'params': 0},
    split_rngs={'params': True},
    metadata_params={fsm.PARTITION_NAME: partition_name},
  )()
  x = jnp.ones((2, 4))
  variables = stack.init(jax.random.key(0), x)
  kernel = variables['params']['Dense_0']['kernel']
  assert isinstance(kernel, fsm.LogicalPartitioned)
  assert kernel.value.shape == (3, 4, 4)
  assert kernel.names == expected
  out, _ = stack.apply(variables, x)
  assert out.shape == (2, 4)


def test_nn_scan_output_resolves_to_a_sharding(mesh):
  stack = nn.scan(
    Layer,
    length=2,
    variable_axes={'params': 0},
    split_rngs={'params': True},
    metadata_params={fsm.PARTITION_NAME: 'layers'},
  )()
  abstract = jax.eval_shape(stack.init, jax.random.key(0), jnp.ones((2, 4)))
  sharding = fsm.get_sharding(abstract, mesh, [('mlp', 'model'), ('layers', None)])
  assert sharding['params']['Dense_0']['kernel'].spec == P(None, None, 'model')


class RematStack(nn.Module):
  box: str

  @nn.compact
  def __call__(self, x):
    body = lambda: Layer(box=self.box)  # noqa: E731

    class Body(nn.Module):
      @nn.compact
      def __call__(self, x):
        return body()(x)[0]

    return nn.remat_scan(Body, lengths=(2, 3))()(x)


def test_remat_scan_inserts_none_axes():
  x = jnp.ones((2, 4))
  variables = RematStack(box='fsm').init(jax.random.key(0), x)
  (kernel,) = jax.tree_util.tree_leaves(
    variables, is_leaf=lambda v: isinstance(v, meta.AxisMetadata)
  )
  assert isinstance(kernel, fsm.LogicalPartitioned)
  assert kernel.value.shape == (2, 3, 4, 4)
  assert kernel.names == (None, None, 'embed', 'mlp')
  assert RematStack(box='fsm').apply(variables, x).shape == (2, 4)


def test_flax_own_boxes_fail_under_remat_scan():
  # The reason fsm boxes default to an unsharded axis: flax's cannot.
  with pytest.raises(
    flax.errors.PartitioningUnspecifiedError, match='"partition_name" is not specified'
  ):
    RematStack(box='flax').init(jax.random.key(0), jnp.ones((2, 4)))


def test_boxes_refuse_reduced_axes_by_name():
  spec = P('data', None, reduced={'model'})
  with pytest.raises(fsm.InvalidNamesError, match='out_sharding or in match_partition'):
    fsm.Partitioned(jnp.ones((8, 4)), spec)
