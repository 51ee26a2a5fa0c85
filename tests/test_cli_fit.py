"""``flax-shardmeta fit``: exit codes, formats, estimates and your own step."""

import json
import sys
import textwrap

import pytest

from flax_shardmeta import cli
from flax_shardmeta.cli import common as cli_common
from flax_shardmeta.examples import linen, train

POD = ['fit', '--model', 'mlp', '--topology', 'v5p:2x2x1', '--mesh', 'data=2,model=2']


def run(capsys, *argv):
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


def error_line(capsys, *argv):
  """The stderr of a command that must fail with exit code 2, printing nothing."""
  code, out, err = run(capsys, *argv)
  assert (code, out) == (2, ''), err
  return err


def test_choices_match_the_examples():
  assert cli_common.REMAT == linen.REMAT_POLICIES
  assert cli_common.OPTIMIZERS == train.OPTIMIZERS


@pytest.mark.libtpu
def test_fits_exits_0_with_the_table(capsys):
  code, out, err = run(capsys, *POD, '--batch', '64')
  assert code == 0, err
  assert out.startswith('Will it fit: compiled for TPU v5, 4 devices in 1 host')
  assert 'verdict: FITS' in out and 'collectives per step' in out


@pytest.mark.libtpu
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
    (
      ['--mesh', 'data=2,modle=4'],
      "--mesh 'data=2,modle=4': no rule uses mesh axis 'modle', and the rules shard "
      "over 'model', which the mesh lacks: did you mean 'model'?",
    ),
  ],
)
def test_bad_arguments_exit_2_with_one_line(capsys, argv, message):
  code, out, err = run(capsys, 'fit', '--model', 'mlp', *argv)
  assert code == 2 and out == ''
  assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.libtpu
def test_bad_topologies_exit_2(capsys):
  code, _, err = run(capsys, *POD[:3], '--topology', 'v5p-8', '--mesh', 'data=4')
  assert code == 2 and "unknown topology 'v5p-8'" in err
  code, _, err = run(capsys, *POD[:3], '--topology', 'v5p:2x2x1', '--mesh', 'data=8')
  assert code == 2 and 'does not fit 4 devices' in err


MY_STEP = textwrap.dedent(
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

  def eager():
    w = jax.random.normal(jax.random.key(0), (256, 512))
    return (lambda w, x: (x @ w).sum()), w, jax.ShapeDtypeStruct((8, 256), jnp.float32)

  def step_bug():
    return (lambda x: {}['loss']), jax.ShapeDtypeStruct((8, 256), jnp.float32)
  """
)


@pytest.fixture
def my_step(tmp_path, monkeypatch):
  """``my_step.py`` and ``rules.json`` in the current directory."""
  (tmp_path / 'my_step.py').write_text(MY_STEP)
  (tmp_path / 'rules.json').write_text('[["batch", "data"], ["mlp", "model"]]')
  monkeypatch.chdir(tmp_path)
  monkeypatch.delitem(sys.modules, 'my_step', raising=False)


def test_your_own_step_from_a_module(capsys, my_step):
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


def test_an_option_the_factory_does_not_take_is_an_error(capsys, my_step):
  argv = ['fit', '--module', 'my_step:make', '--mesh', 'data=2,model=4']
  assert error_line(capsys, *argv, '--seq', '128') == (
    'flax-shardmeta: error: --seq 128: my_step:make(batch=8) takes no seq keyword '
    'argument; add the parameter (or **kwargs), or leave --seq out\n'
  )


def test_a_failing_step_exits_2_naming_the_factory(capsys, my_step):
  argv = ['fit', '--module', 'my_step:step_bug', '--mesh', 'data=2,model=4']
  assert error_line(capsys, *argv) == (
    "flax-shardmeta: error: --module my_step:step_bug: KeyError: 'loss' "
    '(--traceback shows where)\n'
  )
  # A layout that cannot be is no verdict either: exit 2, not 1 (does not fit).
  err = error_line(capsys, 'fit', '--model', 'mlp', '--mesh', 'data=3,model=5')
  assert err.startswith('flax-shardmeta: error: 2 leaves cannot be sharded as')


@pytest.mark.libtpu
def test_an_eager_array_on_a_topology_says_to_build_abstractly(capsys, my_step):
  argv = ['fit', '--module', 'my_step:eager', '--topology', 'v5p:2x2x1']
  assert error_line(capsys, *argv, '--mesh', 'data=2,model=2') == (
    'flax-shardmeta: error: --module my_step:eager computes an array eagerly under '
    'a TPU topology mesh; build the arguments abstractly: jax.eval_shape(...) / '
    "jax.ShapeDtypeStruct; a concrete array cannot live on the TPU topology's "
    'devices (--traceback shows where)\n'
  )
