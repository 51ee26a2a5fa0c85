"""Applying layouts: shard_value and with_logical_constraint, eager and traced."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm

RULES = (('batch', 'data'), ('hidden', 'model'))


def assert_layout(x, mesh, spec):
  expected = NamedSharding(mesh, spec)
  assert x.sharding.is_equivalent_to(expected, x.ndim), (x.sharding, expected)


def traced_spec(x):
  """The sharding jax tracks for a traced value (Explicit meshes only)."""
  return jax.typeof(x).sharding.spec


# shard_value
# ------------------------------------------------------------------------------


def test_shard_value_eager_mesh_argument(mesh):
  x = jnp.arange(64.0).reshape(8, 8)
  out = fsm.shard_value(x, ('data', 'model'), mesh=mesh)
  assert_layout(out, mesh, P('data', 'model'))
  np.testing.assert_array_equal(out, x)


def test_shard_value_eager_logical(mesh):
  x = jnp.ones((8, 8))
  out = fsm.shard_value(x, ('hidden', 'batch'), RULES, mesh=mesh)
  assert_layout(out, mesh, P('model', 'data'))
  with fsm.logical_axis_rules(RULES):
    out = fsm.shard_value(x, ('batch', 'embed'), mesh=mesh)
  assert_layout(out, mesh, P('data', None))


def test_shard_value_eager_under_set_mesh(mesh):
  # flax's shard_value fails here with Auto axes.
  x = jnp.ones((8, 8))
  with jax.set_mesh(mesh):
    out = fsm.shard_value(x, ('hidden', None), RULES)
  assert_layout(out, mesh, P('model', None))


def test_shard_value_inside_jit_mesh_argument(mesh):
  @jax.jit
  def f(x):
    return fsm.shard_value(x * 2, (None, 'hidden'), RULES, mesh=mesh)

  # Without jax.set_mesh, jit learns the devices of an Explicit mesh from its
  # inputs, so the input lives on the mesh already.
  x = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P()))
  out = f(x)
  assert_layout(out, mesh, P(None, 'model'))
  np.testing.assert_array_equal(out, 2 * np.ones((8, 8)))


def test_shard_value_inside_jit_under_set_mesh(mesh):
  seen = []

  @jax.jit
  def f(x):
    y = fsm.shard_value(x + 1, ('batch', 'hidden'), RULES)
    if mesh.axis_types[0] == AxisType.Explicit:
      seen.append(traced_spec(y))
    return y

  with jax.set_mesh(mesh):
    out = f(jnp.ones((8, 8)))
  assert_layout(out, mesh, P('data', 'model'))
  if mesh.axis_types[0] == AxisType.Explicit:
    assert seen == [P('data', 'model')]


def test_shard_value_names_none_returns_value(mesh):
  x = jnp.ones(4)
  assert fsm.shard_value(x, None, mesh=mesh) is x


def test_shard_value_accepts_a_partition_spec(mesh):
  out = fsm.shard_value(jnp.ones((8, 8)), P('model'), mesh=mesh)
  assert_layout(out, mesh, P('model', None))


def test_mixed_axis_types_are_laid_out_as_jax_allows():
  # 'data' Explicit, 'model' Auto: jax's reshard takes the Explicit axes and
  # with_sharding_constraint the Auto ones; device_put takes both eagerly.
  mesh = jax.make_mesh(
    (2, 4), ('data', 'model'), axis_types=(AxisType.Explicit, AxisType.Auto)
  )
  rules = [('batch', 'data'), ('mlp', 'model')]
  x = jnp.arange(64.0).reshape(8, 8)
  eager = fsm.shard_value(x, ('batch', 'mlp'), rules, mesh=mesh)
  assert_layout(eager, mesh, P('data', 'model'))

  @jax.jit
  def f(v):
    a = fsm.with_logical_constraint(v * 2, ('batch', 'mlp'), rules)
    return fsm.shard_value(a, (None, 'mlp'), rules) + 1

  with jax.set_mesh(mesh):
    out = f(x)
    # An UNCONSTRAINED dimension keeps its Explicit axes, leaves Auto ones open.
    g = jax.jit(
      lambda v: fsm.with_logical_constraint(
        v, ('batch', 'open'), rules + [('open', P.UNCONSTRAINED)]
      )
    )
    kept = g(jax.device_put(x, P('data', None)))
  assert_layout(out, mesh, P(None, 'model'))
  np.testing.assert_array_equal(out, x * 2 + 1)
  assert kept.sharding.spec[0] == 'data'
  # One dimension over an Explicit and an Auto axis is what jax cannot do.
  with pytest.raises(
    fsm.ShardingError,
    match=r"dimension 0 combines Explicit mesh axes \('data',\) with Auto mesh "
    r"axes \('model',\)",
  ):
    with jax.set_mesh(mesh):
      jax.jit(lambda v: fsm.shard_value(v, (('data', 'model'), None)))(x)


def test_shard_value_without_mesh_raises():
  with pytest.raises(
    fsm.NoMeshError,
    match=r'pass mesh=\.\.\. or run inside'
    r' `with jax.set_mesh\(mesh\):`',
  ) as info:
    fsm.shard_value(jnp.ones((8, 8)), ('data', None))
  assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
  'names, reason',
  [
    (('model', None, None), '3 names for a rank-2 array'),
    (('data', 'data'), "mesh axis 'data' shards both dimension 0 and dimension 1"),
    (('expert', None), "mesh axis 'expert' .dimension 0. is not in the mesh"),
    ((None, 'model'), "dimension 1 of size 6 is not divisible by 'model'=4"),
  ],
)
def test_shard_value_bad_layout_raises(mesh, names, reason):
  with pytest.raises(fsm.ShardingError, match=reason) as info:
    fsm.shard_value(jnp.ones((8, 6)), names, mesh=mesh, path='acts/x')
  (problem,) = info.value.problems
  assert problem.path == 'acts/x'
  assert problem.shape == (8, 6)
  assert problem.names == names


# with_logical_constraint
# ------------------------------------------------------------------------------


def test_constraint_without_rules_returns_x_itself(mesh):
  x = jnp.ones((8, 8))
  assert fsm.with_logical_constraint(x, ('batch', 'hidden'), mesh=mesh) is x
  with jax.set_mesh(mesh):
    assert fsm.with_logical_constraint(x, ('batch', 'hidden')) is x


def test_constraint_without_mesh_returns_x_itself():
  x = jnp.ones((8, 8))
  assert fsm.with_logical_constraint(x, ('batch', 'hidden'), RULES) is x
  with fsm.logical_axis_rules(RULES):
    assert fsm.with_logical_constraint(x, ('batch', 'hidden')) is x


def test_constraint_names_none_returns_x_itself(mesh):
  x = jnp.ones((8, 8))
  assert fsm.with_logical_constraint(x, None, RULES, mesh) is x


def test_constraint_eager(mesh):
  out = fsm.with_logical_constraint(jnp.ones((8, 8)), ('batch', 'hidden'), RULES, mesh)
  assert_layout(out, mesh, P('data', 'model'))


def test_constraint_context_rules_and_mesh(mesh):
  with fsm.logical_axis_rules(RULES), jax.set_mesh(mesh):
    out = fsm.with_logical_constraint(jnp.ones((8, 8)), ('hidden', None))
  assert_layout(out, mesh, P('model', None))


@pytest.mark.parametrize(
  'fallback, expected',
  [
    (fsm.RulesFallback.AXIS_IS_UNSHARDED, P('data', None)),
    (fsm.RulesFallback.NO_CONSTRAINT, None),
    (fsm.RulesFallback.RAISE_ERROR, None),
  ],
)
def test_constraint_fallbacks(mesh, fallback, expected):
  x = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P(None, 'model')))
  names = ('batch', 'unmapped')
  if fallback is fsm.RulesFallback.RAISE_ERROR:
    with pytest.raises(
      fsm.ShardingError,
      match=r'no rule maps logical name\(s\) '
      r"\['unmapped'\]",
    ) as info:
      fsm.with_logical_constraint(x, names, RULES, mesh, fallback=fallback)
    assert 'AXIS_IS_UNSHARDED' in info.value.problems[0].hint
    return
  out = fsm.with_logical_constraint(x, names, RULES, mesh, fallback=fallback)
  if expected is None:
    assert out is x
  else:
    assert_layout(out, mesh, expected)


def test_constraint_fallback_only_matters_for_unmapped_names(mesh):
  x = jnp.ones((8, 8))
  for fallback in fsm.RulesFallback:
    out = fsm.with_logical_constraint(
      x, ('batch', None), RULES, mesh, fallback=fallback
    )
    assert_layout(out, mesh, P('data', None))


def test_constraint_inside_jit(mesh):
  @jax.jit
  def f(x):
    return fsm.with_logical_constraint(jnp.sin(x), ('batch', 'hidden'))

  with fsm.logical_axis_rules(RULES), jax.set_mesh(mesh):
    out = f(jnp.ones((8, 8)))
  assert_layout(out, mesh, P('data', 'model'))
  np.testing.assert_allclose(out, np.sin(np.ones((8, 8))), rtol=1e-6)


def test_constraint_on_a_tree(mesh):
  tree = {'a': jnp.ones((8, 8)), 'b': jnp.ones((4, 8))}
  names = {'a': ('batch', 'hidden'), 'b': (None, 'hidden')}
  out = fsm.with_logical_constraint(tree, names, RULES, mesh)
  assert_layout(out['a'], mesh, P('data', 'model'))
  assert_layout(out['b'], mesh, P(None, 'model'))


def test_constraint_bad_layout_raises(mesh):
  with pytest.raises(fsm.ShardingError, match="size 6 is not divisible by 'model'=4"):
    fsm.with_logical_constraint(jnp.ones((8, 6)), ('batch', 'hidden'), RULES, mesh)


# shard_map
# ------------------------------------------------------------------------------


@pytest.mark.parametrize(
  'manual', [('data',), ('data', 'model')], ids=['data-manual', 'all-manual']
)
def test_constraints_inside_shard_map_leave_manual_axes(mesh, manual):
  seen = []

  def body(x):
    y = fsm.with_logical_constraint(x * 2, ('batch', 'hidden'))
    y = fsm.shard_value(y, ('batch', 'hidden'))
    seen.append(jax.typeof(y).sharding.spec)
    return y

  in_spec = P('data', 'model') if 'model' in manual else P('data')
  f = jax.shard_map(
    body, mesh=mesh, in_specs=in_spec, out_specs=in_spec, axis_names=set(manual)
  )
  # Explicit meshes require shard_map inputs to already have in_specs' layout.
  x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, in_spec))
  with fsm.logical_axis_rules(RULES), jax.set_mesh(mesh):
    out = jax.jit(f)(x)
  np.testing.assert_array_equal(out, 2 * x)
  if mesh.axis_types[0] == AxisType.Explicit and 'model' not in manual:
    # The remaining Explicit axis was laid out; the manual one was left alone.
    assert seen == [P(None, 'model')]
  assert len(seen) == 1


def test_constrain_box_unbox_under_context(mesh):
  box = fsm.LogicalPartitioned(jnp.ones((8, 8)), ('hidden', 'batch'))
  with jax.set_mesh(mesh):
    assert box.unbox() is box.value  # no rules: nothing to say about layout
    with fsm.logical_axis_rules(RULES):
      assert_layout(box.unbox(), mesh, P('model', 'data'))


def test_unbox_rank_mismatch_raises(mesh):
  box = fsm.Partitioned(jnp.ones((2, 8, 8)), ('model', None), mesh=mesh)
  with pytest.raises(fsm.ShardingError, match='2 names for a rank-3 array'):
    box.unbox()


def test_shard_value_axis_twice_in_one_dimension(mesh):
  with pytest.raises(
    fsm.ShardingError, match="mesh axis 'data' shards dimension 0 twice"
  ):
    fsm.shard_value(jnp.ones((8, 8)), (('data', 'data'), None), mesh=mesh)


# replicate_indivisible=, strict=, logical= and trees
# ------------------------------------------------------------------------------


def test_shard_value_replicate_indivisible_warns_once(mesh):
  x = jnp.ones((3, 8))
  with pytest.raises(fsm.ShardingError, match=r'fsm\.shard_value'):
    # The hint names every call that takes replicate_indivisible=.
    fsm.shard_value(x, ('data', None), mesh=mesh)
  with pytest.warns(fsm.IndivisibleDimensionWarning) as record:
    out = fsm.shard_value(
      x, ('data', 'model'), mesh=mesh, replicate_indivisible=True, path='acts'
    )
  assert_layout(out, mesh, P(None, 'model'))
  (warning,) = record
  assert "acts: dimension 0: 'data' -> None" in str(warning.message)
  assert warning.message.adjustments == (
    "acts: dimension 0: 'data' -> None (dimension 0 of size 3 is not "
    "divisible by 'data'=2)",
  )


def test_constraint_replicate_indivisible_on_a_tree_one_warning(mesh):
  tree = {'a': jnp.ones((3, 8)), 'b': jnp.ones((8, 6))}
  names = {'a': ('batch', 'hidden'), 'b': ('batch', 'hidden')}
  with pytest.warns(fsm.IndivisibleDimensionWarning) as record:
    out = fsm.with_logical_constraint(
      tree, names, RULES, mesh=mesh, replicate_indivisible=True
    )
  assert_layout(out['a'], mesh, P(None, 'model'))
  assert_layout(out['b'], mesh, P('data', None))
  (warning,) = record
  text = str(warning.message)
  assert '2 dimension(s) could not be sharded' in text
  assert "<constraint>/a: dimension 0: 'data' -> None" in text
  assert "<constraint>/b: dimension 1: 'model' -> None" in text


def test_constraint_replicate_indivisible_inside_jit(mesh):
  @jax.jit
  def f(x):
    return fsm.with_logical_constraint(
      x * 2, ('batch', 'hidden'), RULES, mesh=mesh, replicate_indivisible=True
    )

  with pytest.warns(
    fsm.IndivisibleDimensionWarning, match="dimension 1: 'model' -> None"
  ):
    out = f(jax.device_put(jnp.ones((8, 6)), NamedSharding(mesh, P())))
  assert_layout(out, mesh, P('data', None))


def test_shard_value_strict_lists_every_unmapped_name(mesh):
  with pytest.raises(
    fsm.ShardingError, match="no usable rule maps logical name 'embed'"
  ) as info:
    fsm.shard_value(jnp.ones((8, 8)), ('embed', 'heads'), RULES, mesh=mesh, strict=True)
  assert [p.names for p in info.value.problems] == [('embed', 'heads')] * 2
  assert "'heads'" in str(info.value.problems[1])
  # Mapped names pass in strict mode.
  out = fsm.shard_value(
    jnp.ones((8, 8)), ('batch', 'hidden'), RULES, mesh=mesh, strict=True
  )
  assert_layout(out, mesh, P('data', 'model'))


def test_constraint_strict_names_the_leaf(mesh):
  with pytest.raises(fsm.ShardingError, match=r"<constraint>/b: .*'embed'"):
    fsm.with_logical_constraint(
      {'a': jnp.ones((8, 8)), 'b': jnp.ones((8, 8))},
      {'a': ('batch', None), 'b': ('embed', None)},
      RULES,
      mesh=mesh,
      strict=True,
    )


def test_shard_value_mesh_axis_name_inside_a_rule_context_warns(mesh):
  x = jnp.ones((8, 8))
  with fsm.logical_axis_rules(RULES):
    with pytest.warns(
      fsm.UnmappedMeshAxisNameWarning,
      match=r"'data' is not mapped .* rule \('data', 'data'\)\? "
      'Pass logical=False',
    ) as record:
      out = fsm.shard_value(x, ('data', None), mesh=mesh)
    assert len(record) == 1
    assert_layout(out, mesh, P(None, None))
    # Explicit: mesh axes, rules ignored, no warning.
    assert_layout(
      fsm.shard_value(x, ('data', None), mesh=mesh, logical=False),
      mesh,
      P('data', None),
    )


def test_shard_value_logical_flag(mesh):
  x = jnp.ones((8, 8))
  # Default outside a rule context: mesh axes.
  assert_layout(fsm.shard_value(x, ('data', None), mesh=mesh), mesh, P('data', None))
  # logical=True with no rules: every name is unmapped, so replicated.
  assert_layout(
    fsm.shard_value(x, ('batch', None), mesh=mesh, logical=True), mesh, P(None, None)
  )
  # logical=False ignores the rules given.
  out = fsm.shard_value(x, ('model', 'data'), RULES, mesh=mesh, logical=False)
  assert_layout(out, mesh, P('model', 'data'))


def test_shard_value_tree_with_one_names_tuple_says_so(mesh):
  tree = {'a': jnp.ones((8, 2)), 'b': jnp.ones((8, 2))}
  with pytest.raises(
    fsm.ShardingError,
    match=r'a pytree \(dict with 2 leaves\) was given where one '
    r'array is expected.*get_sharding',
  ):
    fsm.shard_value(tree, ('data', None), mesh=mesh)


def test_shard_value_tree_with_a_names_tree(mesh):
  tree = {'a': jnp.ones((8, 2)), 'b': jnp.ones((4,)), 'c': jnp.ones(3)}
  out = fsm.shard_value(
    tree, {'a': ('data', None), 'b': ('model',), 'c': None}, mesh=mesh
  )
  assert_layout(out['a'], mesh, P('data', None))
  assert_layout(out['b'], mesh, P('model'))
  assert out['c'] is tree['c']
  with pytest.raises(fsm.ShardingError, match=r"<value>/c: shape \(3,\).*'model'"):
    fsm.shard_value(
      tree, {'a': (None, None), 'b': None, 'c': ('model',)}, mesh=mesh, logical=False
    )


def test_constraint_honours_the_legacy_mesh_context():
  auto = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(AxisType.Auto,) * 2)
  x = jnp.ones((8, 8))
  with pytest.warns(DeprecationWarning, match='with mesh'):
    with auto:
      eager = fsm.with_logical_constraint(x, ('batch', None), RULES)
      traced = jax.jit(
        lambda v: fsm.with_logical_constraint(v, (None, 'hidden'), RULES)
      )(x)
  assert_layout(eager, auto, P('data', None))
  assert_layout(traced, auto, P(None, 'model'))


# Misuse a real code base produces: named errors, never jax's raw ones
# ------------------------------------------------------------------------------


def test_unconstrained_rule_on_an_all_explicit_mesh_is_named_or_replicated():
  # Item 8: jax refuses UNCONSTRAINED when no axis is Auto.
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(AxisType.Explicit,) * 2)
  rules = [('batch', P.UNCONSTRAINED), ('mlp', 'model')]
  x = jnp.ones((8, 4))
  for call in (fsm.with_logical_constraint, fsm.shard_value):
    with pytest.raises(
      fsm.ShardingError,
      match=r'dimension 0 is UNCONSTRAINED: .*only Auto mesh axes allow, and this '
      r'mesh has none \(data: Explicit, model: Explicit\)',
    ):
      call(x, ('batch', 'mlp'), rules, mesh=mesh)
  with pytest.warns(fsm.IndivisibleDimensionWarning, match='UNCONSTRAINED -> None'):
    out = fsm.shard_value(
      x, ('batch', 'mlp'), rules, mesh=mesh, replicate_indivisible=True
    )
  assert_layout(out, mesh, P(None, 'model'))


def test_shard_value_eagerly_on_an_abstract_mesh_asks_for_a_concrete_one():
  # Item 9: jax's "must be a NamedSharding since the target sharding has an
  # AbstractMesh" TypeError.
  concrete = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(AxisType.Auto,) * 2)
  abstract = concrete.abstract_mesh
  for mesh in (abstract, jax.sharding.AbstractMesh((2, 4), ('data', 'model'))):
    with pytest.raises(
      fsm.NoMeshError, match=r"acts: an AbstractMesh \{'data': 2, 'model': 4\} has no"
    ):
      fsm.shard_value(jnp.ones((8, 4)), ('data', None), mesh=mesh, path='acts')
  # Inside jit the abstract mesh is all there is, and it works.
  with jax.set_mesh(concrete):
    out = jax.jit(lambda v: fsm.shard_value(v, ('data', None), mesh=abstract))(
      jnp.ones((8, 4))
    )
  assert_layout(out, concrete, P('data', None))


@pytest.mark.parametrize(
  'names, message',
  [
    # Item 10: jax's "A tuple inside PartitionSpec cannot contain a nested tuple".
    (
      ((('data',), 'model'), None),
      r'acts: dimension 0 of names .*: a tuple of mesh axes holds mesh-axis names '
      r"only, not another tuple \(\('data',\)\); flatten it, e.g. \('data', 'model'\)",
    ),
    # Item 5: integers are no names.
    ((1, 'model'), r'acts: dimension 0 of names \(1, .model.\): int 1 is no name'),
    ('batch', r"acts: names must be a sequence .* got the string 'batch'"),
  ],
)
def test_malformed_names_are_named_by_path(mesh, names, message):
  with pytest.raises(fsm.InvalidNamesError, match=message):
    fsm.shard_value(jnp.ones((8, 8)), names, mesh=mesh, path='acts')
  # with_logical_constraint names its one value '<constraint>'.
  with pytest.raises(
    fsm.InvalidNamesError, match=message.replace('acts:', '<constraint>:')
  ):
    fsm.with_logical_constraint(jnp.ones((8, 8)), names, RULES, mesh=mesh)


def test_constraint_on_a_tree_with_one_names_tuple_says_so(mesh):
  # Item 11: was "2 spec entries for a rank-0 array".
  tree = {'a': jnp.ones((8, 4)), 'b': jnp.ones((8, 4))}
  with pytest.raises(
    fsm.ShardingError, match=r'a pytree \(dict with 2 leaves\) was given where one'
  ):
    fsm.with_logical_constraint(tree, ('batch', None), RULES, mesh=mesh)


def test_list_names_are_accepted_and_messages_never_print_arrays(mesh):
  # Item 12: lists are names wherever boxes take them.
  x = jnp.ones((8, 4))
  one = fsm.with_logical_constraint(x, ['batch', 'hidden'], RULES, mesh=mesh)
  assert_layout(one, mesh, P('data', 'model'))
  tree = fsm.with_logical_constraint(
    {'a': x, 'b': [x, x]},
    {'a': ['batch', None], 'b': [['hidden', None], None]},
    RULES,
    mesh=mesh,
  )
  assert_layout(tree['a'], mesh, P('data', None))
  assert_layout(tree['b'][0], mesh, P('model', None))
  assert tree['b'][1] is x
  placed = fsm.shard_value({'a': x}, {'a': ['data', 'model']}, mesh=mesh)
  assert_layout(placed['a'], mesh, P('data', 'model'))
  with pytest.raises(fsm.ShardingError) as info:
    fsm.with_logical_constraint({'a': x}, {'b': ['batch', None]}, RULES, mesh=mesh)
  message = str(info.value)
  assert "the value is a dict with keys ['a'], the names a dict with keys ['b']" in (
    message
  )
  assert 'Array(' not in message and '1.' not in message


def test_names_must_match_the_rank_and_mesh_goes_by_name(mesh):
  x = jnp.ones((8, 4))
  # Issue 15: one name for a rank-2 array was silently P('data',).
  with pytest.raises(
    fsm.ShardingError,
    match=r"acts: shape \(8, 4\), names \('batch',\), spec None: "
    '1 names for a rank-2 array',
  ):
    fsm.shard_value(x, ('batch',), RULES, mesh=mesh, path='acts')
  with pytest.raises(fsm.ShardingError, match='1 names for a rank-2 array'):
    fsm.with_logical_constraint(x, ('batch',), RULES, mesh=mesh)
  # Item 15: the mesh passed where the rules go.
  with pytest.raises(
    fsm.InvalidRulesError,
    match=r"a Mesh was passed as rules \(axes \{'data': 2, 'model': 4\}\); pass it "
    'as mesh=',
  ):
    fsm.shard_value(x, ('data', None), mesh)
  with pytest.raises(fsm.InvalidRulesError, match='a Mesh was passed as rules'):
    fsm.with_logical_constraint(x, ('batch', None), mesh)
  # And rules passed where the mesh goes.
  with pytest.raises(fsm.NoMeshError, match='that looks like logical axis rules'):
    fsm.shard_value(x, ('batch', None), None, list(RULES))


def test_plain_jit_retraces_when_the_rules_change(mesh):
  # Item 4: fsm's rules are part of jax.jit's cache key.
  @jax.jit
  def f(v):
    return fsm.with_logical_constraint(v * 1, ('batch', None))

  x = jnp.ones((8, 4))
  with jax.set_mesh(mesh):
    with fsm.logical_axis_rules([('batch', 'data')]):
      first = f(x)
    with fsm.logical_axis_rules([('batch', 'model')]):
      second = f(x)
    with fsm.logical_axis_rules([('batch', 'data')]):
      again = f(x)
  assert_layout(first, mesh, P('data', None))
  assert_layout(second, mesh, P('model', None))
  assert_layout(again, mesh, P('data', None))
  assert f._cache_size() == 2  # one trace per rule set, reused when it comes back
