"""``flax-shardmeta fit``: exit codes, formats, estimates and your own step."""

import json
import textwrap

import pytest

from flax_shardmeta import cli, cli_fit
from flax_shardmeta._planning import topology
from flax_shardmeta.examples import _common, train

needs_libtpu = pytest.mark.skipif(
  not topology.libtpu_available(),
  reason="libtpu is not installed (pip install 'flax_shardmeta[tpu]'; CI has it)",
)
POD = ['fit', '--model', 'mlp', '--topology', 'v5p:2x2x1', '--mesh', 'data=2,model=2']


def run(capsys, *argv):
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


def test_choices_match_the_examples():
  assert cli_fit._REMAT == _common.REMAT_POLICIES
  assert cli_fit._OPTIMIZERS == train.OPTIMIZERS


@needs_libtpu
def test_fits_exits_0_with_the_table(capsys):
  code, out, err = run(capsys, *POD, '--batch', '64')
  assert code == 0, err
  assert out.startswith('Will it fit: compiled for TPU v5, 4 devices in 1 host')
  assert 'verdict: FITS' in out and 'collectives per step' in out


@needs_libtpu
def test_does_not_fit_exits_1_and_json(capsys):
  code, out, _ = run(capsys, *POD, '--batch', '64', '--hbm', '1MiB', '--format', 'json')
  assert code == 1
  report = json.loads(out)
  assert report['fits'] is False and report['hbm_bytes'] == 2**20
  assert sum(r['bytes'] for r in report['rows']) == report['total_bytes']


def test_without_a_topology_it_is_an_estimate(capsys):
  argv = ['fit', '--model', 'llama3-8b', '--mesh', 'data=32,model=4', '--batch', '32']
  code, out, err = run(capsys, *argv, '--chip', 'v5p', '--remat', 'full')
  assert code == 0, err
  assert out.startswith('Will it fit: estimate for an abstract mesh of 128 devices')
  code, out, _ = run(capsys, *argv, '--hbm', '1GiB')
  assert code == 1 and 'DOES NOT FIT' in out


@pytest.mark.parametrize(
  'argv, message',
  [
    (['--mesh', 'data=2,model=4', '--hbm', 'lots'], "--hbm: 'lots' is not a size"),
    (['--mesh', 'data=2,model=4', '--batch', '0'], '--batch 0: must be at least 1'),
    (['--mesh', 'data=2,model=4', '--remat', 'sometimes'], "--remat 'sometimes'"),
    (['--mesh', 'data=2,model=4', '--chip', 'v99'], "chip='v99' is not one fit knows"),
    (['--mesh', 'data=two'], "size of 'data' is 'two'"),
  ],
)
def test_bad_arguments_exit_2_with_one_line(capsys, argv, message):
  code, out, err = run(capsys, 'fit', '--model', 'mlp', *argv)
  assert code == 2 and out == ''
  assert message in err and len(err.strip().splitlines()) == 1


@needs_libtpu
def test_bad_topologies_exit_2(capsys):
  code, _, err = run(capsys, *POD[:3], '--topology', 'v5p-8', '--mesh', 'data=4')
  assert code == 2 and "unknown TPU topology 'v5p-8'" in err
  code, _, err = run(capsys, *POD[:3], '--topology', 'v5p:2x2x1', '--mesh', 'data=8')
  assert code == 2 and 'does not fit 4 devices' in err


def test_your_own_step_from_a_module(capsys, tmp_path, monkeypatch):
  (tmp_path / 'my_step.py').write_text(
    textwrap.dedent(
      """
      import jax, jax.numpy as jnp, flax_shardmeta as fsm

      def make(batch=8):
        params = {'w': fsm.LogicalPartitioned(
          jax.ShapeDtypeStruct((256, 512), jnp.float32), ('embed', 'mlp'))}
        x = fsm.LogicalPartitioned(
          jax.ShapeDtypeStruct((batch, 256), jnp.float32), ('batch', 'embed'))

        def step(params, x):
          return jnp.tanh(x @ fsm.unbox(params)['w']).sum()

        return step, params, x
      """
    )
  )
  (tmp_path / 'rules.json').write_text('[["batch", "data"], ["mlp", "model"]]')
  monkeypatch.chdir(tmp_path)
  argv = ['fit', '--module', 'my_step:make', '--mesh', 'data=2,model=4']
  code, out, err = run(
    capsys, *argv, '--rules', 'rules.json', '--batch', '16', '--chip', 'v5p'
  )
  assert code == 0, err
  assert out.startswith('Will it fit: estimate for an abstract mesh of 8 devices')
  # w over 'model' (256 x 512 / 4 floats), x over 'data' (16 x 256 / 2 floats).
  assert '128.00 KiB' in out and '8.00 KiB' in out
  code, _, err = run(capsys, *argv, '--extrapolate')
  assert code == 2 and 'takes no num_layers keyword argument' in err
