"""``flax-shardmeta fit``: exit codes, formats, estimates and your own step."""

import json
import sys
import textwrap

import pytest

from flax_shardmeta import cli
from flax_shardmeta.cli import options as cli_options
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
  assert cli_options.REMAT == linen.REMAT_POLICIES
  assert cli_options.OPTIMIZERS == train.OPTIMIZERS


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
  code, out, _ = run(capsys, *argv, '--format', 'json', '--chip', 'v5p')
  total = json.loads(out)['total_bytes']
  # A limit inside the estimate's measured error: no verdict, its own exit code.
  code, out, _ = run(capsys, *argv, '--chip', 'v5p', '--hbm', str(int(total * 1.05)))
  assert code == 3 and 'verdict: TOO CLOSE TO CALL without compiling' in out


@pytest.mark.parametrize(
  'argv, message',
  [
    (['--mesh', 'data=2,model=4', '--hbm', 'lots'], "--hbm: 'lots' is not a size"),
    (
      ['--mesh', 'data=2,model=4', '--host-memory', 'lots'],
      "--host-memory: 'lots' is not a size",
    ),
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
  code, _, err = run(capsys, *POD[:3], '--topology', 'v5p8', '--mesh', 'data=4')
  assert code == 2 and "unknown topology 'v5p8'" in err
  code, _, err = run(capsys, *POD[:3], '--topology', 'v5p:2x2x1', '--mesh', 'data=8')
  assert code == 2 and 'does not fit 4 devices' in err


MY_STEP = textwrap.dedent(
  """
  import jax, jax.numpy as jnp, flax_shardmeta as fsm
  from flax import linen as nn

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

  def eager_key():
    x = jax.ShapeDtypeStruct((8, 256), jnp.float32)
    step = lambda k, x: (x * jax.random.normal(k, x.shape)).sum()
    return step, jax.random.key(0), x

  def bad_layout():
    # fsm.jit lays its in_shardings out when made: 6 rows over 'model'=4.
    params = {'w': fsm.LogicalPartitioned(
      jax.ShapeDtypeStruct((6, 512), jnp.float32), ('mlp', 'embed'))}
    step = fsm.jit(lambda p: fsm.unbox(p)['w'].sum(),
                   mesh=jax.sharding.get_abstract_mesh(), in_shardings=(params,))
    return step, params

  class Constrained(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = fsm.with_logical_constraint(x, ('batch', 'embed'))
      return nn.Dense(512, kernel_init=fsm.with_logical_partitioning(
        nn.initializers.lecun_normal(), ('embed', 'mlp')))(x)

  def _constrained_step(params, x):
    return Constrained().apply({'params': params}, x).sum()

  def dummy_batch_of_one(batch=8):
    # init's dummy batch of 1 meets the constraint's 'batch' -> 'data'=2.
    v = jax.eval_shape(
      lambda: Constrained().init(jax.random.key(0), jnp.zeros((1, 256))))
    x = jax.ShapeDtypeStruct((batch, 256), jnp.float32)
    return _constrained_step, v['params'], x

  def eager_init(batch=8):
    v = Constrained().init(jax.random.key(0), jnp.zeros((8, 256)))
    x = jax.ShapeDtypeStruct((batch, 256), jnp.float32)
    return _constrained_step, v['params'], x
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


def eager_error(target, far, code):
  """The error naming the line of my_step.py whose ``code`` ran eagerly."""
  line = MY_STEP.splitlines().index(code) + 1
  return (
    f'flax-shardmeta: error: --module {target} computes an array eagerly at '
    f'my_step.py:{line} (`{code.strip()}`) under a {far} mesh, of devices this '
    'machine does not have, where no concrete array can live; build it '
    'abstractly: jax.eval_shape(lambda: jax.random.key(0)) for a PRNG key, '
    'jax.ShapeDtypeStruct(shape, dtype) for an input, jax.eval_shape(...) for '
    'parameters (--traceback shows where)\n'
  )


@pytest.mark.libtpu
def test_an_eager_array_on_a_topology_says_to_build_abstractly(capsys, my_step):
  argv = ['fit', '--module', 'my_step:eager', '--topology', 'v5p:2x2x1']
  assert error_line(capsys, *argv, '--mesh', 'data=2,model=2') == eager_error(
    'my_step:eager',
    'TPU pod',
    '  w = jax.random.normal(jax.random.key(0), (256, 512))',
  )


@pytest.mark.cuda
def test_an_eager_key_on_a_gpu_cluster_names_the_gpus(capsys, my_step):
  # A concrete PRNG key under a mesh of 8 H100s (Auto axes) from the CUDA plugin.
  argv = ['fit', '--module', 'my_step:eager_key', '--topology', 'h100:1x8']
  assert error_line(capsys, *argv, '--mesh', 'data=2,model=4') == eager_error(
    'my_step:eager_key', 'GPU cluster', '  return step, jax.random.key(0), x'
  )


def test_a_layout_error_in_the_factory_shows_its_first_problem(capsys, my_step):
  # Abstract mesh, Auto axes: fsm.jit's in_shardings fail inside the factory.
  argv = ['fit', '--module', 'my_step:bad_layout', '--mesh', 'data=2,model=4']
  assert error_line(capsys, *argv, '--rules', 'rules.json') == (
    'flax-shardmeta: error: --module my_step:bad_layout: ShardingError: 1 leaf '
    "cannot be sharded as annotated: w: shape (6, 512), names ('mlp', 'embed'), "
    "spec P('model', None): dimension 0 of size 6 is not divisible by 'model'=4. "
    'Fix: make the size a multiple of 4, shard it over other mesh axes, or '
    'replicate this dimension with replicate_indivisible=True (fsm.get_sharding, '
    'fsm.plan, fsm.shard_value, fsm.with_logical_constraint) (--traceback shows '
    'where)\n'
  )


def constraint_error(factory):
  """The start of the error naming the Constrained model's constraint."""
  line = MY_STEP.splitlines().index(
    "    x = fsm.with_logical_constraint(x, ('batch', 'embed'))"
  )
  return (
    f"flax-shardmeta: error: --module my_step:{factory}: the model's activation "
    "constraint fsm.with_logical_constraint(..., ('batch', 'embed')) at "
    f'my_step.py:{line + 1} '
  )


def test_init_on_a_dummy_batch_the_mesh_cannot_split_is_explained(capsys, my_step):
  # Abstract mesh, Auto axes; the rules send 'batch' to 'data'=2.
  argv = ['fit', '--module', 'my_step:dummy_batch_of_one', '--mesh', 'data=2,model=4']
  assert error_line(capsys, *argv, '--rules', 'rules.json') == (
    constraint_error('dummy_batch_of_one')
    + 'cannot lay out the value the factory gives it, on the abstract mesh data=2 '
    'x model=4 (no --topology: it has no devices): shape (1, 256), spec '
    "P('data', None): dimension 0 of size 1 is not divisible by 'data'=2. The "
    'factory evaluates the model on an input the mesh cannot split (a dummy batch '
    'for init?): initialise under jax.eval_shape with inputs of the real shapes '
    '(jax.ShapeDtypeStruct), or with a batch that is a multiple of 2 '
    '(--traceback shows where)\n'
  )


def test_init_applying_a_constraint_eagerly_is_explained(capsys, my_step):
  # Abstract mesh, Auto axes: a concrete array cannot be laid out on it.
  argv = ['fit', '--module', 'my_step:eager_init', '--mesh', 'data=2,model=4']
  assert error_line(capsys, *argv, '--rules', 'rules.json') == (
    constraint_error('eager_init')
    + 'was applied eagerly, to a concrete array outside jit, while the factory '
    'ran; nothing can be laid out on the abstract mesh data=2 x model=4 (no '
    '--topology: it has no devices). Initialise the model abstractly, e.g. '
    'jax.eval_shape(lambda: model.init(jax.random.key(0), x)), or give the '
    'factory abstract inputs (jax.ShapeDtypeStruct) (--traceback shows where)\n'
  )


@pytest.mark.cuda
def test_a_dummy_batch_under_a_gpu_cluster_mesh_is_explained(capsys, my_step):
  # Over 8 H100s (Auto axes): the constraint is traced inside jax.eval_shape.
  argv = ['fit', '--module', 'my_step:dummy_batch_of_one', '--topology', 'h100:1x8']
  err = error_line(capsys, *argv, '--mesh', 'data=2,model=4', '--rules', 'rules.json')
  assert err.startswith(
    constraint_error('dummy_batch_of_one')
    + 'cannot lay out the value the factory gives it, on the GPU cluster mesh '
    'data=2 x model=4 (devices this machine does not have): shape (1, 256)'
  )


def test_the_default_rules_are_said_with_the_output(capsys, my_step):
  argv = ['fit', '--module', 'my_step:make', '--mesh', 'data=2,model=4']
  code, out, err = run(capsys, *argv)
  assert code == 0 and out.startswith('Will it fit:'), err
  assert err == (
    'flax-shardmeta: rules: T5X defaults (pass --rules t5x-2d, inline JSON or a '
    'JSON / TOML file to choose)\n'
  )
  for chosen in (['--rules', 'rules.json'], ['--rules', 't5x']):
    code, _, err = run(capsys, *argv, *chosen)
    assert (code, err) == (0, '')
  code, _, err = run(capsys, 'fit', '--model', 'mlp', '--mesh', 'data=2,model=4')
  assert (code, err) == (0, '')  # a built-in model's own rules


@pytest.mark.parametrize('command', ['fit', 'suggest', 'snapshot'])
@pytest.mark.parametrize(
  'flags, message',
  [
    (
      ['--mem-fraction', '1.5'],
      'argument --mem-fraction: expected a fraction greater than 0 and at most 1, '
      "e.g. 0.9, got '1.5'",
    ),
    (['--mem-fraction', '0'], "got '0'"),
    (['--mem-fraction', 'most'], "got 'most'"),
    (['--reserve', 'lots'], "--reserve: 'lots' is not a size"),
  ],
)
def test_gpu_run_options_are_checked(capsys, command, flags, message):
  pod = ['--topology', 'h100:1x8'] if command == 'suggest' else ['--chip', 'h100']
  mesh = [] if command == 'suggest' else ['--mesh', 'data=2,model=4']
  if command == 'snapshot':
    pod = []  # snapshot judges no memory: a well-formed --reserve is refused too
    if flags[0] == '--reserve':
      message = '--reserve: snapshot records the step'
  err = error_line(
    capsys, command, '--model', 'mlp', '--batch', '8', *pod, *mesh, *flags
  )
  assert err.count('\n') == 1 and message in err


class Called(Exception):
  """Raised by a stand-in for fsm.fit / fsm.suggest, with its keywords."""


@pytest.mark.parametrize('command, function', [('fit', 'fit'), ('suggest', 'suggest')])
def test_gpu_run_options_are_passed_only_when_given(
  monkeypatch, capsys, command, function
):
  import flax_shardmeta as fsm

  def stand_in(*args, **kwargs):
    raise Called(kwargs)

  monkeypatch.setattr(fsm, function, stand_in)
  pod = ['--topology', 'h100:1x8'] if command == 'suggest' else ['--chip', 'h100']
  mesh = [] if command == 'suggest' else ['--mesh', 'data=2,model=4']
  argv = [command, '--model', 'mlp', '--batch', '8', *pod, *mesh]
  with pytest.raises(Called) as given:
    cli.main([*argv, '--mem-fraction', '0.9', '--reserve', '2GiB'])
  assert (given.value.args[0]['mem_fraction'], given.value.args[0]['reserve']) == (
    0.9,
    '2GiB',
  )
  with pytest.raises(Called) as default:
    cli.main(argv)
  assert not {'mem_fraction', 'reserve'} & set(default.value.args[0])
