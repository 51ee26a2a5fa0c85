"""The core API used wrongly, as a new user would: each case gets fsm's own
error naming what is wrong and the fix, never a raw jax / Python error nor a
silently empty or wrong layout.

Meshes are the (2, 4) mesh of the 8 simulated CPU devices with Auto axes
(``axis_types`` is given explicitly where a case is about it).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta import cli

AUTO = (AxisType.Auto,) * 2
RULES = [('batch', 'data'), ('embed', None), ('mlp', 'model')]


def _tree():
  w = jax.ShapeDtypeStruct((16, 8), jnp.float32)
  return {'w': fsm.LogicalPartitioned(w, ('embed', 'mlp'))}


# A misspelt mesh axis: the "did you mean" the command line gives, in Python
# ------------------------------------------------------------------------------


def test_plan_says_did_you_mean_for_a_misspelt_mesh_axis():
  # Was: "mesh axis 'model' is not in the mesh (data=2, modle=4)" with the
  # general fix; only the command line's --mesh named the typo.
  mesh = fsm.make_mesh((2, 4), ('data', 'modle'), axis_types=AUTO)
  (problem,) = fsm.plan(_tree(), mesh, RULES).problems
  assert problem.path == 'w' and "'model'" in problem.reason
  assert "did you mean 'model'" in problem.hint and "'modle'" in problem.hint


def test_get_sharding_says_did_you_mean_for_a_misspelt_rule_target():
  mesh = fsm.make_mesh((2, 4), ('data', 'model'), axis_types=AUTO)
  rules = [('embed', 'dta'), ('mlp', 'model')]
  with pytest.raises(fsm.ShardingError) as info:
    fsm.get_sharding(_tree(), mesh, rules)
  (problem,) = info.value.problems
  assert "'dta'" in problem.reason and "'data'" in problem.hint
  assert 'did you mean' in str(info.value)


def test_a_misspelt_axis_in_a_mesh_axis_annotation_names_the_close_axis():
  mesh = fsm.make_mesh((2, 4), ('data', 'model'), axis_types=AUTO)
  w = jax.ShapeDtypeStruct((16, 8), jnp.float32)
  with pytest.raises(fsm.ShardingError, match="did you mean the mesh's axis 'model'"):
    fsm.get_sharding({'w': fsm.Partitioned(w, ('data', 'modle'))}, mesh)


def test_shard_value_and_constraints_say_did_you_mean_too():
  # Was: the general fix only, from fsm.shard_value and with_logical_constraint.
  mesh = fsm.make_mesh((2, 4), ('data', 'model'), axis_types=AUTO)
  rules = [('batch', 'dta'), ('mlp', 'model')]
  x = jnp.ones((8, 16))
  with pytest.raises(fsm.ShardingError, match="mesh's axis 'data'"):
    fsm.shard_value(x, ('batch', 'mlp'), rules, mesh)
  with pytest.raises(fsm.ShardingError, match="mesh's axis 'model'"):
    fsm.shard_value(x, jax.sharding.PartitionSpec('data', 'modle'), mesh=mesh)

  def constrain(v):
    return fsm.with_logical_constraint(v, ('batch', 'mlp'), rules, mesh)

  with pytest.raises(fsm.ShardingError, match="did you mean 'dta'.* or 'data'"):
    jax.jit(constrain)(x)


def test_an_axis_that_is_no_typo_keeps_the_general_fix():
  mesh = fsm.make_mesh((8,), ('data',))
  (problem,) = fsm.plan(_tree(), mesh, RULES).problems
  assert (
    'did you mean' not in problem.hint and 'use an axis the mesh has' in problem.hint
  )


def test_the_command_line_keeps_its_misspelt_mesh_check(capsys):
  argv = ['plan', '--model', 'mlp', '--mesh', 'data=2,modle=4']
  assert cli.main(argv) == 2
  assert "did you mean 'model'" in capsys.readouterr().err


# make_mesh: names and axis types
# ------------------------------------------------------------------------------


@pytest.mark.parametrize(
  'kwargs, message',
  [
    ({'axis_types': (AxisType.Auto,)}, 'not one per axis'),
    (
      {'axis_types': ('Explicit', 'Explicit')},
      "'Explicit' is no jax.sharding.AxisType",
    ),
    ({'axis_types': AxisType.Explicit}, 'is one value'),
  ],
)
def test_make_mesh_refuses_axis_types_not_one_per_axis(kwargs, message):
  # Was: jax's raw ValueError / TypeError ('AxisType' object is not iterable).
  with pytest.raises(fsm.MeshShapeError, match=message) as info:
    fsm.make_mesh((2, 4), ('data', 'model'), **kwargs)
  assert 'axis_types=(AxisType.Explicit,) * 2' in str(info.value)


@pytest.mark.parametrize(
  'sizes, names, message',
  [
    ((2, 4), ('data', 'data'), "name 'data' twice"),
    ((8,), (1,), '1 is no name'),
    ({1: 8}, None, '1 is no name'),
    ('2,4', ('data', 'model'), "'2,4' are one string"),
  ],
)
def test_make_mesh_refuses_names_that_are_not_distinct_strings(sizes, names, message):
  # Was: a mesh with two 'data' axes or an axis named 1, accepted silently.
  with pytest.raises(fsm.MeshShapeError, match=message):
    fsm.make_mesh(sizes, names)


def test_make_mesh_still_takes_one_axis_type_per_axis():
  mesh = fsm.make_mesh((2, 4), ('data', 'model'), axis_types=(AxisType.Explicit,) * 2)
  assert mesh.axis_types == (AxisType.Explicit,) * 2


# A function where its output belongs
# ------------------------------------------------------------------------------


def _factory():
  return _tree()


@pytest.mark.parametrize('call', ['plan', 'get_sharding', 'as_abstract'])
def test_a_function_instead_of_its_tree_is_refused(call):
  # Was: an empty plan with "problems: none", None, or the function back.
  mesh = fsm.make_mesh((2, 4), ('data', 'model'), axis_types=AUTO)
  with pytest.raises(fsm.ShardingError, match='the tree is the function _factory'):
    getattr(fsm, call)(_factory, mesh, RULES)


def test_nnx_as_abstract_refuses_a_function_too():
  mesh = fsm.make_mesh((2, 4), ('data', 'model'), axis_types=AUTO)
  with pytest.raises(fsm.ShardingError, match='jax.eval_shape'):
    fsm.nnx.as_abstract(jax.jit(_factory), mesh, RULES)


# Wrong kinds of input to the data, spec-tree, out_sharding and value helpers
# ------------------------------------------------------------------------------


@pytest.mark.parametrize('size', ['batch', 0, -8, 32.0, True])
def test_data_layout_refuses_a_batch_size_that_is_no_row_count(size):
  # Was: TypeError "not all arguments converted during string formatting".
  mesh = fsm.make_mesh((2, 4), ('data', 'model'), axis_types=AUTO)
  with pytest.raises(fsm.BatchLayoutError, match=r'global_batch_size is .*1 or more'):
    fsm.data_layout(mesh, size)


def test_data_layout_still_names_an_indivisible_batch():
  mesh = fsm.make_mesh((2, 4), ('data', 'model'), axis_types=AUTO)
  with pytest.raises(fsm.BatchLayoutError, match='does not divide.*multiple of 2'):
    fsm.data_layout(mesh, 3)


def test_logical_to_mesh_refuses_a_bare_name_instead_of_giving_it_back():
  # Was: 'embed' came back untranslated, without a word.
  with pytest.raises(fsm.InvalidNamesError, match=r"Pass P\('embed'\)"):
    fsm.logical_to_mesh('embed', RULES)


def test_logical_to_mesh_sharding_refuses_a_tuple_of_names():
  # Was: ('embed', 'mlp') came back as it was, not a sharding.
  mesh = fsm.make_mesh((2, 4), ('data', 'model'), axis_types=AUTO)
  with pytest.raises(fsm.InvalidNamesError, match=r"Pass P\('embed', 'mlp'\)"):
    fsm.logical_to_mesh_sharding(('embed', 'mlp'), mesh, RULES)


def test_logical_to_mesh_names_a_bare_name_leaf_in_a_tree():
  with pytest.raises(fsm.InvalidNamesError, match=r"w='embed'.*each leaf a Partition"):
    fsm.logical_to_mesh({'w': 'embed', 'b': P('mlp')}, RULES)


def test_logical_to_mesh_keeps_flax_results_for_spec_trees():
  tree = {'w': P('embed', 'mlp'), 'n': None}
  assert fsm.logical_to_mesh(tree, RULES) == nn.logical_to_mesh(tree, RULES)


EXPLICIT = (AxisType.Explicit,) * 2


def test_logical_out_sharding_without_rules_warns_as_plan_does():
  # Was: P(None, None) without a word, the output silently replicated.
  mesh = fsm.make_mesh((2, 4), ('data', 'model'), axis_types=EXPLICIT)
  with (
    jax.set_mesh(mesh),
    pytest.warns(fsm.UnmappedNameWarning, match='no logical axis rules'),
  ):
    assert fsm.logical_out_sharding(('batch', 'mlp')) == P(None, None)


def test_logical_out_sharding_says_did_you_mean_for_a_misspelt_name():
  mesh = fsm.make_mesh((2, 4), ('data', 'model'), axis_types=EXPLICIT)
  with (
    jax.set_mesh(mesh),
    pytest.warns(fsm.UnmappedNameWarning, match="did you mean 'mlp'"),
  ):
    spec = fsm.logical_out_sharding(('batch', 'mpl'), rules=RULES)
  assert spec == P('data', None)


def test_snapshot_without_a_mesh_names_snapshot():
  # Was: "fit needs a mesh" from a call to fsm.snapshot.
  def step(x):
    return x * 2

  with pytest.raises(fsm.NoMeshError, match='^snapshot needs a mesh'):
    fsm.snapshot(step, jnp.ones((8, 4)), cache=False)


def test_shard_value_of_a_string_says_it_is_no_array():
  # Was: "1 names for a rank-0 array".
  mesh = fsm.make_mesh((2, 4), ('data', 'model'), axis_types=AUTO)
  with pytest.raises(fsm.ShardingError, match=r"a str \('abc'\), not an array"):
    fsm.shard_value('abc', ('embed',), RULES, mesh=mesh)


def test_data_layout_takes_an_integer_scalar_array():
  mesh = fsm.make_mesh((2, 4), ('data', 'model'), axis_types=AUTO)
  assert fsm.data_layout(mesh, jnp.int32(32)).batch_size == 32


@pytest.mark.parametrize('mesh', [None, RULES])
def test_sharded_init_without_a_mesh_says_so(mesh):
  # Was: AttributeError "'NoneType' object has no attribute 'shape'".
  with pytest.raises(fsm.NoMeshError, match='sharded_init needs a'):
    fsm.sharded_init(_tree, mesh, RULES)
