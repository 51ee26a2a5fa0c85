"""fsm.restore_plan: what each host reads and holds when a checkpoint moves mesh.

Concrete meshes are ``jax.make_mesh`` over the 8 CPU devices with Auto axes
unless a test says otherwise; all 8 devices are one process, so tests that
need several hosts group them with ``devices_per_host``.
"""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta import examples

AUTO = AxisType.Auto


@pytest.fixture(scope='module')
def meshes():
  """The save mesh data=8 and the target mesh data=2 x model=4 (Auto axes)."""
  save = jax.make_mesh((8,), ('data',), axis_types=(AUTO,))
  target = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(AUTO, AUTO))
  return save, target


def struct(shape, mesh, spec, dtype=jnp.float32, **kw):
  sharding = None if mesh is None else NamedSharding(mesh, spec, **kw)
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def test_moved_leaf_bytes_per_host_by_hand(meshes):
  save, target = meshes
  source = {'w': struct((128, 64), save, P('data'))}
  tgt = {'w': struct((128, 64), target, P('data', 'model'))}
  r = fsm.restore_plan(source, tgt, devices_per_host=2)
  # Hosts are device pairs of the (2, 4) mesh: host 0 holds target cells
  # (data 0, model 0..1) = rows 0-63 x columns 0-31 = 64*32*4 = 8192 bytes.
  # Saved chunks are 16 whole rows (16*64*4 = 4096 bytes). orbax reads each
  # cell on its own: rows 0-63 meet chunks 0-3, fetched whole, once per
  # cell: 2 * 4 * 4096 = 32768 bytes.
  assert r.num_hosts == 4
  assert r.needed_per_host == (8192,) * 4
  assert r.read_per_host == (32768,) * 4
  e = r.entry('w')
  assert e.moves and e.saved_spec == P('data') and e.spec == P('data', 'model')
  assert (e.bytes_needed, e.bytes_read, e.over_read) == (32768, 131072, 98304)
  # A read stages its 64x16 shard, its 4 chunks and one decoded chunk, and
  # reserves its chunk-aligned box (64 rows x 64 columns) with orbax.
  cost = e.cost
  assert cost.staged.tolist() == [4096 + 16384 + 4096] * 4
  assert cost.footprint.tolist() == [16384] * 4
  assert r.min_budget_bytes == 24576
  # Each device holds its 64x16 shard after the restore.
  assert r.device_after_bytes == (4096,) * 8
  assert r.problems == ()


def test_cells_agree_with_jax_devices_indices_map(meshes):
  _, target = meshes
  sharding = NamedSharding(target, P('data', 'model'))
  source = {'w': struct((128, 64), None, None)}
  r = fsm.restore_plan(source, {'w': struct((128, 64), target, P('data', 'model'))})
  # One host (one process); each device's shard is as jax lays it out.
  sizes = [
    int(np.prod([s.stop - s.start for s in idx]) * 4)
    for idx in sharding.devices_indices_map((128, 64)).values()
  ]
  assert r.device_after_bytes == tuple(sizes)
  # Saved unsharded: the one chunk is the whole array, fetched by each of the
  # host's 8 reads.
  assert r.needed_per_host == (128 * 64 * 4,)
  assert r.read_per_host == (8 * 128 * 64 * 4,)


def test_leaf_that_does_not_move_reads_exactly_its_bytes(meshes):
  _, target = meshes
  leaf = struct((128, 64), target, P('data', 'model'))
  r = fsm.restore_plan({'w': leaf}, {'w': leaf}, devices_per_host=2)
  e = r.entry('w')
  assert not e.moves
  assert e.bytes_read == e.bytes_needed == 128 * 64 * 4
  assert e.over_read == 0 and r.over_read == 0


def test_replicated_target_needs_the_whole_array_on_every_host(meshes):
  save, target = meshes
  r = fsm.restore_plan(
    {'b': struct((128, 64), save, P('data'))},
    {'b': struct((128, 64), target, P())},
    devices_per_host=4,
  )
  assert r.needed_per_host == r.read_per_host == (32768, 32768)


def test_target_without_sharding_is_flagged(meshes):
  save, target = meshes
  source = {'w': struct((8, 8), save, P('data')), 'b': struct((8,), save, P())}
  # flax#5110: a bare struct restores with the saved layout.
  tgt = {'w': jax.ShapeDtypeStruct((8, 8), jnp.float32), 'b': struct((8,), target, P())}
  r = fsm.restore_plan(source, tgt)
  (problem,) = r.problems
  assert problem.path == 'w' and 'no sharding' in problem.reason
  assert r.entry('w').bytes_read == 0


