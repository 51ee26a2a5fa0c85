"""Reading NNX Variables: the fast path gives exactly what flax's accessors give.

fsm reads a plain Variable from its fields and rebuilds results without
flax's copying accessors, and makes one Annotation per distinct metadata.
These tests pin that every result (tree structure, Variable types and
metadata, shardings, specs, warnings, errors) is the one the reference
reading gives (``flax_shardmeta._nnx.reading``, the fallback the probe picks
when flax's internals change): ``variable.get_value()``, the annotation made
afresh from ``variable.get_metadata()``, and ``variable.replace(result)``.
They also pin that the probe picks the fast path on the flax versions tested
and the fallback when the internals it relies on are gone. Meshes have Auto
or Explicit axes (the ``mesh`` fixture runs both).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings, strategies as st
from jax.experimental.layout import Format
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta import _annotation as ann_lib
from flax_shardmeta._nnx import reading
from flax_shardmeta._nnx.reading import reference_read
from flax_shardmeta.nnx import FSM_LOGICAL

RULES = [('batch', 'data'), ('embed', None), ('mlp', 'model'), ('heads', 'model')]


# What a reading gives
# ------------------------------------------------------------------------------


def outcome(fn: Callable[[], Any]) -> tuple[Any, ...]:
  """What ``fn`` gives: its result's structure and leaves and the warnings it
  raises, or the error it raises."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    try:
      out = fn()
    except Exception as e:  # noqa: BLE001 - any error must be the same one
      result: tuple[Any, ...] = ('raised', type(e), str(e))
    else:
      leaves, treedef = jax.tree_util.tree_flatten(out)
      result = ('returned', treedef, leaves)
  return result + (tuple((w.category, str(w.message)) for w in caught),)


def assert_same_as_reference(fn: Callable[[], Any]) -> tuple[Any, ...]:
  """``fn`` gives the same outcome as with the straightforward reading,
  both when fsm's caches are cold and when they are warm."""
  with reading.use_reference_reading():
    want = outcome(fn)
  fsm.clear_caches()
  cold = outcome(fn)
  warm = outcome(fn)
  # The treedef holds every Variable's class and metadata (flax flattens the
  # metadata into it), so equal treedefs mean equal Variables around the results.
  assert cold == want
  assert warm == want
  return want


def same_leaf(a: Any, b: Any) -> bool:
  """The same object, or (hooks and Refs give new ones) an equal one."""
  if a is b:
    return True
  if type(a) is not type(b):
    return False
  if isinstance(a, (jax.Array, np.ndarray)):
    return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))
  return a == b


def as_structs(tree: Any) -> Any:
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, 'shape') else x,
    tree,
  )


# A varied tree
# ------------------------------------------------------------------------------


class Counter(nnx.Variable):
  """A Variable class of one's own: read like nnx.Variable."""


class Doubled(nnx.Param):
  """Overrides get_value: read through it, never from its fields."""

  def get_value(self, **kwargs: Any) -> Any:
    value = super().get_value(**kwargs)
    return jax.ShapeDtypeStruct(value.shape + (2,), value.dtype)


def flip(variable: Any, value: Any) -> Any:
  """An on_get_value hook giving the value with its dimensions reversed."""
  return jax.ShapeDtypeStruct(value.shape[::-1], value.dtype)


def fsm_param(shape, names, **kwargs):
  init = fsm.nnx.with_logical_partitioning(lambda: jnp.zeros(shape), names, **kwargs)
  with nnx.use_eager_sharding(False):
    return nnx.Param(init())


def fsm_mesh_param(shape, names, **kwargs):
  init = fsm.nnx.with_partitioning(lambda: jnp.zeros(shape), names, **kwargs)
  with nnx.use_eager_sharding(False):
    return nnx.Param(init())


OLD_KEYS = ('sharding_names', 'sharding')
"""Keys flax renames to out_sharding at construction, still found in states
made before (set here after construction)."""


