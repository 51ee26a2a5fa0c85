"""fsm.restore: checkpoints saved on one mesh restored onto another.

Meshes are ``jax.make_mesh`` over the 8 CPU devices with Auto axis types.
Values are random (or counting) so that a wrong shard cannot pass for a
right one; every comparison is bit for bit.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta._restore import restore as restore_lib
from flax_shardmeta.examples.linen import MLP, MLP_RULES

AUTO = AxisType.Auto


def mesh_of(shape):
  # Auto axes, as a training job's mesh usually has.
  return jax.make_mesh(shape, ('data', 'model'), axis_types=(AUTO, AUTO))


def struct(shape, mesh, spec, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def save(path, tree):
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, tree)
  return path


def randomize(tree, seed=0):
  """Every array leaf of ``tree`` replaced by random values, same sharding."""
  rng = np.random.default_rng(seed)

  def fill(x):
    if not isinstance(x, jax.Array):
      return x
    if jnp.issubdtype(x.dtype, jnp.integer):
      values = rng.integers(-100, 100, x.shape).astype(x.dtype)
    else:
      values = rng.standard_normal(x.shape).astype(x.dtype)
    return jax.device_put(values, x.sharding)

  return jax.tree.map(fill, tree)


def assert_bit_identical(got, want):
  got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got_leaves) == len(want_leaves) > 0
  for a, b in zip(got_leaves, want_leaves):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(
      np.asarray(a).reshape(-1).view(np.uint8), np.asarray(b).reshape(-1).view(np.uint8)
    )


@pytest.fixture(scope='module')
def linen_state(tmp_path_factory):
  """An MLP's boxed params and adam state, random, saved from (2, 4)."""
  model = MLP(num_layers=2, depth=64)
  x = jnp.ones((8, 64))
  tx = optax.adam(1e-3)

  def init(key):
    params = model.init(key, x)['params']
    return {'params': params, 'opt_state': tx.init(params)}

  mesh = mesh_of((2, 4))
  with fsm.logical_axis_rules(MLP_RULES):
    abstract = jax.eval_shape(init, jax.random.key(0))
    state = jax.jit(init, out_shardings=fsm.plan(abstract, mesh).shardings())(
      jax.random.key(0)
    )
  state = randomize(state)
  path = save(tmp_path_factory.mktemp('linen') / 'state', state)
  return path, abstract, state


@pytest.mark.parametrize('shape', [(4, 2), (8, 1), (1, 8)])
def test_linen_state_with_optimizer_onto_other_meshes(linen_state, shape):
  path, abstract, state = linen_state
  mesh = mesh_of(shape)
  with fsm.logical_axis_rules(MLP_RULES):
    target = fsm.as_abstract(abstract, mesh)
    planned = fsm.plan(abstract, mesh)
  restored = fsm.restore(path, target, host_budget='256KiB')
  # Boxes stay boxes, each holding an array laid out as planned.
  kernel = restored['params']['ScanDotReluDot_0']['Dense_0']['kernel']
  assert isinstance(kernel, nn.LogicallyPartitioned)
  assert isinstance(kernel.value, jax.Array)
  sharding = kernel.value.sharding
  assert isinstance(sharding, NamedSharding)
  assert sharding.mesh.shape == dict(zip(('data', 'model'), shape))
  assert fsm.verify(restored, planned) == []
  assert_bit_identical(restored, state)


def test_linen_boxes_with_mesh_and_rules(linen_state):
  path, abstract, state = linen_state
  # The parameters alone, as annotated boxes laid out by mesh and rules (the
  # optimizer's step count has no annotation, so it is left out: partial).
  params = {'params': abstract['params']}
  restored = fsm.restore(
    path, params, mesh=mesh_of((4, 2)), rules=MLP_RULES, partial=True
  )
  with fsm.logical_axis_rules(MLP_RULES):
    assert fsm.verify(restored, fsm.plan(params, mesh_of((4, 2)))) == []
  assert_bit_identical(restored, {'params': state['params']})


