"""The scale-up notebook flow in NNX, stacked layers, optimizers, properties."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings, strategies as st
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm

RULES = [('batch', 'data'), ('mlp', 'model'), ('layers', 'data')]
LAYERS = {nnx.PARTITION_NAME: 'layers'}

# Key tests run with each reading of Variables: the fast path and the
# reference reading it falls back to (conftest's nnx_reading).
each_reading = pytest.mark.usefixtures('nnx_reading')

lecun = nnx.initializers.lecun_normal()


def logical(names, init=lecun, **kwargs):
  return fsm.nnx.with_logical_partitioning(init, names, **kwargs)


class Block(nnx.Module):
  """embed -> mlp -> embed, annotated with logical names."""

  def __init__(self, rngs: nnx.Rngs, optimizer_names=None):
    self.up = nnx.Linear(
      16,
      32,
      rngs=rngs,
      bias_init=logical(('mlp',), nnx.initializers.zeros),
      kernel_init=logical(('embed', 'mlp'), optimizer_names=optimizer_names),
    )
    self.down = nnx.Linear(
      32, 16, kernel_init=logical(('mlp', 'embed')), use_bias=False, rngs=rngs
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    h = fsm.with_logical_constraint(jax.nn.relu(self.up(x)), ('batch', 'mlp'))
    # Under Explicit axes the contracted 'mlp' dimension is sharded on both
    # operands, so jax asks for the output layout.
    explicit = jax.sharding.get_abstract_mesh().are_all_axes_explicit
    out = fsm.logical_to_mesh_axes(('batch', 'embed')) if explicit else None
    return self.down(h, out_sharding=out)


class Trainer(nnx.Module):
  """A module holding the model and its optimizer."""

  def __init__(self, tx: optax.GradientTransformation):
    self.model = Block(nnx.Rngs(0))
    self.optimizer = nnx.Optimizer(self.model, tx, wrt=nnx.Param)


def carries(state, shardings) -> bool:
  # Equivalence, not equality: jit may drop trailing None entries of a spec.
  return all(
    jax.tree.leaves(
      jax.tree.map(
        lambda a, s: a.sharding.is_equivalent_to(s, a.ndim), state, shardings
      )
    )
  )


# The notebook flow
# ------------------------------------------------------------------------------


@each_reading
def test_notebook_flow(mesh):
  tx = optax.adam(1e-2)
  with fsm.logical_axis_rules(RULES):
    abstract = nnx.eval_shape(lambda: Trainer(tx))
    graphdef, abstract_state = nnx.split(abstract)
    shardings = fsm.get_sharding(abstract_state, mesh)
  assert jax.tree.structure(shardings) == jax.tree.structure(abstract_state)
  planned = shardings['model']['up']['kernel'].get_value()
  assert planned.spec == P(None, 'model')
  mu = shardings['optimizer']['opt_state'][0]['mu']['up']['kernel'].get_value()
  assert mu.spec == P(None, 'model')

  with jax.set_mesh(mesh), fsm.logical_axis_rules(RULES):
    state = jax.jit(lambda: nnx.split(Trainer(tx))[1], out_shardings=shardings)()
    assert carries(state, shardings)
    trainer = nnx.merge(graphdef, state)

    @nnx.jit
    def train_step(trainer: Trainer, x: jax.Array) -> jax.Array:
      def loss_fn(model: Block) -> jax.Array:
        return jnp.mean((model(x) - x) ** 2)

      loss, grads = nnx.value_and_grad(loss_fn)(trainer.model)
      trainer.optimizer.update(trainer.model, grads)
      return loss

    x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P('data', None)))
    first = train_step(trainer, x)
    second = train_step(trainer, x)
  assert second < first
  assert carries(nnx.state(trainer), shardings)


# Stacked layers: nnx.vmap / nnx.scan
# ------------------------------------------------------------------------------


def make_stack(n: int, **vmap_kwargs):
  @nnx.vmap(in_axes=0, transform_metadata=LAYERS, **vmap_kwargs)
  def create(key: jax.Array) -> Block:
    return Block(nnx.Rngs(key))

  return create(jax.random.split(jax.random.key(0), n))


@each_reading
def test_vmap_inserts_layer_name_and_stack_is_sharded_along_it(mesh):
  with jax.set_mesh(mesh), fsm.logical_axis_rules(RULES):
    stack = fsm.nnx.shard_module(make_stack(4))
  kernel = stack.up.kernel
  assert kernel.get_metadata('out_sharding') == ('layers', 'embed', 'mlp')
  assert kernel.get_value().sharding.spec == P('data', None, 'model')
  assert stack.up.bias.get_value().sharding.spec == P('data', 'model')


@each_reading
def test_stack_layout_inside_jit_and_from_out_shardings(mesh):
  abstract = nnx.state(nnx.eval_shape(lambda: make_stack(4)))
  shardings = fsm.get_sharding(abstract, mesh, RULES)
  assert shardings['up']['kernel'].get_value().spec == P('data', None, 'model')
  with jax.set_mesh(mesh), fsm.logical_axis_rules(RULES):
    state = jax.jit(lambda: nnx.state(fsm.nnx.shard_module(make_stack(4))))()
    assert carries(state, shardings)
    state = jax.jit(lambda: nnx.state(make_stack(4)), out_shardings=shardings)()
    assert carries(state, shardings)


def test_layers_mapped_to_none_and_scanned_forward(mesh):
  rules = [('layers', None), ('mlp', 'model')]
  with jax.set_mesh(mesh), fsm.logical_axis_rules(rules):
    stack = fsm.nnx.shard_module(make_stack(3))
    assert stack.down.kernel.get_value().sharding.spec == P(None, 'model', None)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata=LAYERS)
    def forward(x: jax.Array, block: Block) -> jax.Array:
      return fsm.with_logical_constraint(block(x), ('batch', 'embed'))

    y = jax.jit(forward)(jnp.ones((8, 16)), stack)
  assert y.shape == (8, 16)
  # scan removed and re-added the axis by name: the annotation is unchanged.
  assert stack.up.kernel.get_metadata('out_sharding') == ('layers', 'embed', 'mlp')


def test_scan_construction_inserts_layer_name():
  @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0), transform_metadata=LAYERS)
  def create(carry: int, key: jax.Array) -> tuple[int, Block]:
    return carry, Block(nnx.Rngs(key))

  _, stack = create(0, jax.random.split(jax.random.key(0), 2))
  specs = fsm.get_partition_spec(nnx.state(stack))
  assert specs['up']['kernel'].get_value() == P('layers', 'embed', 'mlp')


@each_reading
def test_tree_mode_vmap_leaves_names_short_and_error_names_path():
  # With graph=False flax does not insert the layer name.
  stack = make_stack(2, graph=False)
  mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
  with pytest.raises(fsm.ShardingError, match='2 names for a rank-3 array') as info:
    fsm.get_sharding(nnx.state(stack), mesh, RULES)
  assert 'up/kernel: shape (2, 16, 32)' in str(info.value)
  assert '2 names for a rank-3 array' in str(info.value)


def test_shard_module_needs_a_mesh():
  with pytest.raises(fsm.NoMeshError, match='jax.set_mesh'):
    fsm.nnx.shard_module(Block(nnx.Rngs(0)))


@each_reading
def test_shard_module_on_a_state_returns_a_new_state(mesh):
  state = nnx.state(Block(nnx.Rngs(0)))
  placed = fsm.nnx.shard_module(state, mesh, RULES)
  assert placed['up']['kernel'].get_value().sharding.spec == P(None, 'model')
  assert jax.tree.structure(placed) == jax.tree.structure(state)


# Optimizers
# ------------------------------------------------------------------------------


@pytest.mark.parametrize(
  'tx',
  [optax.adam(1e-3), optax.adamw(1e-3), optax.adafactor(1e-3)],
  ids=['adam', 'adamw', 'adafactor'],
)
@each_reading
def test_optimizer_state_gets_valid_shardings(tx, mesh):
  abstract = nnx.state(nnx.eval_shape(lambda: Trainer(tx)))
  shardings = fsm.get_sharding(abstract, mesh, RULES)
  # jax accepts each sharding for its leaf's shape (shard_shape raises if not).
  jax.tree.map(lambda a, s: s.shard_shape(a.shape), abstract, shardings)
  opt = shardings['optimizer']['opt_state']
  full_rank = 'v' if 'v_row' in opt[0] else 'mu'
  moment = opt[0][full_rank]['up']['kernel'].get_value()
  assert moment.spec == P(None, 'model')


def test_adafactor_factored_moments_are_replicated(mesh):
  class Wide(nnx.Module):
    def __init__(self):
      self.w = nnx.Linear(
        256, 256, kernel_init=logical(('embed', 'mlp')), rngs=nnx.Rngs(0)
      )

  model = nnx.eval_shape(Wide)
  optimizer = nnx.eval_shape(
    lambda: nnx.Optimizer(Wide(), optax.adafactor(1e-3), wrt=nnx.Param)
  )
  shardings = fsm.get_sharding(nnx.state(optimizer), mesh, RULES)
  state = shardings['opt_state'][0]
  assert state['v_row']['w']['kernel'].get_value().spec == P()
  assert state['v_col']['w']['kernel'].get_value().spec == P()
  assert nnx.state(model)['w']['kernel'].shape == (256, 256)


@each_reading
def test_optimizer_sharding_overrides_the_moments_layout(mesh):
  tx = optax.adam(1e-3)

  def create() -> nnx.Optimizer:
    return nnx.Optimizer(
      Block(nnx.Rngs(0), optimizer_names=('embed', 'batch')), tx, wrt=nnx.Param
    )

  shardings = fsm.get_sharding(nnx.state(nnx.eval_shape(create)), mesh, RULES)
  mu = shardings['opt_state'][0]['mu']['up']['kernel'].get_value()
  assert mu.spec == P(None, 'data')
  # Parameters without an override still follow their parameter.
  mu_down = shardings['opt_state'][0]['mu']['down']['kernel'].get_value()
  assert mu_down.spec == P('model', None)


# Property: any NNX annotation gives a usable sharding or a ShardingError
# ------------------------------------------------------------------------------

AXES = ('data', 'model')
NAMES = ('data', 'model', 'embed', 'mlp', 'heads', 'layers', None)


@st.composite
def variable_cases(draw):
  rank = draw(st.integers(0, 3))
  shape = tuple(
    draw(st.lists(st.sampled_from([1, 2, 3, 4, 6, 8]), min_size=rank, max_size=rank))
  )
  n_names = draw(st.sampled_from([rank, rank, rank, max(rank - 1, 0), rank + 1]))
  names = tuple(
    draw(st.lists(st.sampled_from(NAMES), min_size=n_names, max_size=n_names))
  )
  rules = draw(
    st.lists(
      st.tuples(
        st.sampled_from(NAMES[2:6]),
        st.sampled_from([None, 'data', 'model', ('data', 'model'), 'absent']),
      ),
      max_size=4,
    )
  )
  flavour = draw(st.sampled_from(['fsm_logical', 'fsm_mesh', 'flax']))
  mesh_shape = draw(st.sampled_from([(2, 4), (4, 2), (1, 8), (8, 1)]))
  axis_type = draw(st.sampled_from([AxisType.Auto, AxisType.Explicit]))
  return shape, names, rules, flavour, mesh_shape, axis_type


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(variable_cases())
def test_property_sharding_or_sharding_error(case):
  shape, names, rules, flavour, mesh_shape, axis_type = case
  metadata = {
    'out_sharding': names,
    'hijax': False,
    'ref': False,
    'eager_sharding': False,
  }
  if flavour != 'flax':
    metadata['fsm_logical'] = flavour == 'fsm_logical'
  var = nnx.Param.from_metadata(jnp.zeros(shape), metadata)
  mesh = jax.make_mesh(mesh_shape, AXES, axis_types=(axis_type,) * 2)
  try:
    with warnings.catch_warnings():
      # Logical names drawn from the mesh axes with no rule are replicated
      # with this warning, by design.
      warnings.simplefilter('ignore', fsm.UnmappedMeshAxisNameWarning)
      sharding = fsm.get_sharding({'w': var}, mesh, rules)['w'].get_value()
  except (fsm.ShardingError, fsm.InvalidNamesError) as e:
    assert 'w:' in str(e)
    return
  assert isinstance(sharding, NamedSharding)
  jax.device_put(var.get_value(), sharding).block_until_ready()
