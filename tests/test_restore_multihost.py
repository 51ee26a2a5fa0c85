"""fsm.restore across 2 real processes x 4 CPU devices under jax.distributed.

A tree saved on 'data'=8 is restored onto ('data' 2, 'model' 4), saved again
with those layouts and restored onto 'data'=8 (``restore_round_trip`` in
``multihost_scenarios.py``). Each process measures the bytes it read, its
``rchar`` from /proc/self/io, and compares them with what the restore plan
says that process (host) reads.
"""

import json
import sys
from pathlib import Path

import jax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_multihost import run_processes  # noqa: E402  (the same launcher)

pytestmark = pytest.mark.skipif(
  not sys.platform.startswith('linux'), reason='reads /proc/self/io'
)


@pytest.mark.slow
def test_restore_reads_what_the_plan_says_in_each_process(tmp_path):
  run_processes('restore', tmp_path)
  reports = [json.loads((tmp_path / f'restore-{i}.json').read_text()) for i in range(2)]
  assert [r['process_index'] for r in reports] == [0, 1]
  # 'data' of the (2, 4) mesh spans the processes: each holds one row.
  assert reports[0]['mesh_processes'] == [[0] * 4, [1] * 4]
  for r in reports:
    for way in ('onto_mesh', 'back'):
      done = r[way]
      where = f'process {r["process_index"]}, {way}'
      # The plan's hosts are the processes, and it agrees across them.
      assert done['num_hosts'] == 2, where
      assert done['read_per_host'] == reports[0][way]['read_per_host'], where
      assert all(done['same_sharding'].values()), (where, done['same_sharding'])
      assert all(done['same_values'].values()), (where, done['same_values'])
      # 'embed's reads in a process meet the same saved chunks; run one at a
      # time, each fetches them, as the plan counts (running together they
      # could share a fetch and read less than planned).
      assert done['reads_alone']['embed'], (where, done['groups'])
      # rchar counts every read of the process, the plan only the arrays':
      # the restore also reads metadata (orbax's _METADATA files, the OCDBT
      # manifest and b-tree nodes) and, the first time, a few module files:
      # tens of KiB. The arrays are a few MiB of random values that barely
      # compress, so the difference stays within 5% of the planned bytes.
      planned, measured = done['planned_read'], done['measured_read']
      assert planned > 1 << 20, where
      assert abs(measured - planned) <= 0.05 * planned, (where, measured, planned)
  # Each process reads its part ('dense' and 'embed' are split across the
  # processes), not the whole checkpoint, though 'embed' is over-read.
  whole = reports[0]['checkpoint_bytes']
  for way in ('onto_mesh', 'back'):
    assert all(0 < b < 0.9 * whole for b in reports[0][way]['read_per_host']), way
    assert all(r[way]['measured_read'] < 0.9 * whole for r in reports), way


@pytest.mark.slow
def test_checksums_combine_across_processes_and_catch_damage_in_one(tmp_path):
  import multihost_scenarios as scenarios

  import flax_shardmeta as fsm

  run_processes('restore-checked', tmp_path)
  reports = [json.loads((tmp_path / f'checked-{i}.json').read_text()) for i in range(2)]
  # The same values saved in this one process, laid out another way: the
  # checksums the two processes combined are the same, leaf by leaf.
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(AxisType.Auto,) * 2)
  here = {
    name: jax.device_put(v, NamedSharding(mesh, P('model') if v.ndim else P()))
    for name, v in scenarios._restore_values().items()
  }
  mine = json.loads(
    (Path(fsm.save(tmp_path / 'one-process', here)) / '_FSM_CHECKSUMS.json').read_text()
  )
  for r in reports:
    assert r['checksums'] == mine
    assert sorted(r['checked']) == sorted(scenarios.RESTORED)
    assert all(r['same_values'].values()), r['same_values']
    # Process 1's data file was damaged; both processes raise, naming 'dense'.
    assert r['damaged'] is not None, r['process_index']
    assert r['damaged']['paths'] == ['dense'], r['damaged']
  assert reports[0]['damaged'] == reports[1]['damaged']
