"""Tests for flax_shardmeta.nnx: annotated Variables, eager layout, reading."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm

RULES = [('batch', 'data'), ('mlp', 'model'), ('heads', 'model')]

# Key tests run with each reading of Variables: the fast path and the
# reference reading it falls back to (conftest's nnx_reading).
each_reading = pytest.mark.usefixtures('nnx_reading')

lecun = nnx.initializers.lecun_normal()
zeros = nnx.initializers.zeros_init()


def logical(names, init=lecun, **kwargs):
  return fsm.nnx.with_logical_partitioning(init, names, **kwargs)


class Mlp(nnx.Module):
  """Two Linear layers with logical annotations, embed -> mlp -> embed."""

  def __init__(self, embed: int, hidden: int, rngs: nnx.Rngs):
    self.up = nnx.Linear(
      embed,
      hidden,
      kernel_init=logical(('embed', 'mlp')),
      bias_init=logical(('mlp',), zeros),
      rngs=rngs,
    )
    self.down = nnx.Linear(
      hidden, embed, kernel_init=logical(('mlp', 'embed')), use_bias=False, rngs=rngs
    )


def spec_of(variable: nnx.Variable) -> P:
  return variable.get_value().sharding.spec


# Public surface
# ------------------------------------------------------------------------------


def test_nnx_adapter_is_public_and_documented():
  assert 'nnx' in fsm.__all__
  for name in fsm.nnx.__all__:
    obj = getattr(fsm.nnx, name)
    if callable(obj):
      assert obj.__doc__, name


# Annotating at construction
# ------------------------------------------------------------------------------


def test_param_from_wrapped_initializer_is_laid_out_under_a_mesh(mesh):
  make = fsm.nnx.with_partitioning(lambda: jnp.ones((8, 4)), ('model', None))
  with jax.set_mesh(mesh):
    p = nnx.Param(make())
  assert spec_of(p) == P('model', None)
  assert fsm.get_partition_spec(p).get_value() == P('model', None)


def test_eager_construction_uses_fsm_rules_and_replicates_unmapped_names(mesh):
  # 'embed' has no rule: flax's own eager path raises on it, fsm replicates.
  with jax.set_mesh(mesh), fsm.logical_axis_rules(RULES):
    model = Mlp(16, 32, nnx.Rngs(0))
  assert spec_of(model.up.kernel) == P(None, 'model')
  assert spec_of(model.up.bias) == P('model')
  assert spec_of(model.down.kernel) == P('model', None)


def test_explicit_mesh_argument_needs_no_context():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  init = fsm.nnx.with_logical_partitioning(
    lambda: jnp.ones((8, 4)), ('embed', 'mlp'), rules=[('embed', 'data')], mesh=mesh
  )
  assert spec_of(nnx.Param(init())) == P('data', None)


def test_without_mesh_values_stay_unsharded_and_keep_annotation():
  model = Mlp(16, 32, nnx.Rngs(0))
  kernel = model.up.kernel
  assert len(kernel.get_value().sharding.device_set) == 1
  assert fsm.get_partition_spec(nnx.state(model))['up']['kernel'].get_value() == (
    P('embed', 'mlp')
  )


def test_eval_shape_gives_abstract_values_with_annotation():
  model = nnx.eval_shape(lambda: Mlp(16, 32, nnx.Rngs(0)))
  assert isinstance(model.up.kernel.get_value(), jax.ShapeDtypeStruct)
  assert model.up.kernel.get_metadata('out_sharding') == ('embed', 'mlp')


def test_eval_shape_under_explicit_mesh_carries_fsm_layout():
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(AxisType.Explicit,) * 2)
  with jax.set_mesh(mesh), fsm.logical_axis_rules(RULES):
    model = nnx.eval_shape(lambda: Mlp(16, 32, nnx.Rngs(0)))
  value = model.up.kernel.get_value()
  assert isinstance(value, jax.ShapeDtypeStruct)
  assert value.sharding.spec == P(None, 'model')


@each_reading
def test_fsm_eval_shape_under_any_mesh_carries_fsm_layout(mesh):
  # Plain nnx.eval_shape under an Auto mesh lets flax attach shardings by its
  # own renaming, which fails on 'embed'; fsm.nnx.eval_shape does not.
  with jax.set_mesh(mesh), fsm.logical_axis_rules(RULES):
    model = fsm.nnx.eval_shape(lambda: Mlp(16, 32, nnx.Rngs(0)))
  kernel = model.up.kernel
  assert isinstance(kernel.get_value(), jax.ShapeDtypeStruct)
  assert kernel.get_value().sharding.spec == P(None, 'model')
  assert kernel.get_metadata('out_sharding') == ('embed', 'mlp')


def test_construction_error_names_shape_names_and_reason(mesh):
  init = logical(('embed', 'mlp'))
  with jax.set_mesh(mesh), fsm.logical_axis_rules(RULES):
    with pytest.raises(fsm.ShardingError, match=r'size 6 is not divisible'):
      nnx.Linear(16, 6, kernel_init=init, rngs=nnx.Rngs(0))


def test_names_must_be_a_sequence():
  with pytest.raises(ValueError, match=r"write \('model',\)"):
    fsm.nnx.with_partitioning(zeros, 'model')


# Reading: get_partition_spec / get_sharding on NNX state
# ------------------------------------------------------------------------------


@each_reading
def test_get_partition_spec_is_as_written_with_state_structure():
  state = nnx.state(nnx.eval_shape(lambda: Mlp(16, 32, nnx.Rngs(0))))
  specs = fsm.get_partition_spec(state)
  assert jax.tree.structure(specs) == jax.tree.structure(state)
  assert specs['down']['kernel'].get_value() == P('mlp', 'embed')
  # Unannotated array leaves (rng state) get P().
  assert specs['up']['bias'].get_value() == P('mlp')


@each_reading
def test_get_sharding_has_exactly_the_state_structure(mesh):
  state = nnx.state(nnx.eval_shape(lambda: Mlp(16, 32, nnx.Rngs(0))))
  shardings = fsm.get_sharding(state, mesh, RULES)
  assert jax.tree.structure(shardings) == jax.tree.structure(state)
  assert all(isinstance(s, NamedSharding) for s in jax.tree.leaves(shardings))
  assert shardings['up']['kernel'].get_value().spec == P(None, 'model')


@each_reading
def test_out_shardings_from_state_made_outside_any_context(mesh):
  # The abstract state comes from no mesh and no rules; the real one is
  # created under both: the trees must still match for jit.
  abstract = nnx.state(nnx.eval_shape(lambda: Mlp(16, 32, nnx.Rngs(0))))
  shardings = fsm.get_sharding(abstract, mesh, RULES)
  with jax.set_mesh(mesh), fsm.logical_axis_rules(RULES):
    state = jax.jit(
      lambda: nnx.state(Mlp(16, 32, nnx.Rngs(0))), out_shardings=shardings
    )()
  assert (
    jax.tree.leaves(jax.tree.map(lambda a, s: a.sharding == s, state, shardings))
    == [True] * 3
  )


@each_reading
@pytest.mark.parametrize('key', ['out_sharding', 'sharding_names', 'sharding'])
def test_flax_own_annotations_under_every_key(key):
  mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
  # from_metadata stores the metadata as given, as older flax versions (or
  # states restored from them) hold it; the constructor would rename it.
  var = nnx.Param.from_metadata(
    jax.ShapeDtypeStruct((8, 16, 4), jnp.float32),
    {
      key: ('data', 'mlp', 'unknown'),
      'hijax': False,
      'ref': False,
      'eager_sharding': False,
      'sharding_rules': (('mlp', 'model'),),
    },
  )
  # Flax semantics: 'data' is a mesh axis kept as is, 'mlp' renamed by the
  # variable's rules, 'unknown' has no rule and no axis so it is replicated.
  assert fsm.get_sharding(var, mesh).get_value().spec == P('data', 'model', None)
  assert fsm.get_partition_spec(var).get_value() == P('data', 'mlp', 'unknown')


def test_flax_own_annotation_with_context_rules_and_mesh_metadata(mesh):
  with jax.set_mesh(mesh):
    linear = nnx.Linear(
      16,
      32,
      rngs=nnx.Rngs(0),
      kernel_init=nnx.with_partitioning(lecun, ('data', 'model'), mesh=mesh),
    )
  assert spec_of(linear.kernel) == P('data', 'model')
  state = nnx.state(linear)
  # Context rules rename through fsm's engine, priority-ordered.
  with fsm.logical_axis_rules([('model', 'data'), ('data', 'model')]):
    got = fsm.get_sharding(state, mesh)['kernel'].get_value().spec
  assert got == P('model', 'data')


@each_reading
def test_named_sharding_metadata_is_understood():
  mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
  var = nnx.Param.from_metadata(
    jax.ShapeDtypeStruct((8, 4), jnp.float32),
    {
      'out_sharding': NamedSharding(mesh, P('model', None)),
      'hijax': False,
      'ref': False,
      'eager_sharding': False,
    },
  )
  assert fsm.get_sharding(var, mesh).get_value().spec == P('model', None)


@each_reading
def test_errors_name_the_variable_path():
  class Block(nnx.Module):
    def __init__(self, rngs):
      self.mlp = Mlp(16, 12, rngs)

  class Model(nnx.Module):
    def __init__(self):
      self.blocks = nnx.List([Block(nnx.Rngs(i)) for i in range(4)])

  state = nnx.state(nnx.eval_shape(Model))
  mesh = jax.sharding.AbstractMesh((8,), ('model',))
  with pytest.raises(fsm.ShardingError, match='12 leaves cannot be sharded') as info:
    fsm.get_sharding(state, mesh, RULES)
  message = str(info.value)
  assert 'blocks/3/mlp/up/kernel: shape (16, 12)' in message
  assert "names ('embed', 'mlp')" in message
  # Every problem is listed at once: 3 leaves per block, 4 blocks.
  assert len(info.value.problems) == 12


@each_reading
def test_rank_mismatch_is_reported_by_path():
  var = nnx.Param(
    jnp.ones((2, 8, 4)),
    out_sharding=('mlp', None),
    fsm_logical=True,
    eager_sharding=False,
  )
  mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
  with pytest.raises(fsm.ShardingError, match=r'w: .*2 names for a rank-3'):
    fsm.get_sharding({'w': var}, mesh)


# nnx.bridge
# ------------------------------------------------------------------------------


@each_reading
def test_bridge_to_nnx_keeps_fsm_box_annotations(mesh):
  import flax.linen as nn

  class Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(
        32,
        kernel_init=fsm.with_logical_partitioning(
          nn.initializers.lecun_normal(), ('embed', 'mlp')
        ),
      )(x)
      return nn.Dense(
        16,
        kernel_init=fsm.with_partitioning(
          nn.initializers.lecun_normal(), ('model', None)
        ),
      )(x)

  model = nnx.bridge.ToNNX(Dense(), rngs=nnx.Rngs(0)).lazy_init(jnp.ones((2, 16)))
  state = nnx.state(model, nnx.Param)
  specs = fsm.get_partition_spec(state)
  assert specs['Dense_0']['kernel'].get_value() == P('embed', 'mlp')
  assert specs['Dense_1']['kernel'].get_value() == P('model', None)
  shardings = fsm.get_sharding(state, mesh, RULES)
  assert shardings['Dense_0']['kernel'].get_value().spec == P(None, 'model')
  assert shardings['Dense_1']['kernel'].get_value().spec == P('model', None)
  # And back to Linen: the variables are fsm boxes again.
  linen_vars = nnx.bridge.variables.to_linen_var(state['Dense_0']['kernel'])
  assert isinstance(linen_vars, fsm.LogicalPartitioned)
  assert linen_vars.names == ('embed', 'mlp')


def test_mixed_axis_types_at_construction():
  # 'data' Auto, 'model' Explicit: laid out as jax allows (device_put eagerly).
  mesh = jax.make_mesh(
    (2, 4), ('data', 'model'), axis_types=(AxisType.Auto, AxisType.Explicit)
  )
  with jax.set_mesh(mesh):
    p = nnx.Param(
      fsm.nnx.with_partitioning(lambda: jnp.ones((8, 4)), ('model', 'data'))()
    )
  assert p.get_value().sharding.spec == P('model', 'data')


# flax's current NNX API: as_abstract, eager-sharding switch, Format, optimizer
# ------------------------------------------------------------------------------


@each_reading
def test_as_abstract_on_a_module_and_on_its_state():
  # Abstract mesh with Auto axes; the layout comes from fsm's rules.
  mesh = jax.sharding.AbstractMesh(
    (2, 4), ('data', 'model'), axis_types=(AxisType.Auto,) * 2
  )
  abstract = nnx.eval_shape(lambda: Mlp(8, 16, nnx.Rngs(0)))
  with fsm.logical_axis_rules(RULES):
    module = fsm.nnx.as_abstract(abstract, mesh)
    state = fsm.nnx.as_abstract(nnx.state(abstract), mesh)
  assert module.up.kernel.get_value().sharding.spec == P(None, 'model')
  assert state['up']['kernel'].get_value().sharding.spec == P(None, 'model')
  assert abstract.up.kernel.get_value().sharding is None  # not changed in place
  concrete = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(AxisType.Auto,) * 2)
  with jax.set_mesh(concrete), fsm.logical_axis_rules(RULES):  # the context mesh
    down = fsm.nnx.as_abstract(abstract).down.kernel.get_value()
  assert down.sharding.spec == P('model', None)


def test_as_abstract_needs_a_mesh():
  abstract = nnx.eval_shape(lambda: Mlp(8, 16, nnx.Rngs(0)))
  with pytest.raises(fsm.NoMeshError, match='as_abstract needs a mesh'):
    fsm.nnx.as_abstract(abstract)


def test_eager_sharding_switch_is_honoured(mesh):
  with jax.set_mesh(mesh), fsm.logical_axis_rules(RULES):
    with nnx.use_eager_sharding(False):
      lazy = Mlp(8, 16, nnx.Rngs(0))
    eager = Mlp(8, 16, nnx.Rngs(0))
  # Created as is: replicated (typed so on an Explicit mesh).
  assert all(e is None for e in spec_of(lazy.up.kernel))
  assert spec_of(eager.up.kernel) == P(None, 'model')
  assert fsm.nnx.variable_annotation(lazy.up.kernel).names == ('embed', 'mlp')
  with jax.set_mesh(mesh), fsm.logical_axis_rules(RULES):
    fsm.nnx.shard_module(lazy)  # laid out when asked
  assert spec_of(lazy.up.kernel) == P(None, 'model')
  assert (lazy.up.kernel.get_value() == eager.up.kernel.get_value()).all()


def test_format_metadata_is_read_through_to_its_sharding():
  from jax.experimental.layout import Format, Layout

  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(AxisType.Explicit,) * 2)
  sharding = NamedSharding(mesh, P('model', None))
  var = nnx.Param(
    jnp.ones((8, 4)),
    out_sharding=Format(Layout((1, 0)), sharding),
    eager_sharding=False,
  )
  assert fsm.nnx.variable_annotation(var).mesh == mesh
  assert fsm.get_sharding(var, mesh).get_value().spec == P('model', None)
  assert fsm.plan({'w': var}, mesh).entry('w').spec == P('model', None)


@each_reading
def test_reduced_axes_of_metadata_stay_in_the_layout():
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(AxisType.Explicit,) * 2)
  spec = P('data', None, reduced={'model'})
  for written in (spec, NamedSharding(mesh, spec)):
    var = nnx.Param(jnp.ones((8, 4)), out_sharding=written, eager_sharding=False)
    assert fsm.get_sharding(var, mesh).get_value().spec == spec


@each_reading
def test_flax_optimizer_sharding_metadata_lays_out_the_moments():
  # flax's own metadata, no fsm initializer: nnx.Optimizer moves a parameter's
  # optimizer_sharding into its moments' out_sharding, and fsm reads that.
  mesh = jax.sharding.AbstractMesh(
    (2, 4), ('data', 'model'), axis_types=(AxisType.Auto,) * 2
  )

  def create():
    model = nnx.Linear(
      8,
      16,
      rngs=nnx.Rngs(0),
      kernel_metadata={
        'out_sharding': ('embed', 'mlp'),
        'optimizer_sharding': ('mlp', None),
        'eager_sharding': False,
      },
    )
    return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

  model, optimizer = nnx.eval_shape(create)
  with fsm.logical_axis_rules([('mlp', 'model'), ('embed', 'data')]):
    p = fsm.plan(nnx.state(optimizer), mesh)
    params = fsm.plan(nnx.state(model, nnx.Param), mesh)
  assert params.entry('kernel').spec == P('data', 'model')
  assert p.entry('opt_state/0/mu/kernel').spec == P('model', None)
  assert p.entry('opt_state/0/nu/kernel').spec == P('model', None)


def test_flax_own_nnx_functions_lay_fsm_variables_out_as_fsm_does(mesh):
  # Item 7: flax read fsm's logical names in out_sharding as mesh axes and
  # raised "Resource axis: embed of P('embed', 'mlp') is not found in mesh".
  rules = [('embed', 'data'), ('mlp', 'model')]

  def create():
    return Mlp(8, 16, nnx.Rngs(0))

  with jax.set_mesh(mesh), fsm.logical_axis_rules(rules):
    abstract = nnx.eval_shape(create)  # flax's own, under its documented idiom
    state = nnx.state(abstract)
    want = fsm.get_sharding(state, mesh)
    flax_specs = nnx.get_partition_spec(state)
    flax_named = nnx.get_named_sharding(state, mesh)
    _, abstract_state = nnx.get_abstract_model(create, mesh)
  expected = {
    k: tuple(v.get_value().spec)
    for k, v in jax.tree_util.tree_flatten_with_path(
      want, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )[0]
    for k in ['/'.join(str(getattr(p, 'key', p)) for p in k)]
  }
  assert expected == {
    'down/kernel': ('model', 'data'),
    'up/bias': ('model',),
    'up/kernel': ('data', 'model'),
  }
  assert spec_of(abstract.up.kernel) == P('data', 'model')
  assert spec_of(abstract.down.kernel) == P('model', 'data')
  assert flax_specs['up']['kernel'].get_value() == P('data', 'model')
  assert flax_named['down']['kernel'].get_value().spec == P('model', 'data')
  assert abstract_state['up']['bias'].get_value().sharding.spec == P('model')


def test_flax_own_functions_replicate_unmapped_names_and_follow_any_context(mesh):
  state = nnx.state(nnx.eval_shape(lambda: Mlp(8, 16, nnx.Rngs(0))))
  # No rule for 'embed': replicated, as fsm does (flax kept it as a mesh axis).
  with fsm.logical_axis_rules([('mlp', 'model')]):
    assert nnx.get_partition_spec(state)['up']['kernel'].get_value() == P(None, 'model')
  # No rules at all: everything replicated, no error.
  assert nnx.get_partition_spec(state)['up']['kernel'].get_value() == P(None, None)
  # Under flax's own rule context, flax and fsm agree too.
  with nn.logical_axis_rules([('embed', 'data'), ('mlp', 'model')]):
    assert nnx.get_partition_spec(state)['up']['kernel'].get_value() == P(
      'data', 'model'
    )
    fsm_spec = fsm.get_sharding(state, mesh)['up']['kernel'].get_value().spec
    assert fsm_spec == P('data', 'model')
  # Rule priority, as fsm resolves it: 'mlp' takes 'model' first, so 'embed'
  # falls back to 'data' (flax's own renaming would give 'model' twice).
  with fsm.logical_axis_rules(
    [('mlp', 'model'), ('embed', 'model'), ('embed', 'data')]
  ):
    assert nnx.get_partition_spec(state)['up']['kernel'].get_value() == P(
      'data', 'model'
    )


def test_flax_functions_on_stacked_layers_and_optimizer_state(mesh):
  rules = [('layers', 'data'), ('mlp', 'model'), ('embed', None)]

  @nnx.vmap(in_axes=0, transform_metadata={nnx.PARTITION_NAME: 'layers'})
  def stack(key):
    return nnx.Linear(8, 16, rngs=nnx.Rngs(key), kernel_init=logical(('embed', 'mlp')))

  with jax.set_mesh(mesh), fsm.logical_axis_rules(rules):
    layers = fsm.nnx.shard_module(stack(jax.random.split(jax.random.key(0), 2)))
    state = nnx.state(layers)
    assert nnx.get_partition_spec(state)['kernel'].get_value() == P(
      'data', None, 'model'
    )
    assert spec_of(layers.kernel) == P('data', None, 'model')
    optimizer = nnx.Optimizer(
      nnx.Linear(8, 16, rngs=nnx.Rngs(0), kernel_init=logical(('embed', 'mlp'))),
      optax.adam(1e-3),
      wrt=nnx.Param,
    )
    opt_specs = nnx.get_partition_spec(nnx.state(optimizer))
    fsm_specs = fsm.get_sharding(nnx.state(optimizer), mesh)
  assert opt_specs['opt_state'][0]['mu']['kernel'].get_value() == P(None, 'model')
  assert fsm_specs['opt_state'][0]['mu']['kernel'].get_value().spec == P(None, 'model')
