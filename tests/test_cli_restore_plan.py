"""``flax-shardmeta restore-plan``: a checkpoint of the built-in mlp's train
state, saved on ``data=8``, planned onto ``data=2 x model=4``."""

import json

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest

import flax_shardmeta as fsm
from flax_shardmeta import cli
from flax_shardmeta.examples import state as example_state


@pytest.fixture(scope='module')
def ckpt(tmp_path_factory):
  """The mlp's adam train state as zeros, its kernels sharded over data=8."""
  # Auto axes, as the built-in models are written for.
  mesh = jax.make_mesh((8,), ('data',), axis_types=(jax.sharding.AxisType.Auto,))
  state = example_state.abstract_state('mlp', 'linen', 'adam')
  saved = fsm.as_abstract(state, mesh, [('hidden', 'data')])
  arrays = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), saved)
  path = tmp_path_factory.mktemp('ckpt') / 'state'
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, arrays)
  checkpointer.wait_until_finished()
  return str(path)


def run(capsys, *argv):
  code = cli.main(['restore-plan', *argv])
  out, err = capsys.readouterr()
  return code, out, err


def args(ckpt, *more):
  return [ckpt, '--model', 'mlp', '--mesh', 'data=2,model=4', *more]


def test_table_totals(capsys, ckpt):
  code, out, err = run(capsys, *args(ckpt, '--devices-per-host', '4'))
  assert code == 0, err
  assert 'Restore plan: 7 arrays onto data=2 x model=4, 2 hosts' in out
  # Six 4x1024x1024 float32 leaves of 16 MiB each (and the step count): the
  # target shards them over model only, so each host, a data row of 4
  # devices, holds all of them: 2 x 96 MiB. The saved zeros are compressed
  # on disk, so the reads fetch far less.
  assert ', needed 192.00 MiB, over-read' in out
  assert 'total: read 192.00 MiB' not in out
  assert 'problems: none' in out
  # A row per module by default; --verbose, a row per array.
  assert 'module ' in out and 'params/ScanDotReluDot_0/' in out
  code, verbose, _ = run(capsys, *args(ckpt, '--devices-per-host', '4', '--verbose'))
  assert code == 0 and 'params/ScanDotReluDot_0/W2 *' in verbose
  assert 'opt_state/0/count *' not in verbose  # P() before and after


def test_json_and_budget_that_holds(capsys, ckpt):
  code, out, _ = run(capsys, *args(ckpt, '--host-budget', '40MiB', '--format', 'json'))
  data = json.loads(out)
  assert code == 0
  assert data['fits_budget'] is True and data['num_hosts'] == 1
  # A read stages its 4 MiB shard, one decoded 2 MiB chunk (4x128x1024 of
  # the saved layout) and the few stored bytes of the compressed zeros.
  assert 6 * 2**20 < data['min_budget_bytes'] < 6 * 2**20 + 2**12
  saved = {e['path']: e['saved_spec'] for e in data['entries']}
  assert saved['params/ScanDotReluDot_0/W2'] == [None, 'data', None]


def test_budget_too_small_exits_1_with_the_smallest(capsys, ckpt):
  code, out, err = run(capsys, *args(ckpt, '--host-budget', '1MiB'))
  assert code == 1
  assert 'cannot be met' in out
  assert 'the smallest budget is 6.00 MiB' in err


def test_bad_budget_exits_2_in_one_line(capsys, ckpt):
  code, out, err = run(capsys, *args(ckpt, '--host-budget', 'abc'))
  assert code == 2 and out == ''
  assert err.startswith('flax-shardmeta: error: --host-budget') and err.count('\n') == 1


def test_not_a_checkpoint_exits_2(capsys, tmp_path):
  code, _, err = run(capsys, *args(str(tmp_path)))
  assert code == 2 and str(tmp_path) in err


def test_checkpoint_manager_root_and_step(capsys, ckpt, tmp_path):
  # A CheckpointManager's layout: <root>/<step>/<item>/.
  (tmp_path / '5').mkdir()
  (tmp_path / '5' / 'default').symlink_to(ckpt)
  for argv in ([str(tmp_path)], [str(tmp_path), '--step', '5'], [str(tmp_path / '5')]):
    code, out, err = run(capsys, *args(argv[0], *argv[1:]))
    assert code == 0, err
    assert 'Restore plan: 7 arrays' in out
  code, _, err = run(capsys, *args(str(tmp_path), '--step', '7'))
  assert code == 2 and 'no step 7: its steps are [5]' in err