def flax_param(value, cls: type[nnx.Variable[Any]] = nnx.Param, **metadata):
  old = {k: metadata.pop(k) for k in OLD_KEYS if k in metadata}
  with warnings.catch_warnings():
    # Hooks are deprecated in flax, yet Variables may still carry them.
    warnings.filterwarnings('ignore', 'Variable hooks are deprecated', UserWarning)
    warnings.filterwarnings('ignore', ".* use 'out_sharding'", DeprecationWarning)
    variable = cls(value, eager_sharding=False, **metadata)
    for key, names in old.items():
      variable.set_metadata(key, names)
  return variable


def varied_state(mesh) -> nnx.State:
  """Every kind of Variable and annotation fsm reads, in one state."""
  sds = jax.ShapeDtypeStruct((8, 16), jnp.float32)
  explicit = all(t == AxisType.Explicit for t in mesh.axis_types)
  tree: dict[str, Any] = {
    'fsm': {
      'kernel': fsm_param((8, 16), ('embed', 'mlp')),
      'kernel_again': fsm_param((8, 16), ('embed', 'mlp')),
      'own_rules': fsm_param((8, 16), ('rows', 'mlp'), rules=[('rows', 'data')]),
      'opt_names': fsm_param((8, 16), ('embed', 'mlp'), optimizer_names=('mlp', None)),
      'with_mesh': fsm_param((8, 16), ('embed', 'mlp'), mesh=mesh),
      'mesh_axes': fsm_mesh_param((8, 16), ('data', 'model')),
      'unmapped': fsm_param((8,), ('vocab',)),
    },
    'flax': {
      'tuple': flax_param(sds, out_sharding=('embed', 'mlp')),
      'list': flax_param(sds, out_sharding=['embed', 'mlp']),
      'mesh_names': flax_param(sds, out_sharding=('data', 'model')),
      'old_key': flax_param(sds, sharding_names=('embed', 'mlp')),
      'oldest_key': flax_param(sds, sharding=('mlp', None)),
      'empty_first': flax_param(sds, out_sharding=(), sharding=('mlp', None)),
      'spec': flax_param(sds, out_sharding=P('data', None)),
      'named': flax_param(sds, out_sharding=NamedSharding(mesh, P(None, 'model'))),
      'format': flax_param(
        sds, out_sharding=Format(None, NamedSharding(mesh, P('data', None)))
      ),
      'rules_tuple': flax_param(
        sds, out_sharding=('rows', 'mlp'), sharding_rules=(('rows', 'data'),)
      ),
      'rules_list': flax_param(
        sds, out_sharding=('rows', 'mlp'), sharding_rules=[('rows', 'data')]
      ),
      'with_mesh': flax_param(sds, out_sharding=('embed', 'mlp'), mesh=mesh),
      'marker_false': flax_param(sds, out_sharding=('data', None), fsm_logical=False),
      'marker_true': flax_param(sds, out_sharding=('data', None), fsm_logical=True),
      'marker_one': flax_param(sds, out_sharding=('embed', 'mlp'), fsm_logical=1),
    },
    'values': {
      'jax': flax_param(jnp.zeros((8, 16)), out_sharding=('embed', 'mlp')),
      'numpy': flax_param(np.zeros((8, 16)), out_sharding=('embed', 'mlp')),
      'scalar': flax_param(jnp.zeros(()), out_sharding=None),
      # A Variable holding a tree: its annotation lays out every array in it.
      'tree': flax_param(
        {'a': jnp.zeros(4), 'b': jax.ShapeDtypeStruct((16,), jnp.float32)},
        out_sharding=('mlp',),
      ),
      'python': flax_param(3, out_sharding=('mlp',)),
      'none': flax_param(None),
      'nested': flax_param(flax_param(sds, out_sharding=('mlp', None))),
      'hook': flax_param(
        jax.ShapeDtypeStruct((16, 8), jnp.float32),
        out_sharding=('embed', 'mlp'),
        on_get_value=flip,
      ),
    },
    'classes': {
      'batch_stat': flax_param(sds, nnx.BatchStat, out_sharding=('embed', 'mlp')),
      'counter': flax_param(sds, Counter, out_sharding=('embed', 'mlp')),
      'doubled': flax_param(sds, Doubled, out_sharding=('embed', 'mlp', None)),
      # Same metadata as a Param, another rank: replicated as optimizer state.
      'opt_state': flax_param(
        jax.ShapeDtypeStruct((16,), jnp.float32),
        nnx.OptState,
        out_sharding=('embed', 'mlp'),
      ),
      'opt_state_full': flax_param(sds, nnx.OptState, out_sharding=('embed', 'mlp')),
      'plain': nnx.Param(jnp.zeros((4,))),
    },
    'rngs': nnx.state(nnx.Rngs(0, params=1)),
  }
  if explicit:
    tree['flax']['unreduced'] = flax_param(
      sds, out_sharding=P('mlp', None, unreduced=frozenset({'data'}))
    )
  return nnx.State(tree)


