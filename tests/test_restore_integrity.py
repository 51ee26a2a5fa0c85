"""A damaged checkpoint never restores as other values without a word.

Checkpoints are written by ``fsm.save`` (with content checksums) or by plain
orbax (without), on ``jax.make_mesh`` meshes over the 8 CPU devices with Auto
axis types, then damaged as a disk or a copy would: bytes of an OCDBT data
file flipped or cut off, an orbax metadata file overwritten.
"""

import glob
import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta.examples.linen import MLP, MLP_RULES

# After a read orbax refuses (damaged data, a bad target), its background threads
# close their event loop while a callback is still queued; Python reports that as an
# unraisable 'Event loop is closed', which is noise: the error the caller sees is fsm's.
pytestmark = pytest.mark.filterwarnings(
  'ignore::pytest.PytestUnraisableExceptionWarning'
)

AUTO = AxisType.Auto


def mesh_of(shape, names=('data', 'model')):
  return jax.make_mesh(shape, names[: len(shape)], axis_types=(AUTO,) * len(shape))


def random_like(x, seed):
  """Random values of ``x``'s dtype and sharding: every bit matters."""
  rng = np.random.default_rng(seed)
  if jnp.issubdtype(x.dtype, jnp.integer):
    values = rng.integers(-1000, 1000, x.shape)
  else:
    values = rng.standard_normal(x.shape)
  return jax.device_put(values.astype(x.dtype), x.sharding)


@pytest.fixture(scope='module')
def linen_saved(tmp_path_factory):
  """An MLP's boxed params and adam state, random, saved by fsm.save on data=8."""
  model, tx = MLP(num_layers=2, depth=64), optax.adam(1e-3)

  def init(key):
    params = model.init(key, jnp.ones((8, 64)))['params']
    return {'params': params, 'opt_state': tx.init(params)}

  fsdp = [('hidden', 'data'), ('embed', None), ('layers', None)]
  with fsm.logical_axis_rules(fsdp):
    abstract = jax.eval_shape(init, jax.random.key(0))
    state = jax.jit(init, out_shardings=fsm.plan(abstract, mesh_of((8,))).shardings())(
      jax.random.key(0)
    )
  leaves, treedef = jax.tree.flatten(state)
  state = treedef.unflatten([random_like(x, i) for i, x in enumerate(leaves)])
  path = fsm.save(tmp_path_factory.mktemp('linen') / 'step_10', state)
  return path, abstract, state


def target_on(abstract, mesh):
  with fsm.logical_axis_rules(MLP_RULES):
    return fsm.as_abstract(abstract, mesh)


def same_bits(got, want):
  got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got_leaves) == len(want_leaves) > 0
  return all(
    a.dtype == b.dtype
    and np.array_equal(
      np.asarray(a).reshape(-1).view(np.uint8), np.asarray(b).reshape(-1).view(np.uint8)
    )
    for a, b in zip(got_leaves, want_leaves)
  )


def data_file(path):
  """The largest OCDBT data file of the checkpoint: the arrays' chunks."""
  files = glob.glob(os.path.join(path, 'ocdbt.process_*', 'd', '*'))
  return max(files, key=os.path.getsize)


def copy(path, tmp_path):
  where = tmp_path / 'copy'
  shutil.copytree(path, where)
  return str(where)


def flip_bytes(path, at=0.5, count=8):
  f = data_file(path)
  data = bytearray(pathlib.Path(f).read_bytes())
  start = int(len(data) * at)
  for i in range(start, start + count):
    data[i] ^= 0xFF
  pathlib.Path(f).write_bytes(bytes(data))


@pytest.mark.parametrize('shape', [(2, 4), (1, 1)], ids=['data2_model4', 'one_device'])
def test_intact_checkpoint_restores_on_other_meshes_bit_for_bit(linen_saved, shape):
  path, abstract, state = linen_saved
  target = target_on(abstract, mesh_of(shape))
  plan = fsm.restore_plan(path, target)
  # Every leaf is restored as saved (no cast), so every one is checked.
  assert plan.content_check.algorithm is not None
  assert len(plan.content_check.checked) == len(jax.tree.leaves(state))
  assert plan.content_check.unchecked == ()
  assert 'checked against fsm.save' in str(plan)
  restored = fsm.restore(path, target, host_budget='256KiB')
  assert same_bits(restored, state)