class Mlp(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    logical = fsm.nnx.with_logical_partitioning
    init = nnx.initializers.lecun_normal()
    self.up = nnx.Linear(
      16,
      32,
      kernel_init=logical(init, ('embed', 'mlp')),
      bias_init=logical(nnx.initializers.zeros, ('mlp',)),
      rngs=rngs,
    )
    self.down = nnx.Linear(32, 16, kernel_init=logical(init, ('mlp', 'embed')),
                           use_bias=False, param_dtype=jnp.bfloat16,
                           rngs=rngs)  # fmt: skip

  def __call__(self, x):
    return self.down(self.up(x))


NNX_RULES = [('embed', 'data'), ('mlp', 'model')]


def test_nnx_module_comes_back_as_a_module(tmp_path):
  with jax.set_mesh(mesh_of((2, 4))), fsm.logical_axis_rules(NNX_RULES):
    model = Mlp(nnx.Rngs(0))
  state = randomize(nnx.state(model))
  path = save(tmp_path / 'nnx', state)
  abstract = nnx.eval_shape(lambda: Mlp(nnx.Rngs(0)))
  mesh = mesh_of((1, 8))
  with fsm.logical_axis_rules(NNX_RULES):
    target = fsm.nnx.as_abstract(abstract, mesh)
  restored = fsm.restore(path, target)
  assert isinstance(restored, Mlp)
  kernel = restored.up.kernel.get_value()
  assert kernel.sharding == NamedSharding(mesh, P('data', 'model'))
  assert restored.down.kernel.get_value().dtype == jnp.bfloat16
  assert_bit_identical(nnx.state(restored), state)
  # The restored module runs.
  assert restored(jnp.ones((2, 16))).shape == (2, 16)


MIXED = {
  'f32': ((64, 32), jnp.float32, P('data'), P(None, 'model')),
  'bf16': ((32, 64), jnp.bfloat16, P('data'), P('model', 'data')),
  'i8': ((128,), jnp.int8, P('data'), P('model')),
  'step': ((), jnp.int32, P(), P()),
}


@pytest.fixture(scope='module')
def mixed(tmp_path_factory):
  saved_mesh = mesh_of((8, 1))
  tree = randomize({
    k: jax.device_put(jnp.zeros(shape, dtype), NamedSharding(saved_mesh, saved))
    for k, (shape, dtype, saved, _) in MIXED.items()
  })  # fmt: skip
  return save(tmp_path_factory.mktemp('mixed') / 'ckpt', tree), tree


def mixed_target(mesh, keys=tuple(MIXED)):
  return {
    k: jax.ShapeDtypeStruct(
      MIXED[k][0], MIXED[k][1], sharding=NamedSharding(mesh, MIXED[k][3])
    )
    for k in keys
  }


def test_int8_bf16_and_a_scalar_in_groups_and_back(mixed, tmp_path):
  path, tree = mixed
  mesh = mesh_of((2, 4))
  budget = fsm.restore_plan(path, mixed_target(mesh)).min_budget_bytes
  plan = fsm.restore_plan(path, mixed_target(mesh), host_budget=budget)
  assert plan.fits_budget and max(plan.staging_peak_per_host) <= budget
  restored = fsm.restore(path, mixed_target(mesh), host_budget=budget)
  for k, (_, _, _, spec) in MIXED.items():
    assert restored[k].sharding == NamedSharding(mesh, spec), k
  assert_bit_identical(restored, tree)
  # And back onto the saved layout, from a checkpoint of the restored tree.
  again = save(tmp_path / 'again', restored)
  back_mesh = mesh_of((8, 1))
  back = {
    k: jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(back_mesh, saved))
    for k, (s, d, saved, _) in MIXED.items()
  }
  assert_bit_identical(fsm.restore(again, back), tree)