# Identical results
# ------------------------------------------------------------------------------


def test_each_variable_reads_as_the_reference_reads_it(mesh):
  state = varied_state(mesh)
  state['values']['ref'] = flax_param(jnp.zeros((16,)), out_sharding=('mlp',), ref=True)
  variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  fsm.clear_caches()
  for _ in range(2):  # cold, then warm caches
    for variable in variables:
      want_value, want = reference_read(variable)
      value, annotation = ann_lib.read(variable)
      assert annotation == want
      assert fsm.nnx.variable_annotation(variable) == want
      assert jax.tree.structure(value) == jax.tree.structure(want_value)
      assert all(
        same_leaf(a, b)
        for a, b in zip(jax.tree.leaves(value), jax.tree.leaves(want_value))
      )


def test_get_sharding_on_a_varied_state_is_the_reference_result(mesh):
  state = varied_state(mesh)
  kind, *_ = assert_same_as_reference(lambda: fsm.get_sharding(state, mesh, RULES))
  assert kind == 'returned'


def test_results_follow_each_rule_context_as_the_reference_does(mesh):
  state = varied_state(mesh)

  def under_fsm_context():
    with fsm.logical_axis_rules(RULES):
      return fsm.get_sharding(state, mesh)

  def under_flax_context():
    with nn.logical_axis_rules(RULES):
      return fsm.get_sharding(state, mesh)

  def without_rules():
    return fsm.get_sharding(state, mesh)

  for fn in (under_fsm_context, under_flax_context, without_rules):
    assert assert_same_as_reference(fn)[0] == 'returned', fn.__name__


def test_abstract_state_specs_plans_and_replication_are_the_reference_results(mesh):
  state = as_structs(varied_state(mesh))
  for fn in (
    lambda: fsm.get_sharding(state, mesh, RULES),
    lambda: fsm.nnx.as_abstract(state, mesh, RULES),
    lambda: fsm.get_partition_spec(state),
    lambda: fsm.plan(state, mesh, RULES).shardings(),
    lambda: fsm.get_sharding(state, mesh, RULES, replicate_indivisible=True),
  ):
    assert assert_same_as_reference(fn)[0] == 'returned'


def test_a_module_is_read_as_its_state_is(mesh):
  class Model(nnx.Module):
    def __init__(self):
      self.up = nnx.Linear(
        8,
        16,
        rngs=nnx.Rngs(0),
        kernel_init=fsm.nnx.with_logical_partitioning(
          nnx.initializers.lecun_normal(), ('embed', 'mlp')
        ),
      )
      self.counter = Counter(jnp.zeros(()))

  model = nnx.eval_shape(Model)
  for fn in (
    lambda: fsm.get_sharding(nnx.state(model), mesh, RULES),
    lambda: fsm.nnx.as_abstract(model, mesh, RULES),
  ):
    assert assert_same_as_reference(fn)[0] == 'returned'


def test_result_variables_do_not_share_metadata_with_the_input(mesh):
  param = fsm_param((8, 16), ('embed', 'mlp'))
  out = fsm.get_sharding({'w': param}, mesh, RULES)['w']
  out.set_metadata('extra', 1)
  assert 'extra' not in param.get_metadata()
  assert out.get_value().spec == P(None, 'model')


