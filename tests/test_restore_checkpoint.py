"""fsm.restore_plan reading the saved layout from an orbax checkpoint directory.

Checkpoints are saved with orbax from real arrays on the 8 CPU devices as
``data=8``; targets are structs on ``data=2 x model=4``. Both meshes have Auto
axes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta._restore.checkpoint import read_checkpoint

AUTO = AxisType.Auto
SAVED = {
  'w': ((16, 8), jnp.float32, P('data')),
  'e': ((8, 16), jnp.bfloat16, P(None, 'data')),
  'q': ((32,), jnp.int8, P('data')),
  'b': ((8,), jnp.float32, P()),
}
TARGET = {
  'w': P('data', 'model'),
  'e': P('model', 'data'),
  'q': P('model'),
  'b': P('model'),
}


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  """A checkpoint of SAVED's leaves as zeros on data=8, and its directory."""
  # Auto axes, as a training job's mesh usually has.
  mesh = jax.make_mesh((8,), ('data',), axis_types=(AUTO,))
  tree = {
    k: jax.device_put(jnp.zeros(shape, dtype), NamedSharding(mesh, spec))
    for k, (shape, dtype, spec) in SAVED.items()
  }
  path = tmp_path_factory.mktemp('ckpt') / 'state'
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, tree)
  checkpointer.wait_until_finished()
  return path


def structs(mesh, specs, dtypes=None):
  dtypes = dtypes or {}
  return {
    k: jax.ShapeDtypeStruct(
      shape, dtypes.get(k, dtype), sharding=NamedSharding(mesh, specs[k])
    )
    for k, (shape, dtype, _) in SAVED.items()
  }


def target_mesh():
  return AbstractMesh((2, 4), ('data', 'model'), axis_types=(AUTO, AUTO))


def test_saved_layout_reads_back_as_saved(saved):
  ckpt = read_checkpoint(saved)
  source, chunks = ckpt.tree, ckpt.chunks
  for k, (shape, dtype, spec) in SAVED.items():
    s = source[k]
    assert (s.shape, s.dtype, s.sharding.spec) == (shape, dtype, spec)
    mesh = s.sharding.mesh
    assert isinstance(mesh, AbstractMesh)
    assert (mesh.axis_sizes, mesh.axis_names, mesh.axis_types) == (
      (8,),
      ('data',),
      (AUTO,),
    )
  # Sharded leaves are written one chunk per shard.
  assert chunks['w'] == (2, 8) and chunks['e'] == (8, 2) and chunks['q'] == (4,)


@pytest.mark.parametrize('devices_per_host', [8, 4])
def test_plan_from_directory_matches_plan_from_structs(saved, devices_per_host):
  target = structs(target_mesh(), TARGET)
  got = fsm.restore_plan(str(saved), target, devices_per_host=devices_per_host)
  paper = structs(AbstractMesh((8,), ('data',), axis_types=(AUTO,)), {
    k: spec for k, (_, _, spec) in SAVED.items()
  })  # fmt: skip
  want = fsm.restore_plan(paper, target, devices_per_host=devices_per_host)
  assert got.problems == () == want.problems
  assert [e.saved_spec for e in got.entries] == [e.saved_spec for e in want.entries]
  assert got.needed_per_host == want.needed_per_host
  for e, f in zip(got.entries, want.entries):
    assert (e.path, e.bytes_needed) == (f.path, f.bytes_needed)
    # The same reads; on paper their chunks count at decoded size, from the
    # directory at stored size (zstd frames of these few bytes each).
    assert e.cost.reads.tolist() == f.cost.reads.tolist()
    assert e.bytes_read > 0


def test_finer_written_chunks_are_read_as_written(saved):
  # orbax wrote the replicated bias in chunks of one element, so a host
  # holding 2 elements of it reads 2 of them, not the whole 8 of a shard.
  target = structs(target_mesh(), TARGET)
  r = fsm.restore_plan(str(saved), target, devices_per_host=1)
  ckpt = read_checkpoint(saved)
  assert ckpt.chunks['b'] == (1,)
  # Eight one-device hosts: each holds 2 elements, read as their 2 chunks;
  # every element is held on 2 hosts (the data axis replicates it).
  assert r.entry('b').bytes_needed == 8 * 2 * 4
  assert r.entry('b').bytes_read == 2 * int(ckpt.stored['b'].sum())


def test_path_like_and_budget(saved):
  r = fsm.restore_plan(
    saved, structs(target_mesh(), TARGET), host_budget='1KiB', devices_per_host=8
  )
  assert r.fits_budget and r.problems == ()


def test_dtype_mismatch_is_reported_by_path(saved):
  target = structs(target_mesh(), TARGET, {'w': jnp.bfloat16})
  r = fsm.restore_plan(str(saved), target, devices_per_host=8)
  assert [(p.path, p.reason) for p in r.problems] == [
    ('w', 'a cast that can lose values: saved as float32, restored as bfloat16')
  ]


def test_leaf_saved_without_named_sharding_is_unsharded(tmp_path):
  path = tmp_path / 'single'
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, {'s': jnp.zeros((6,), jnp.float32)})
  checkpointer.wait_until_finished()
  mesh = target_mesh()
  target = {
    's': jax.ShapeDtypeStruct((6,), jnp.float32, sharding=NamedSharding(mesh, P()))
  }
  r = fsm.restore_plan(path, target, devices_per_host=8)
  assert r.entry('s').saved_spec is None and r.problems == ()
  # One replicated cell, one read of the one chunk, at its stored size.
  assert r.total_needed == 24
  assert r.total_read == int(read_checkpoint(path).stored['s'].sum())


def test_stored_bytes_are_the_values_on_disk(tmp_path):
  # Random values: every chunk (8 rows x 64, 2 KiB) is stored out of line.
  mesh = jax.make_mesh((8,), ('data',), axis_types=(AUTO,))
  rng = np.random.default_rng(0)
  tree = {
    k: jax.device_put(rng.standard_normal((64, 64), np.float32),
                      NamedSharding(mesh, P('data')))
    for k in ('u', 'v')
  }  # fmt: skip
  path = tmp_path / 'random'
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, tree)
  ckpt = read_checkpoint(path)
  # The b-tree's own count of out-of-line bytes is the sum of its values.
  store = ts.KvStore.open(f'file://{path}/').result()
  root = ts.ocdbt.dump(store).result()['versions'][-1]['root']
  assert (
    sum(int(g.sum()) for g in ckpt.stored.values())
    == (root['statistics']['num_indirect_value_bytes'])
  )
  assert ckpt.stored['u'].shape == (8, 1) and (ckpt.stored['u'] > 1024).all()
  # A leaf that does not move reads each chunk once, as stored.
  same = {
    k: jax.ShapeDtypeStruct(
      (64, 64), jnp.float32, sharding=NamedSharding(mesh, P('data'))
    )
    for k in tree
  }
  r = fsm.restore_plan(path, same)
  assert r.entry('u').bytes_read == int(ckpt.stored['u'].sum())
  assert r.total_needed == 2 * 64 * 64 * 4


def test_not_a_checkpoint_names_the_path(tmp_path):
  (tmp_path / 'notes.txt').write_text('no checkpoint here')
  with pytest.raises(fsm.FlaxShardmetaError, match=str(tmp_path)):
    fsm.restore_plan(str(tmp_path), {})
  missing = tmp_path / 'missing'
  with pytest.raises(fsm.FlaxShardmetaError, match='missing is not a directory'):
    fsm.restore_plan(missing, {})