def test_flipped_bytes_raise_naming_the_leaf(linen_saved, tmp_path):
  path, abstract, state = linen_saved
  damaged = copy(path, tmp_path)
  flip_bytes(damaged)
  target = target_on(abstract, mesh_of((2, 4)))
  # The symptom: orbax alone returns other values without an error.
  with ocp.StandardCheckpointer() as checkpointer:
    plain = checkpointer.restore(damaged, jax.tree.map(lambda x: x, target))
  assert not same_bits(plain, state)
  with pytest.raises(fsm.CheckpointDamagedError) as raised:
    fsm.restore(damaged, target)
  text = str(raised.value)
  # Only the largest leaves' chunks fill the data file: one of them is named,
  # by path, with both checksums.
  bad = [p.path for p in raised.value.problems]
  assert bad and all(p in text for p in bad)
  assert all(
    p.startswith(('params/', 'opt_state/0/mu/', 'opt_state/0/nu/')) for p in bad
  )
  assert 'differ from what fsm.save wrote' in text
  assert text.count('checksum') >= 1 and 'saved ' in text
  assert isinstance(raised.value, fsm.RestoreError)


def test_flipped_bytes_caught_on_a_one_device_mesh(linen_saved, tmp_path):
  path, abstract, _ = linen_saved
  # Where a flip lands depends on the order orbax's writers put the chunks in
  # the file: in a chunk's values (caught by the checksums) or in what frames
  # them (the read fails). Every flip is caught, and the values' own check
  # catches at least one of them.
  said = []
  for i, at in enumerate((0.2, 0.4, 0.6, 0.8)):
    damaged = copy(path, tmp_path / str(i))
    flip_bytes(damaged, at=at)
    with pytest.raises(fsm.CheckpointDamagedError) as raised:
      fsm.restore(damaged, target_on(abstract, mesh_of((1, 1))))
    said.append(str(raised.value))
  assert any('restored with other values' in text for text in said), said


def test_truncated_data_file_names_the_leaf_in_a_short_message(linen_saved, tmp_path):
  path, abstract, _ = linen_saved
  damaged = copy(path, tmp_path)
  f = data_file(damaged)
  with open(f, 'r+b') as handle:
    handle.truncate(os.path.getsize(f) // 2)
  with pytest.raises(fsm.CheckpointDamagedError) as raised:
    fsm.restore(damaged, target_on(abstract, mesh_of((2, 4))))
  text = str(raised.value)
  assert len(text) < 1024, text
  assert 'TensorStore details' not in text and "'driver'" not in text
  assert 'cannot be read' in text and f in text  # the data file that lost bytes
  # The leaf by its path in the target, not orbax's dotted name.
  names = [
    p
    for p in fsm.restore_plan(
      path, target_on(abstract, mesh_of((2, 4)))
    ).content_check.checked
    if f'leaf {p}:' in text or f'leaf {p} ' in text
  ]
  assert len(names) == 1, text


def test_plain_orbax_checkpoint_says_content_not_checked(tmp_path):
  mesh = mesh_of((8,))
  w = random_like(
    jax.ShapeDtypeStruct(
      (64, 32), jnp.float32, sharding=NamedSharding(mesh, P('data'))
    ),
    0,
  )
  path = str(tmp_path / 'plain')
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, {'w': w})
  new = mesh_of((2, 4))
  target = {
    'w': jax.ShapeDtypeStruct(
      (64, 32), jnp.float32, sharding=NamedSharding(new, P(None, 'model'))
    )
  }
  plan = fsm.restore_plan(path, target)
  assert plan.content_check.algorithm is None and plan.content_check.checked == ()
  assert 'content: not checked' in str(plan) and 'not written by fsm.save' in str(plan)
  assert plan.to_dict()['content_check']['algorithm'] is None
  assert same_bits(fsm.restore(path, target), {'w': w})


