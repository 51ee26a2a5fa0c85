"""Properties over random shapes, names, rules and meshes.

Whatever the input, flax_shardmeta either gives a sharding jax accepts for the
shape or raises ShardingError; never another exception.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, event, given, settings, strategies as st
from jax.sharding import AxisType, NamedSharding

import flax_shardmeta as fsm

MESH_SHAPES = [(8,), (1, 8), (2, 4), (4, 2), (8, 1), (2, 2, 2)]
AXIS_NAMES = ('a', 'b', 'c')
LOGICAL = ('batch', 'embed', 'mlp', 'heads', 'kv')

SETTINGS = settings(
  max_examples=60,
  deadline=None,
  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@functools.cache
def make_mesh(shape, axis_type):
  names = AXIS_NAMES[: len(shape)]
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


meshes = st.builds(
  make_mesh,
  st.sampled_from(MESH_SHAPES),
  st.sampled_from([AxisType.Auto, AxisType.Explicit]),
)
shapes = st.lists(st.sampled_from([1, 2, 3, 4, 6, 8, 16]), max_size=3).map(tuple)
# Mesh-axis entries include an axis some meshes lack ('c') and one none has.
mesh_entries = st.one_of(
  st.none(),
  st.sampled_from(AXIS_NAMES + ('zz',)),
  # Repeats included: validation must report them, not crash.
  st.tuples(st.sampled_from(AXIS_NAMES), st.sampled_from(AXIS_NAMES)),
)
targets = st.one_of(
  st.none(),
  st.sampled_from(AXIS_NAMES + ('zz',)),
  st.lists(st.sampled_from(AXIS_NAMES), min_size=1, max_size=2, unique=True).map(tuple),
)
rules_st = st.lists(st.tuples(st.sampled_from(LOGICAL), targets), max_size=6)


@st.composite
def annotated(draw):
  """(shape, names, logical) with rank-matching or, sometimes, wrong-rank names."""
  shape = draw(shapes)
  rank = len(shape) if draw(st.integers(0, 9)) else draw(st.integers(0, 4))
  logical = draw(st.booleans())
  if logical:
    names = draw(
      st.lists(
        st.one_of(st.none(), st.sampled_from(LOGICAL)), min_size=rank, max_size=rank
      )
    )
  else:
    names = draw(st.lists(mesh_entries, min_size=rank, max_size=rank))
  return shape, tuple(names), logical


def check_placed(sharding, shape):
  placed = jax.device_put(jnp.zeros(shape), sharding)
  assert placed.shape == shape
  assert placed.sharding.is_equivalent_to(sharding, len(shape))


@SETTINGS
@given(leaf=annotated(), rules=rules_st, mesh=meshes, replicate=st.booleans())
def test_get_sharding_is_valid_or_a_sharding_error(leaf, rules, mesh, replicate):
  shape, names, logical = leaf
  cls = fsm.LogicalPartitioned if logical else fsm.Partitioned
  tree = {'layer': {'w': cls(jax.ShapeDtypeStruct(shape, jnp.float32), names)}}
  try:
    with fsm.logical_axis_rules(rules), warnings.catch_warnings():
      # With no rules at all, logical names are replicated with this warning.
      warnings.simplefilter('ignore', fsm.UnmappedNameWarning)
      if replicate:
        warnings.simplefilter('ignore', fsm.IndivisibleDimensionWarning)
        out = fsm.get_sharding(tree, mesh, replicate_indivisible=True)
      else:
        out = fsm.get_sharding(tree, mesh)
  except (fsm.ShardingError, fsm.InvalidNamesError) as e:  # names repeated
    event(type(e).__name__)
    assert e.problems
    assert all(p.path == 'layer/w' for p in e.problems)
    return
  event('valid sharding')
  sharding = out['layer']['w']
  assert isinstance(sharding, NamedSharding)
  assert len(sharding.spec) == len(shape)
  check_placed(sharding, shape)


@SETTINGS
@given(
  shape=shapes,
  rules=rules_st,
  mesh=meshes,
  data=st.data(),
  logical=st.booleans(),
)
def test_shard_value_is_valid_or_a_sharding_error(shape, rules, mesh, data, logical):
  rank = len(shape)
  if logical:
    names = data.draw(
      st.lists(
        st.one_of(st.none(), st.sampled_from(LOGICAL)),
        min_size=rank,
        max_size=rank,
        unique_by=lambda n: n if n is not None else object(),
      )
    )
  else:
    names = data.draw(st.lists(mesh_entries, min_size=rank, max_size=rank))
    rules = []
  x = jnp.ones(shape)
  try:
    out = fsm.shard_value(x, tuple(names), rules, mesh=mesh)
  except fsm.ShardingError as e:
    event('ShardingError')
    assert e.problems
    return
  event('valid sharding')
  assert out.shape == shape
  assert out.sharding.mesh.shape == mesh.shape
  np.testing.assert_array_equal(out, x)


@SETTINGS
@given(
  names=st.lists(
    st.one_of(st.none(), st.sampled_from(LOGICAL)),
    max_size=4,
    unique_by=lambda n: n if n is not None else object(),
  ),
  rules=rules_st,
)
def test_resolution_never_reuses_a_mesh_axis(names, rules):
  spec = fsm.logical_to_mesh_axes(tuple(names), rules)
  used = [a for e in spec for a in ((e,) if isinstance(e, str) else (e or ()))]
  assert len(used) == len(set(used))
  # Names without a rule, and None, are replicated.
  ruled = {n for n, _ in rules}
  for n, e in zip(names, spec):
    if n is None or n not in ruled:
      assert e is None