def test_problems_by_path(meshes):
  save, target = meshes
  explicit = jax.make_mesh((8,), ('data',), axis_types=(AxisType.Explicit,))
  source = {
    'shape': struct((8, 8), save, P('data')),
    'dtype': struct((8, 8), save, P('data')),
    'extra': struct((8,), save, P()),
    'kind': struct((8,), save, P()),
    'types': struct((8, 8), explicit, P('data')),
  }
  tgt = {
    'shape': struct((8, 16), target, P()),
    'dtype': struct((8, 8), target, P(), jnp.bfloat16),
    'missing': struct((8,), target, P()),
    'kind': struct((8,), target, P(), memory_kind='pinned_host'),
    'types': struct((8, 8), target, P('data')),
  }
  r = fsm.restore_plan(source, tgt)
  by_path = {p.path: p.reason for p in r.problems}
  assert set(by_path) == {'shape', 'dtype', 'missing', 'extra', 'kind', 'types'}
  assert 'shape (8, 8)' in by_path['shape']
  assert 'float32' in by_path['dtype'] and 'bfloat16' in by_path['dtype']
  assert 'not in the checkpoint' in by_path['missing']
  assert 'not in the target' in by_path['extra']
  assert 'pinned_host' in by_path['kind']
  assert 'Explicit' in by_path['types'] and "'data'" in by_path['types']
  assert all(p.hint for p in r.problems)


def _three_leaves(meshes):
  save, target = meshes
  shapes = {'a': (128, 64), 'b': (64, 64), 'c': (32, 64)}
  source = {k: struct(s, save, P('data')) for k, s in shapes.items()}
  tgt = {k: struct(s, target, P(None, 'model')) for k, s in shapes.items()}
  return source, tgt


def test_budget_below_the_largest_read_cannot_be_met(meshes):
  source, tgt = _three_leaves(meshes)
  # One host (all 8 devices). A read of 'a' is a 128x16 column block: it
  # fetches all 8 saved chunks of 16 rows (32 KiB), decodes one (4 KiB) and
  # fills its 8 KiB shard: 44 KiB staged.
  r = fsm.restore_plan(source, tgt, host_budget='16KiB')
  assert r.fits_budget is False
  assert r.min_budget_bytes == 44 * 1024
  assert 'cannot be met' in str(r)