def test_cast_is_not_checked_and_the_plan_says_why(tmp_path):
  mesh = mesh_of((8,))
  w = jax.device_put(
    jnp.arange(64, dtype=jnp.bfloat16).reshape(8, 8), NamedSharding(mesh, P('data'))
  )
  path = fsm.save(tmp_path / 'bf16', {'w': w})
  target = {
    'w': jax.ShapeDtypeStruct(
      (8, 8), jnp.float32, sharding=NamedSharding(mesh_of((2, 4)), P('data'))
    )
  }
  plan = fsm.restore_plan(path, target)
  assert plan.content_check.checked == ()
  ((where, why),) = plan.content_check.unchecked
  assert where == 'w' and 'restored as float32 from bfloat16' in why
  assert 'w: restored as float32 from bfloat16' in str(plan)
  # No false alarm: the widened values come back.
  out = fsm.restore(path, target)
  np.testing.assert_array_equal(np.asarray(out['w']), np.asarray(w, np.float32))


def test_nnx_module_saved_and_checked(tmp_path):
  class Mlp(nnx.Module):
    def __init__(self, rngs):
      init = fsm.nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, 'model'))
      self.up = nnx.Linear(64, 256, kernel_init=init, rngs=rngs)

  mesh = mesh_of((2, 4))
  with jax.set_mesh(mesh):
    model = Mlp(nnx.Rngs(0))
    nnx.update(model, jax.tree.map(lambda x: random_like(x, 3), nnx.state(model)))
  path = fsm.save(tmp_path / 'nnx', model)
  abstract = nnx.eval_shape(lambda: Mlp(nnx.Rngs(0)))
  target = fsm.nnx.as_abstract(abstract, mesh_of((8, 1)))
  assert len(fsm.restore_plan(path, target).content_check.checked) == 2
  restored = fsm.restore(path, target)
  assert same_bits(nnx.state(restored), nnx.state(model))
  damaged = copy(path, tmp_path)
  flip_bytes(damaged, at=0.3)
  with pytest.raises(fsm.CheckpointDamagedError, match='up/kernel'):
    fsm.restore(damaged, fsm.nnx.as_abstract(abstract, mesh_of((8, 1))))


@pytest.mark.parametrize('name', ['_METADATA', '_CHECKPOINT_METADATA'])
@pytest.mark.parametrize('content', ['{"tree_metadata": {', '', '[]'])
def test_corrupt_metadata_file_is_named_as_corrupt(
  linen_saved, tmp_path, name, content
):
  path, abstract, _ = linen_saved
  damaged = copy(path, tmp_path)
  with open(os.path.join(damaged, name), 'w') as f:
    f.write(content)
  target = target_on(abstract, mesh_of((2, 4)))
  for call in (fsm.restore_plan, fsm.restore):
    with pytest.raises(fsm.CheckpointDamagedError) as raised:
      call(damaged, target)
    text = str(raised.value)
    assert os.path.join(damaged, name) in text and 'corrupt' in text, text
    assert 'holds no orbax checkpoint metadata' not in text
    assert len(text) < 1024, text


def test_corrupt_checksums_file_is_named(linen_saved, tmp_path):
  path, abstract, _ = linen_saved
  damaged = copy(path, tmp_path)
  where = os.path.join(damaged, '_FSM_CHECKSUMS.json')
  record = json.loads(pathlib.Path(where).read_text())
  del record['leaves']
  pathlib.Path(where).write_text(json.dumps(record))
  with pytest.raises(fsm.CheckpointDamagedError, match='checksums file .* is corrupt'):
    fsm.restore_plan(damaged, target_on(abstract, mesh_of((2, 4))))