def test_restored_arrays_are_donatable(mixed):
  path, tree = mixed
  restored = fsm.restore(path, mixed_target(mesh_of((2, 4))))
  step = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), donate_argnums=0)
  out = step(restored)
  jax.block_until_ready(out)
  # Donated: the first step reuses the restored buffers, never holds both.
  assert all(x.is_deleted() for x in jax.tree.leaves(restored))
  assert int(out['step']) == int(tree['step']) + 1


@pytest.fixture
def no_reads(monkeypatch):
  """Fails the test if orbax is asked to read anything."""

  def refuse(*args, **kwargs):
    raise AssertionError('orbax was asked to read')

  monkeypatch.setattr(ocp.Checkpointer, 'restore', refuse)


def test_target_without_sharding_is_refused_before_reading(mixed, no_reads):
  path, _ = mixed
  target = mixed_target(mesh_of((2, 4)))
  # flax#5110: a bare struct would restore with the saved layout.
  target['f32'] = jax.ShapeDtypeStruct((64, 32), jnp.float32)
  with pytest.raises(fsm.RestoreError, match='nothing was read') as e:
    fsm.restore(path, target)
  (problem,) = e.value.problems
  assert problem.path == 'f32' and 'no sharding' in problem.reason


def test_problems_are_named_by_path_before_reading(mixed, no_reads):
  path, _ = mixed
  mesh = mesh_of((2, 4))
  target = mixed_target(mesh, ('bf16', 'i8', 'step'))
  target['f32'] = jax.ShapeDtypeStruct(
    (64, 16), jnp.float32, sharding=NamedSharding(mesh, P())
  )
  target['new'] = jax.ShapeDtypeStruct(
    (4,), jnp.float32, sharding=NamedSharding(mesh, P())
  )
  with pytest.raises(fsm.RestoreError) as e:
    fsm.restore(path, target)
  reasons = {p.path: p.reason for p in e.value.problems}
  assert reasons == {
    'f32': 'saved with shape (64, 32)',
    'new': 'not in the checkpoint',
  }
  assert 'f32: shape (64, 16)' in str(e.value) and 'new: shape (4,)' in str(e.value)


def test_extra_saved_leaves_need_partial(mixed):
  path, tree = mixed
  target = mixed_target(mesh_of((2, 4)), ('f32', 'i8'))
  with pytest.raises(fsm.RestoreError, match='bf16.*not in the target'):
    fsm.restore(path, target)
  restored = fsm.restore(path, target, partial=True)
  assert sorted(restored) == ['f32', 'i8']
  assert_bit_identical(restored, {k: tree[k] for k in ('f32', 'i8')})


def test_budget_below_one_read_names_the_smallest(mixed, no_reads):
  path, _ = mixed
  plan = fsm.restore_plan(path, mixed_target(mesh_of((2, 4))))
  with pytest.raises(fsm.RestoreError, match='cannot be met') as e:
    fsm.restore(path, mixed_target(mesh_of((2, 4))), host_budget=100)
  smallest = fsm._units.format_bytes(plan.min_budget_bytes)
  assert f'at least {smallest}' in str(e.value)


def test_cast_is_restored_as_the_target_asks(mixed):
  path, tree = mixed
  target = mixed_target(mesh_of((2, 4)))
  # bfloat16 into float32 keeps every value: restored without being asked.
  target['bf16'] = jax.ShapeDtypeStruct(
    (32, 64), jnp.float32, sharding=target['bf16'].sharding
  )
  restored = fsm.restore(path, target)
  assert restored['bf16'].dtype == jnp.float32
  np.testing.assert_array_equal(restored['bf16'], tree['bf16'].astype(jnp.float32))
  # float32 into bfloat16 rounds: only with allow_cast=True.
  target['f32'] = jax.ShapeDtypeStruct(
    (64, 32), jnp.bfloat16, sharding=target['f32'].sharding
  )
  with pytest.raises(fsm.RestoreError, match='f32.*float32, restored as bfloat16'):
    fsm.restore(path, target)
  restored = fsm.restore(path, target, allow_cast=True)
  assert restored['f32'].dtype == jnp.bfloat16
  np.testing.assert_array_equal(restored['f32'], tree['f32'].astype(jnp.bfloat16))