def test_schedule_splits_where_a_read_stages_more_per_reserved_byte(meshes):
  save, target = meshes
  source, tgt = _three_leaves(meshes)
  # 'ab' does not move: each read is one whole chunk, decoded in place, so
  # it stages 2 bytes (stored chunk and shard) per byte orbax reserves;
  # 'a', 'b' and 'c' stage 1.375 (44 KiB per 32 KiB box for 'a').
  source['ab'] = struct((128, 64), save, P('data'))
  tgt['ab'] = struct((128, 64), target, P(('data', 'model')))
  r = fsm.restore_plan(source, tgt, host_budget=48 * 1024)
  # In tree order a, ab, b, c. With 'ab', the group's limit would be 24 KiB
  # of boxes, under a's 32 KiB box: 'ab' starts a new group, which 'b'
  # (16 KiB boxes) and 'c' join.
  assert r.fits_budget is True
  assert r.schedule == (('a',), ('ab', 'b', 'c'))
  assert [g.limit for g in r.groups] == [int(48 * 1024 / 1.375), 24 * 1024]
  # One read of 'a' at a time (44 KiB); then one of b's 16 KiB boxes (22 KiB
  # staged) at a time.
  assert r.staging_peak_per_host == (44 * 1024,)
  without = fsm.restore_plan(source, tgt)
  assert without.fits_budget is None and without.schedule == (('a', 'ab', 'b', 'c'),)
  # Shards go in place: the device peak is what it holds after (a quarter of
  # a, b and c, replicated over data; an eighth of ab).
  assert (
    r.device_peak_bytes == r.device_after_bytes == ((56 // 4 + 32 // 8) * 1024,) * 8
  )


def test_big_abstract_plan_totals_add_up():
  state = examples.abstract_state('llama3-70b', 'linen', 'adam')
  fsdp = AbstractMesh((256,), ('fsdp',), axis_types=(AUTO,))
  source = fsm.as_abstract(state, fsdp, [('embed', 'fsdp')])
  target_mesh = AbstractMesh((32, 8), ('data', 'model'), axis_types=(AUTO, AUTO))
  target = fsm.as_abstract(state, target_mesh, fsm.standard_logical_axis_rules(1, 2))
  r = fsm.restore_plan(source, target, devices_per_host=4)
  assert r.problems == () and r.num_hosts == 64
  total = sum(e.bytes_needed for e in r.entries)
  assert r.total_needed == total and r.total_read >= r.total_needed
  # Hosts are 4 consecutive devices: one data row, half the model axis. A
  # host needs 1/32 of a dimension over data and 1/2 of one over model, so
  # summed over the 64 hosts an array counts 64 * those fractions times.
  for e in r.entries:
    axes = _axes(e.spec)
    nbytes = int(np.prod(e.shape)) * e.dtype.itemsize
    share = (32 if 'data' in axes else 1) * (2 if 'model' in axes else 1)
    assert e.bytes_needed == 64 * nbytes // share, e.path
    assert e.bytes_read >= e.bytes_needed
  assert sum(r.device_after_bytes) == sum(
    int(np.prod(e.shape)) * e.dtype.itemsize * 256 // _shards(e.spec) for e in r.entries
  )


def _axes(spec):
  return [a for d in spec for a in ((d,) if isinstance(d, str) else d or ())]


def _shards(spec):
  return int(np.prod([{'data': 32, 'model': 8}[a] for a in _axes(spec)] or [1]))


def test_linen_boxes_as_target_with_mesh_and_rules(meshes):
  save, target = meshes
  model = nn.Dense(64, kernel_init=fsm.with_logical_partitioning(
    nn.initializers.lecun_normal(), ('embed', 'mlp')))  # fmt: skip
  boxes = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 128)))
  source = {'params': {'kernel': struct((128, 64), save, P('data'))}}
  rules = [('embed', 'data'), ('mlp', 'model')]
  r = fsm.restore_plan(source, boxes, mesh=target, rules=rules)
  # The box is no path level; the unannotated bias is a target with no sharding.
  assert [e.path for e in r.entries] == ['params/bias', 'params/kernel']
  assert r.entry('params/kernel').spec == P('data', 'model')
  assert {p.path for p in r.problems} == {'params/bias'}


def test_to_dict_is_json_and_str_has_the_totals(meshes):
  source, tgt = _three_leaves(meshes)
  r = fsm.restore_plan(source, tgt, host_budget='48KiB')
  d = json.loads(json.dumps(r.to_dict()))
  assert d['total_read'] == r.total_read and d['schedule'] == [['a', 'b', 'c']]
  text = str(r)
  # Each of the 4 column reads of a leaf fetches all of its saved chunks.
  assert 'total: read 224.00 KiB, needed 56.00 KiB' in text
  assert 'problems: none' in text


def test_the_text_groups_by_module_and_stars_only_what_moves(meshes):
  save, target = meshes
  # Twelve identical blocks, a step count, an embedding: the table has a
  # row per module and stacks the blocks; --verbose lists every array.
  source = {
    f'Block_{i}': {
      'kernel': struct((64, 32), save, P('data')),
      'bias': struct((32,), save, P()),
    }
    for i in range(12)
  }
  source['count'] = struct((), save, P(), dtype=jnp.int32)
  tgt = {
    f'Block_{i}': {
      'kernel': struct((64, 32), target, P('data', 'model')),
      'bias': struct((32,), target, P()),
    }
    for i in range(12)
  }
  tgt['count'] = struct((), target, P(), dtype=jnp.int32)
  plan = fsm.restore_plan(source, tgt)
  lines = str(plan).splitlines()
  (stack,) = [line for line in lines if line.startswith('Block_{0..11}/')]
  assert '[12 identical copies]' in stack
  cells = stack.split()
  # 24 arrays, the 12 kernels change layout; the biases and the count
  # (replicated before and after, P() to P()) do not.
  assert cells[-3:] == ['12', 'of', '24']
  assert len(lines) < 15
  verbose = plan.format(verbose=True).splitlines()
  assert any(line.startswith('Block_11/kernel *') for line in verbose)
  assert any(line.split()[0] == 'count' for line in verbose)
  assert not [
    line for line in verbose if line.startswith(('count *', 'Block_0/bias *'))
  ]
  assert not plan.entry('count').moves and not plan.entry('Block_3/bias').moves