def test_pinned_host_target_is_restored_unchecked_and_the_plan_says_so(tmp_path):
  mesh = mesh_of((2, 4))
  kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
  assert 'pinned_host' in kinds, kinds  # jax's CPU backend has host memory
  w = random_like(
    jax.ShapeDtypeStruct(
      (8, 16), jnp.float32, sharding=NamedSharding(mesh_of((8,)), P('data'))
    ),
    1,
  )
  path = fsm.save(tmp_path / 'ckpt', {'w': w, 'v': w})
  host = NamedSharding(mesh, P(None, 'model'), memory_kind='pinned_host')
  target = {
    'w': jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=host),
    'v': jax.ShapeDtypeStruct(
      (8, 16), jnp.float32, sharding=NamedSharding(mesh, P('data'))
    ),
  }
  check = fsm.restore_plan(path, target).content_check
  assert check.checked == ('v',)
  assert check.unchecked == (
    ('w', 'restored into pinned_host memory: checked only in device memory'),
  )
  out = fsm.restore(path, target)
  assert out['w'].sharding.memory_kind == 'pinned_host'
  assert same_bits(out, {'v': w, 'w': w})


def test_checkpoint_manager_layout_restores_checked(linen_saved, tmp_path):
  _, abstract, state = linen_saved
  root = tmp_path / 'run'
  fsm.save(root / '5' / 'default', jax.tree.map(lambda x: x + 1, state))
  fsm.save(root / '10' / 'default', state)
  target = target_on(abstract, mesh_of((4, 2)))
  assert len(fsm.restore_plan(root, target).content_check.checked) == len(
    jax.tree.leaves(state)
  )
  assert same_bits(fsm.restore(root, target), state)
  flip_bytes(str(root / '10' / 'default'))
  with pytest.raises(fsm.CheckpointDamagedError, match=str(root / '10' / 'default')):
    fsm.restore(root, target)


def test_metadata_json_orbax_cannot_read_is_named_as_corrupt(linen_saved, tmp_path):
  path, abstract, _ = linen_saved
  damaged = copy(path, tmp_path)
  pathlib.Path(damaged, '_METADATA').write_text('{"tree_metadata": 5}')
  with pytest.raises(fsm.CheckpointDamagedError) as raised:
    fsm.restore_plan(damaged, target_on(abstract, mesh_of((2, 4))))
  text = str(raised.value)
  assert os.path.join(damaged, '_METADATA') in text and 'is corrupt' in text, text
  assert "orbax cannot read its tree: AttributeError: 'int' object" in text


def test_damaged_array_metadata_names_the_leaf(linen_saved, tmp_path):
  path, abstract, _ = linen_saved
  damaged = copy(path, tmp_path)
  # The checkpoint's own b-tree file: orbax's per-array metadata (.zarray).
  (index,) = glob.glob(os.path.join(damaged, 'd', '*'))
  with open(index, 'r+b') as handle:
    handle.truncate(16)
  with pytest.raises(fsm.CheckpointDamagedError) as raised:
    fsm.restore_plan(damaged, target_on(abstract, mesh_of((2, 4))))
  text = str(raised.value)
  assert len(text) < 1024 and 'TensorStore details' not in text, text
  assert 'array metadata' in text and 'damaged or incomplete' in text, text
  assert index in text or 'leaf ' in text, text


def test_save_refuses_an_existing_path_and_abstract_leaves(linen_saved, tmp_path):
  path, abstract, state = linen_saved
  with pytest.raises(fsm.FlaxShardmetaError, match='already exists.*force=True'):
    fsm.save(path, state)
  abstract_leaf = '7 leaves .* abstract .*opt_state/0/count'
  with pytest.raises(fsm.FlaxShardmetaError, match=abstract_leaf):
    fsm.save(tmp_path / 'abstract', abstract)
  assert not (tmp_path / 'abstract').exists()
  # force=True replaces the checkpoint, checksums included.
  other = jax.tree.map(lambda x: x * 2, state)
  fsm.save(tmp_path / 'again', state)
  fsm.save(tmp_path / 'again', other, force=True)
  target = target_on(abstract, mesh_of((2, 4)))
  assert same_bits(fsm.restore(tmp_path / 'again', target), other)