def test_abstract_mesh_needs_a_concrete_one(mixed, no_reads):
  path, _ = mixed
  mesh = AbstractMesh((2, 4), ('data', 'model'), axis_types=(AUTO, AUTO))
  with pytest.raises(fsm.RestoreError, match='concrete mesh'):
    fsm.restore(path, mixed_target(mesh))


def test_checkpoint_manager_root_and_step(tmp_path):
  mesh = mesh_of((8, 1))
  root = tmp_path / 'run'
  saved = {}
  with ocp.CheckpointManager(root) as manager:
    for step in (1, 2):
      tree = randomize(
        {'w': jax.device_put(jnp.zeros((16, 8)), NamedSharding(mesh, P('data')))}, step
      )
      manager.save(step, args=ocp.args.StandardSave(tree))
      saved[step] = tree
    manager.wait_until_finished()
  target = {'w': struct((16, 8), mesh_of((2, 4)), P(None, 'model'))}
  assert_bit_identical(fsm.restore(root, target), saved[2])
  assert_bit_identical(fsm.restore(root, target, step=1), saved[1])
  assert_bit_identical(fsm.restore(root / '1', target), saved[1])
  with pytest.raises(
    fsm.FlaxShardmetaError, match=r'no step 3: its steps are \[1, 2\]'
  ):
    fsm.restore(root, target, step=3)


def test_a_leaf_landing_with_another_layout_stops_the_restore():
  mesh = mesh_of((2, 4))
  x = jax.device_put(jnp.zeros((8, 8)), NamedSharding(mesh, P('data')))
  want = NamedSharding(mesh, P(None, 'model'))
  with pytest.raises(
    fsm.RestoreError, match='w: shape \\(8, 8\\).*not the target layout'
  ):
    restore_lib._landed('w', x, (8, 8), jnp.float32, want)
  assert restore_lib._landed('w', x, (8, 8), jnp.float32, x.sharding) is x


def test_explicit_axes_come_back_explicit(tmp_path):
  # orbax#2408: saved on an Explicit mesh, restored onto one, the arrays
  # carry Explicit axes (their type says so).
  explicit = jax.make_mesh((8,), ('data',), axis_types=(AxisType.Explicit,))
  w = jax.device_put(
    jnp.arange(64.0).reshape(16, 4), NamedSharding(explicit, P('data'))
  )
  path = save(tmp_path / 'explicit', {'w': w})
  target_mesh = jax.make_mesh(
    (2, 4), ('data', 'model'), axis_types=(AxisType.Explicit, AxisType.Explicit)
  )
  target = {'w': struct((16, 4), target_mesh, P('model'))}
  assert fsm.restore_plan(path, target).problems == ()
  out = fsm.restore(path, target)
  assert jax.typeof(out['w']).sharding.mesh.axis_types == (AxisType.Explicit,) * 2
  assert jax.typeof(out['w']).sharding.spec == P('model', None)
  assert_bit_identical(out, {'w': w})


def test_pinned_host_state_restores_into_host_memory(mixed):
  path, tree = mixed
  mesh = mesh_of((2, 4))
  kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
  if 'pinned_host' not in kinds:
    pytest.skip(f'this jax has no pinned_host memory on CPU (it has {sorted(kinds)})')
  target = mixed_target(mesh)
  target['f32'] = jax.ShapeDtypeStruct(
    (64, 32),
    jnp.float32,
    sharding=NamedSharding(mesh, P(None, 'model'), memory_kind='pinned_host'),
  )
  plan = fsm.restore_plan(path, target)
  assert [p.path for p in plan.problems] == ['f32'] and 'pinned_host' in plan.problems[
    0
  ].reason
  out = fsm.restore(path, target)
  assert out['f32'].sharding.memory_kind == 'pinned_host'
  assert_bit_identical(out, tree)