def test_rebuilt_variables_hold_what_replace_gives_them(mesh):
  state = varied_state(mesh)
  variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  result = NamedSharding(mesh, P())
  for variable in variables:
    if variable.get_metadata().get('ref'):
      continue  # replace() refuses a NamedSharding for it
    want, got = variable.replace(result), ann_lib.rebuild(variable, result)
    assert type(got) is type(want)
    slots = {s for k in type(want).__mro__ for s in getattr(k, '__slots__', ())}
    for slot in sorted(slots):
      assert hasattr(got, slot) == hasattr(want, slot), slot
      if hasattr(want, slot):
        assert getattr(got, slot) == getattr(want, slot), slot
    assert got._trace_state.is_valid()


def test_variables_rebuilt_under_a_trace_belong_to_that_trace(mesh):
  state = nnx.State({'w': fsm_param((8, 16), ('embed', 'mlp'))})
  before = fsm.get_sharding(state, mesh, RULES)['w']
  seen = {}

  @jax.jit
  def traced(x):
    inside = fsm.get_sharding(state, mesh, RULES)['w']
    seen['inside'] = inside._trace_state.is_valid()
    seen['outer'] = before._trace_state.is_valid()
    seen['as replace'] = inside._trace_state == state['w'].replace(None)._trace_state
    return x

  traced(jnp.zeros(2))
  after = fsm.get_sharding(state, mesh, RULES)['w']
  assert seen == {'inside': True, 'outer': False, 'as replace': True}
  assert before._trace_state.is_valid() and after._trace_state.is_valid()
  after.set_value(NamedSharding(mesh, P()))  # updatable where it was made


# Choosing the reading
# ------------------------------------------------------------------------------


def test_the_fast_path_holds_on_this_flax():
  # Fails loudly when a flax release changes what the fast path relies on
  # (users then get the reference reading: correct, only slower).
  assert reading.probe(reading.fast_path())
  assert reading.chosen_reading().name == 'fast'


def test_the_probe_sees_a_field_gone(monkeypatch):
  monkeypatch.setattr(nnx.Variable, '__slots__', ('_raw_value', '_var_metadata'))
  assert not reading.probe(reading.fast_path())
  monkeypatch.setattr(reading, '_chosen', [])
  assert reading.chosen_reading() is reading.REFERENCE


def test_the_probe_sees_fields_that_no_longer_hold_what_accessors_give(monkeypatch):
  # A flax whose Variable keeps its value elsewhere than the field read.
  def get_value(self, **kwargs):
    return jax.ShapeDtypeStruct((1,), jnp.float32)

  monkeypatch.setattr(nnx.Variable, 'get_value', get_value)
  assert not reading.probe(reading.fast_path())


def test_the_probe_sees_a_rebuild_that_differs_from_replace(monkeypatch):
  real = nnx.Variable.copy

  def copy(self, *args, **kwargs):  # a flax whose replace adds metadata
    out = real(self, *args, **kwargs)
    out.set_metadata('added', True)
    return out

  monkeypatch.setattr(nnx.Variable, 'copy', copy)
  monkeypatch.setattr(nnx.Variable, 'replace', copy)
  assert not reading.probe(reading.fast_path())


def test_a_failed_probe_on_first_use_installs_the_reference_reading(monkeypatch):
  state = nnx.State({'w': fsm_param((8, 16), ('embed', 'mlp'))})
  mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
  want = fsm.get_sharding(state, mesh, RULES)
  monkeypatch.setattr(nnx.Variable, '__slots__', ('_raw_value', '_var_metadata'))
  monkeypatch.setattr(reading, '_chosen', [])
  monkeypatch.setattr(reading, '_installed', [reading._FIRST_USE])
  saved = list(ann_lib._registry)
  try:
    reading._install(reading._FIRST_USE)
    got = fsm.get_sharding(state, mesh, RULES)  # the first use probes
    assert reading.installed_reading() == 'reference'
  finally:
    ann_lib._registry[:] = saved
    ann_lib._by_type.clear()
  assert jax.tree.structure(got) == jax.tree.structure(want)
  assert jax.tree.leaves(got) == jax.tree.leaves(want)


def test_the_nnx_reading_fixture_runs_each_reading(nnx_reading):
  fsm.get_partition_spec(nnx.State({'w': fsm_param((8,), ('mlp',))}))
  assert reading.installed_reading() == nnx_reading


