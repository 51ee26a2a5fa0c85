"""Real multi-process runs: 2 processes x 4 CPU devices under jax.distributed.

Each scenario of ``multihost_scenarios.py`` runs once in this process (1 x 8
devices) and once across 2 local processes joined on 127.0.0.1 with gloo;
the trained parameters must agree. Every process also checks its own
layouts, the orbax checkpoint round trip and shard/gather round trips.
"""

import json
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import flax_shardmeta as fsm
from flax_shardmeta._hosts import launch as _launch

HERE = Path(__file__).resolve().parent
ROOT = Path(fsm.__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
import multihost_scenarios as scenarios  # noqa: E402


def run_processes(scenario, outdir, timeout=240):
  env = {**os.environ, 'PYTHONPATH': str(ROOT)}
  return _launch.launch(
    [str(HERE / 'multihost_scenarios.py'), scenario, str(outdir)],
    num_processes=2,
    devices_per_process=4,
    timeout=timeout,
    env=env,
  )


def load(outdir):
  report = json.loads((outdir / 'report.json').read_text())
  layouts = [
    json.loads((outdir / f'layout-{i}.json').read_text())['layout']
    for i in range(report['process_count'])
  ]
  with np.load(outdir / 'params.npz') as f:
    params = dict(f)
  return report, layouts, params


def assert_same_training(single_dir, multi_dir):
  single, _, want = load(single_dir)
  multi, _, got = load(multi_dir)
  assert single['process_count'] == 1 and multi['process_count'] == 2
  assert want.keys() == got.keys() and len(want) > 0
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=k)
  np.testing.assert_allclose(multi['losses'], single['losses'], rtol=1e-5)
  assert multi['losses'][-1] < multi['losses'][0]


def test_linen_data_axis_across_processes(tmp_path):
  scenarios.linen(tmp_path / 'single')
  results = run_processes('linen', tmp_path / 'multi')
  assert [r.returncode for r in results] == [0, 0]
  assert_same_training(tmp_path / 'single', tmp_path / 'multi')
  report, layouts, _ = load(tmp_path / 'multi')
  # The data axis spans the processes: each holds one row of the mesh.
  assert report['mesh_processes'] == [[0] * 4, [1] * 4]
  assert sorted(lay['shard_id'] for lay in layouts) == [0, 1]
  assert all(lay['num_shards'] == 2 and lay['batch_size'] == 8 for lay in layouts)
  assert all(lay['first'] for lay in layouts)
  # Parameters are replicated over 'data': each process holds (and read) them whole.
  assert report['fraction_read_by_shard_tree'] == 1.0


@pytest.mark.slow
def test_linen_model_axis_across_processes(tmp_path):
  scenarios.SCENARIOS['linen-model-across-hosts'](tmp_path / 'single')
  run_processes('linen-model-across-hosts', tmp_path / 'multi')
  assert_same_training(tmp_path / 'single', tmp_path / 'multi')
  report, layouts, _ = load(tmp_path / 'multi')
  assert report['mesh_processes'] == [[0, 0, 1, 1], [0, 0, 1, 1]]
  # Both processes hold every batch row: one shard, read by both.
  assert [lay['shard_id'] for lay in layouts] == [0, 0]
  assert all(lay['num_shards'] == 1 and lay['batch_size'] == 16 for lay in layouts)
  assert [lay['first'] for lay in layouts] == [True, False]
  # Parameters are split over 'model' across the processes: loading them with
  # shard_tree, each process read only its part of the host values.
  assert report['fraction_read_by_shard_tree'] < 0.75


@pytest.mark.slow
def test_nnx_eager_model_across_processes(tmp_path):
  scenarios.nnx_eager(tmp_path / 'single')
  run_processes('nnx', tmp_path / 'multi')
  assert_same_training(tmp_path / 'single', tmp_path / 'multi')


@pytest.mark.slow
def test_processes_that_disagree_on_the_batch_all_get_a_named_error(tmp_path):
  # Process 0 passes 8 rows, process 1 passes 6: without a check each would
  # build a "global" array of its own shape, (16, 32) and (12, 32).
  run_processes('disagreeing-batch', tmp_path)
  messages = [(tmp_path / f'error-{i}.txt').read_text() for i in range(2)]
  for i, message in enumerate(messages):
    assert f'seen from process {i} of 2' in message
    assert (
      'x: process 0 passed shape (8, 32) (a global (16, 32)); '
      'process 1 passed shape (6, 32) (a global (12, 32))'
    ) in message
    assert 'y: process 0 passed shape (8,) (a global (16,))' in message
    assert 'fsm.data_layout(mesh, global_batch_size)' in message
  # 7 rows cannot be split over process 1's devices: it says why, process 0
  # (whose 8 rows were fine) is told so instead of waiting forever.
  first, second = [(tmp_path / f'split-error-{i}.txt').read_text() for i in range(2)]
  assert first.startswith('BatchLayoutError: process(es) [1] could not split')
  assert second.startswith('ShardingError: 1 leaf cannot be sharded')
  assert 'dimension 0: this process passed 7, and its devices hold 2 of the 4' in second


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


def _port_is_free(address):
  host, port = address.split(':')
  with socket.socket() as s:
    s.bind((host, int(port)))
  return True


FAILING = """
from flax_shardmeta._hosts import launch as _launch
pid, n = _launch.initialize()
import time
if pid == 1:
  raise RuntimeError('process 1 fails on purpose')
time.sleep(600)  # would hang in a collective forever
"""


def test_a_failing_process_fails_the_launch_fast_and_leaves_nothing(tmp_path):
  start = time.monotonic()
  with pytest.raises(_launch.LaunchError, match='process 1 exited with code 1') as info:
    _launch.launch(
      ['-c', FAILING],
      num_processes=2,
      devices_per_process=1,
      timeout=120,
      env={**os.environ, 'PYTHONPATH': str(ROOT)},
    )
  assert time.monotonic() - start < 60
  # The failing process's stderr is in the message.
  assert 'process 1 fails on purpose' in str(info.value)
  codes = [code for code, _, _ in info.value.results]
  assert codes[1] == 1 and codes[0] != 0  # process 0 was killed


def test_the_deadline_kills_every_process_and_frees_the_port():
  sleeper = 'import time; time.sleep(600)'
  with pytest.raises(_launch.LaunchError, match=r'still running after 2 s') as info:
    _launch.launch(['-c', sleeper], num_processes=2, devices_per_process=1, timeout=2)
  assert len(info.value.results) == 2


def test_results_name_processes_that_are_gone_and_a_free_port():
  ok = 'print("hello")'
  results = _launch.launch(
    ['-c', ok], num_processes=2, devices_per_process=1, timeout=60
  )
  assert [r.stdout.strip() for r in results] == ['hello', 'hello']
  assert not any(_alive(r.pid) for r in results)
  assert _port_is_free(results[0].coordinator)