def test_forcing_the_reference_reading_puts_the_previous_one_back(mesh):
  state = nnx.State({'w': fsm_param((8, 16), ('embed', 'mlp'))})
  fsm.get_sharding(state, mesh, RULES)  # chosen and installed by now
  before = reading.installed_reading()
  with reading.use_reference_reading():
    assert reading.installed_reading() == 'reference'
    assert ann_lib._classify(nnx.Param).read is reading.reference_read
  assert reading.installed_reading() == before == reading.chosen_reading().name


# Identical errors
# ------------------------------------------------------------------------------


ERROR_CASES = {
  'indivisible': lambda: flax_param(
    jax.ShapeDtypeStruct((6, 16), jnp.float32), out_sharding=('mlp', None)
  ),
  'rank': lambda: flax_param(
    jax.ShapeDtypeStruct((16,), jnp.float32), out_sharding=('embed', 'mlp')
  ),
  'string_names': lambda: flax_param(
    jax.ShapeDtypeStruct((16,), jnp.float32), out_sharding='mlp'
  ),
  'integer_name': lambda: flax_param(
    jax.ShapeDtypeStruct((16,), jnp.float32), out_sharding=(1,)
  ),
  'bad_rules': lambda: flax_param(
    jax.ShapeDtypeStruct((16,), jnp.float32),
    out_sharding=('mlp',),
    sharding_rules=(('mlp', 3),),
  ),
  'unknown_axis': lambda: flax_param(
    jax.ShapeDtypeStruct((16,), jnp.float32), out_sharding=('data', 'pipe')
  ),
  'hook_indivisible': lambda: flax_param(
    jax.ShapeDtypeStruct((16, 6), jnp.float32),
    out_sharding=('model', None),
    on_get_value=flip,
  ),
  'ref': lambda: flax_param(jnp.zeros((16,)), out_sharding=('mlp',), ref=True),
}


@pytest.mark.parametrize('case', sorted(ERROR_CASES))
def test_errors_are_the_reference_errors_naming_the_path(mesh, case):
  tree = {'ok': fsm_param((8, 16), ('embed', 'mlp')), 'layer': {'bad': None}}
  tree['layer']['bad'] = ERROR_CASES[case]()
  kind, *rest = assert_same_as_reference(lambda: fsm.get_sharding(tree, mesh, RULES))
  assert kind == 'raised'
  if issubclass(rest[0], fsm.ShardingError):
    assert 'layer/bad' in rest[1]


# Any mix of Variables
# ------------------------------------------------------------------------------

NAMES = st.sampled_from(
  [
    ('embed', 'mlp'),
    ('mlp', 'embed'),
    ('data', None),
    (None, 'model'),
    ('heads', 'batch'),
    ('vocab', 'mlp'),
    ('mlp',),
    (),
  ]
)
CLASSES = st.sampled_from([nnx.Param, nnx.BatchStat, nnx.OptState, Counter])
VARIABLES = st.tuples(
  CLASSES,
  NAMES,
  st.sampled_from(['out_sharding', 'sharding_names', 'sharding']),
  st.sampled_from([None, (('vocab', 'data'),), (('mlp', 'data'),)]),
  st.sampled_from(['absent', True, False]),
  st.sampled_from(['struct', 'array', 'numpy']),
)


def make_variable(spec: tuple[Any, ...]) -> nnx.Variable[Any]:
  cls, names, key, rules, marker, value_kind = spec
  shape = (8, 16)[: max(len(names), 1)]
  value = {
    'struct': jax.ShapeDtypeStruct(shape, jnp.float32),
    'array': jnp.zeros(shape),
    'numpy': np.zeros(shape),
  }[value_kind]
  metadata: dict[str, Any] = {key: names}
  if rules is not None:
    metadata['sharding_rules'] = rules
  if marker != 'absent':
    metadata[FSM_LOGICAL] = marker
  return flax_param(value, cls, **metadata)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(VARIABLES, min_size=1, max_size=12))
def test_any_mix_of_variables_gives_the_reference_result(specs):
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(AxisType.Explicit,) * 2)
  state = nnx.State({f'v{i}': make_variable(s) for i, s in enumerate(specs)})
  assert_same_as_reference(lambda: fsm.get_sharding(state, mesh, RULES))
