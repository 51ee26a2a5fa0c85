"""The command line holds on inputs its first tests did not try: a user's
factory as written for Python, the GPU allocator's fraction and reserve in
every form, bad input of every command (exit 2, one line), and ``python -m
flax_shardmeta`` against the console script. Meshes have Auto axes (the
commands' own, and ``fsm.make_mesh``'s default) unless a test says otherwise.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_shardmeta as fsm
from flax_shardmeta import cli

RULES = '[["batch", "data"], ["embed", null], ["mlp", "model"]]'

MY_GPT = textwrap.dedent(
  """\
  import jax, jax.numpy as jnp, flax_shardmeta as fsm

  def step(params, x, key):
    noise = jax.random.normal(key, x.shape)
    w = fsm.unbox(params)['w']
    g = jax.grad(lambda w: (((x + noise) @ w) ** 2).sum())(w)
    return {'w': w - 0.1 * g}, (x @ w).sum()

  def _inputs():
    params = {'w': fsm.LogicalPartitioned(
      jax.ShapeDtypeStruct((512, 512), jnp.float32), ('embed', 'mlp'))}
    x = fsm.LogicalPartitioned(
      jax.ShapeDtypeStruct((64, 512), jnp.float32), ('batch', None))
    return params, x

  def make():
    params, x = _inputs()
    return step, params, x, jax.random.key(0)

  def make_abstract():
    params, x = _inputs()
    return step, params, x, jax.eval_shape(lambda: jax.random.key(0))

  def make_fsm_jit():
    params, x = _inputs()
    key = jax.eval_shape(lambda: jax.random.key(0))
    # Laid out by its own in_shardings: the annotated trees, resolved now.
    jitted = fsm.jit(step, mesh=None, in_shardings=(params, x, None))
    return jitted, params, x, key

  def make_donated():
    params, x = _inputs()
    key = jax.eval_shape(lambda: jax.random.key(0))
    return jax.jit(step, donate_argnums=(0,)), params, x, key

  def raises():
    raise RuntimeError('no data here')

  def returns_none():
    return None

  def text_argument():
    return step, 'params', 'x', 'key'
  """
)


def run(capsys, *argv):
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


def error_line(capsys, *argv):
  """The one line of a command that must fail with exit code 2."""
  code, out, err = run(capsys, *argv)
  assert (code, out) == (2, ''), err
  assert err.startswith('flax-shardmeta: error: ') and err.count('\n') == 1, err
  return err


@pytest.fixture
def my_gpt(tmp_path, monkeypatch):
  """``mygpt.py`` in the current directory, as a user's project has it."""
  (tmp_path / 'mygpt.py').write_text(MY_GPT)
  monkeypatch.chdir(tmp_path)
  monkeypatch.delitem(sys.modules, 'mygpt', raising=False)
  for name in ('XLA_CLIENT_MEM_FRACTION', 'XLA_PYTHON_CLIENT_MEM_FRACTION'):
    monkeypatch.delenv(name, raising=False)


def gpu_fit(*argv):
  return ['fit', '--mesh', 'data=4,model=2', '--rules', RULES, *argv]


# The factory
# ------------------------------------------------------------------------------


@pytest.mark.cuda
def test_an_eager_key_names_its_line_and_the_fix_given_works(capsys, my_gpt):
  # Over 8 compile-only H100s: jax cannot run jax.random.key(0) on them.
  err = error_line(capsys, *gpu_fit('--module', 'mygpt:make', '--topology', 'h100:1x8'))
  line = MY_GPT.splitlines().index('  return step, params, x, jax.random.key(0)')
  assert f'at mygpt.py:{line + 1} (`return step, params, x, jax.random.key(0)`)' in err
  assert 'jax.eval_shape(lambda: jax.random.key(0)) for a PRNG key' in err
  # The fix the message gives, applied: the same step compiles.
  code, out, err = run(
    capsys, *gpu_fit('--module', 'mygpt:make_abstract', '--topology', 'h100:1x8')
  )
  assert code == 0, err
  assert out.startswith('Will it fit: compiled for NVIDIA H100 80GB HBM3, 8 devices')


@pytest.mark.cuda
def test_fsm_jit_without_a_mesh_in_the_factory_takes_the_commands_mesh(capsys, my_gpt):
  code, out, err = run(
    capsys, *gpu_fit('--module', 'mygpt:make_fsm_jit', '--topology', 'h100:1x8')
  )
  assert code == 0, err
  assert out.startswith('Will it fit: compiled for NVIDIA H100 80GB HBM3, 8 devices')
  assert 'NoMeshError' not in err


def test_fsm_jit_without_a_mesh_takes_the_context_mesh():
  mesh = jax.make_mesh((8,), ('data',), axis_types=(jax.sharding.AxisType.Auto,))
  with jax.set_mesh(mesh):
    doubled = fsm.jit(
      lambda x: x * 2, mesh=None, out_shardings=jax.sharding.PartitionSpec('data')
    )
  assert doubled.mesh is mesh
  assert doubled(jnp.ones(8)).sharding.mesh == mesh
  with pytest.raises(fsm.NoMeshError, match='pass mesh=... or call fsm.jit inside'):
    fsm.jit(lambda x: x, mesh=None)


@pytest.mark.cuda
def test_a_step_that_donates_nothing_is_told_what_to_donate(capsys, my_gpt):
  def report(factory):
    code, out, err = run(
      capsys,
      *gpu_fit('--module', f'mygpt:{factory}', '--topology', 'h100:1x8'),
      '--format',
      'json',
      '--no-cache',
    )
    assert code == 0, err
    return json.loads(out)

  def not_donated(d):
    return next(r['bytes'] for r in d['rows'] if r['name'] == 'outputs not donated')

  plain, donated = report('make_abstract'), report('make_donated')
  (note,) = [n for n in plain['notes'] if 'donate_argnums' in n]
  assert 'returns argument 0 (params) again' in note
  assert 'jax.jit(step, donate_argnums=(0,))' in note
  # The bytes the note promises are what donating params takes off the row:
  # w is 512 x 512 floats over 'model'=2.
  assert 'would save up to 512.00 KiB per chip' in note
  assert not_donated(plain) - not_donated(donated) == 512 * 512 * 4 // 2
  assert not [n for n in donated['notes'] if 'donate_argnums' in n]


def test_no_text_says_to_install_extras_from_an_index():
  # The package is not on an index: only `pip install '.[tpu]'` from a
  # checkout can work.
  root = Path(__file__).resolve().parents[1]
  said = []
  for folder in ('flax_shardmeta', 'docs', 'notebooks', 'tests', 'examples'):
    for path in (root / folder).rglob('*'):
      if path.suffix in ('.py', '.md', '.ipynb', '.toml') and path != Path(__file__):
        if 'flax_shardmeta[' in path.read_text(errors='replace'):
          said.append(str(path.relative_to(root)))
  for path in root.glob('*.md'):
    if 'flax_shardmeta[' in path.read_text():
      said.append(path.name)
  assert said == []


def test_a_missing_plugin_says_to_install_from_a_checkout(monkeypatch):
  from flax_shardmeta._devices import gpu

  monkeypatch.setattr(gpu, 'cuda_plugin_available', lambda: False)
  with pytest.raises(
    fsm.TopologyError, match=r"from a checkout: pip install '\.\[gpu\]'"
  ):
    gpu.gpu_devices('h100:1x8')


# The GPU allocator's fraction and reserve
# ------------------------------------------------------------------------------


@pytest.mark.parametrize(
  'env, said',
  [
    (
      {'XLA_CLIENT_MEM_FRACTION': '0.8', 'XLA_PYTHON_CLIENT_MEM_FRACTION': '0.9'},
      "both XLA_CLIENT_MEM_FRACTION='0.8' and XLA_PYTHON_CLIENT_MEM_FRACTION='0.9' "
      'are set: jaxlib takes neither and refuses to start its GPU plugin. Unset '
      'XLA_PYTHON_CLIENT_MEM_FRACTION (deprecated) and keep XLA_CLIENT_MEM_FRACTION.',
    ),
    (
      {'XLA_PYTHON_CLIENT_MEM_FRACTION': 'abc'},
      "XLA_PYTHON_CLIENT_MEM_FRACTION='abc': the allocator fraction must be a number "
      'greater than 0 and at most 1, e.g. 0.9.',
    ),
    (
      {'XLA_CLIENT_MEM_FRACTION': '1.5'},
      "XLA_CLIENT_MEM_FRACTION='1.5': the allocator fraction must be a number "
      'greater than 0 and at most 1, e.g. 0.9.',
    ),
  ],
)
def test_bad_fraction_variables_are_named_before_the_plugin_starts(
  capsys, monkeypatch, env, said
):
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  err = error_line(capsys, 'fit', '--model', 'mlp', '--mesh', 'data=4,model=2',
                   '--topology', 'h100:1x8')  # fmt: skip
  assert (
    err == f'flax-shardmeta: error: {said} '
    '(what to do: flax-shardmeta explain TopologyError)\n'
  )
  assert 'JAX_PLATFORMS' not in err


def _estimate(**kwargs):
  """An estimate of a small step on an abstract mesh of 8 (Auto axes)."""
  mesh = jax.sharding.AbstractMesh(
    (8,), ('data',), axis_types=(jax.sharding.AxisType.Auto,)
  )
  w = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
  with jax.sharding.use_abstract_mesh(mesh):
    return fsm.fit(jax.jit(lambda w: (w * 2).sum()), w, cache=False, **kwargs)


def test_a_reserve_larger_than_the_gpu_is_an_error():
  with pytest.raises(fsm.FitError, match="not less than the GPU's 79.11 GiB"):
    _estimate(chip='h100', reserve='100GiB')


def test_a_reserve_that_takes_a_tiny_card_is_no_share_of_it():
  # The table's reserve (1 GiB of CUDA context) on a card of 1 MiB: nothing
  # fits, and no percentage of zero usable bytes is printed.
  report = _estimate(chip='h100', hbm='1MiB')
  assert report.fits is False
  assert 'over (the reserve leaves no usable memory)' in str(report)
  assert '% of usable memory' not in str(report)


def test_a_small_fraction_is_printed_with_its_digits():
  report = _estimate(chip='h100', mem_fraction=0.001)
  assert 'fraction 0.001 (mem_fraction=)' in str(report)
  assert 'XLA_CLIENT_MEM_FRACTION=0.001 (mem_fraction=)' in str(report)
  assert 'fraction 0.00 ' not in str(report)


@pytest.mark.parametrize('given', [np.float32(0.9), np.float64(0.9), '0.9', 0.9])
def test_a_fraction_of_any_numeric_type_is_taken(given):
  usable = _estimate(chip='h100', mem_fraction=given).usable
  assert usable is not None and usable.fraction == 0.9


@pytest.mark.parametrize('given', [True, float('nan'), '1.5', 0, 'most'])
def test_a_fraction_that_is_no_fraction_is_refused(given):
  with pytest.raises(fsm.FitError, match='greater than 0 and at most 1'):
    _estimate(chip='h100', mem_fraction=given)


@pytest.mark.parametrize('chip', ['v5p', None])
@pytest.mark.parametrize('reserve', ['lots', -1, float('nan'), float('inf'), True])
def test_a_bad_reserve_is_refused_off_gpu_too(chip, reserve):
  with pytest.raises(fsm.FitError, match=r'reserve='):
    _estimate(chip=chip, reserve=reserve)


@pytest.mark.parametrize(
  'argv, said',
  [
    (
      ['--topology', 'v5p:2x2x1', '--mem-fraction', '0.9'],
      "--mem-fraction 0.9: applies to GPU runs only (the memory of jax's GPU "
      'allocator), and --topology v5p:2x2x1 is not a GPU cluster',
    ),
    (
      ['--chip', 'v5p', '--reserve', '2GiB'],
      "--reserve 2GiB: applies to GPU runs only (the memory of jax's GPU "
      'allocator), and --chip v5p is not a GPU',
    ),
    (
      ['--mem-fraction', '0.9'],
      "--mem-fraction 0.9: applies to GPU runs only (the memory of jax's GPU "
      'allocator), and no GPU is named',
    ),
  ],
)
def test_gpu_options_off_gpu_are_refused(capsys, argv, said):
  err = error_line(capsys, 'fit', '--model', 'mlp', '--mesh', 'data=2,model=2', *argv)
  assert err.startswith(f'flax-shardmeta: error: {said}')


def test_the_gpu_options_are_refused_by_snapshot(capsys):
  err = error_line(capsys, 'snapshot', '--model', 'mlp', '--mesh', 'data=2,model=4',
                   '--mem-fraction', '0.9')  # fmt: skip
  assert 'snapshot records the step' in err


# Bad input: exit 2, one line, every command
# ------------------------------------------------------------------------------

MISUSE = [
  ['plan', '--model', 'mlp', '--mesh', 'data'],
  ['plan', '--model', 'mlp', '--mesh', 'data=0'],
  ['plan', '--model', 'mlp', '--mesh', 'data=4,data=2'],
  ['plan', '--model', 'gpt5', '--mesh', 'data=8'],
  ['plan', '--model', 'mlp', '--mesh', 'data=8', '--rules', '[["batch"]]'],
  ['plan', '--module', 'nosuchmodule:make', '--mesh', 'data=8'],
  ['plan', '--module', 'mygpt:raises', '--mesh', 'data=8'],
  ['plan', '--module', 'mygpt:returns_none', '--mesh', 'data=8'],
  ['fit', '--model', 'mlp', '--mesh', 'data=x'],
  ['fit', '--model', 'mlp', '--mesh', 'data=8', '--topology', 'v5p8'],
  ['fit', '--model', 'mlp', '--mesh', 'data=8', '--topology', 'h100:0x8'],
  ['fit', '--model', 'mlp', '--mesh', 'data=8', '--batch', '0'],
  ['fit', '--model', 'mlp', '--mesh', 'data=8', '--seq', '-3'],
  [
    'fit',
    '--model',
    'mlp',
    '--mesh',
    'data=4,model=2',
    '--chip',
    'h100',
    '--reserve',
    '1000GiB',
  ],  # fmt: skip
  ['fit', '--module', 'mygpt', '--mesh', 'data=8'],
  ['fit', '--module', 'mygpt:nothing', '--mesh', 'data=8'],
  ['fit', '--module', 'mygpt:raises', '--mesh', 'data=8'],
  ['fit', '--module', 'mygpt:returns_none', '--mesh', 'data=8'],
  ['fit', '--module', 'mygpt:text_argument', '--mesh', 'data=8'],
  ['suggest', '--model', 'mlp', '--topology', 'h100:1x8', '--batch', '-8'],
  [
    'suggest',
    '--model',
    'mlp',
    '--topology',
    'h100:1x8',
    '--batch',
    '8',
    '--presets',
    'nope',
  ],  # fmt: skip
  [
    'suggest',
    '--module',
    'mygpt:text_argument',
    '--topology',
    'h100:1x8',
    '--batch',
    '8',
  ],  # fmt: skip
  ['snapshot', '--model', 'mlp', '--mesh', 'data=8', '--batch', '0'],
  ['snapshot', '--module', 'mygpt:raises', '--mesh', 'data=8'],
  ['demo', '--processes', '3'],
]


@pytest.mark.parametrize('argv', MISUSE, ids=' '.join)
def test_bad_input_exits_2_with_one_line(capsys, my_gpt, argv):
  err = error_line(capsys, *argv)
  assert 'Traceback' not in err


def test_a_factory_returning_text_names_the_argument(capsys, my_gpt):
  err = error_line(capsys, 'fit', '--module', 'mygpt:text_argument', '--mesh', 'data=8')
  assert err.startswith(
    'flax-shardmeta: error: --module mygpt:text_argument: argument 1 of the step '
    "(params) is str 'params'; the factory returns (step, *abstract_args)"
  )


# python -m flax_shardmeta
# ------------------------------------------------------------------------------


def test_python_m_runs_like_the_console_script(tmp_path):
  # The symptom: 16 simulated devices asked for by the mesh, 8 given by
  # `python -m`. Auto axes are audited under Explicit ones (the command's job).
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  argv = ['audit', '--model', 'mlp', '--mesh', 'data=4,model=4', '--format', 'json']
  done = subprocess.run(
    [sys.executable, '-m', 'flax_shardmeta', *argv],
    capture_output=True,
    text=True,
    env=env,
    cwd=tmp_path,
    timeout=300,
  )
  assert done.returncode in (0, 1), done.stderr
  assert '"mesh"' in done.stdout and '16 devices' not in done.stderr


# Bad flag values are named as the command line spells them
# ------------------------------------------------------------------------------


def test_rules_that_are_neither_json_nor_a_file_are_called_not_valid(capsys):
  # Was: "cannot read rules file '{'", as if a file had been meant.
  err = error_line(capsys, 'plan', '--model', 'mlp', '--mesh', 'data=2,model=4',
                   '--rules', '{')  # fmt: skip
  assert "--rules '{' is not valid: as JSON text: Expecting property name" in err
  assert 'as a file path: No such file' in err


def test_a_negative_reserve_is_told_to_be_0_or_more(capsys):
  # Was: "'-1GiB' is not a size".
  err = error_line(capsys, 'fit', '--model', 'mlp', '--mesh', 'data=2,model=4',
                   '--reserve=-1GiB')  # fmt: skip
  assert "--reserve: '-1GiB' is below 0; give 0 or more" in err


@pytest.fixture(scope='module')
def step_root(tmp_path_factory):
  """A CheckpointManager root holding step 1 of one 16x8 leaf (Auto axes)."""
  import orbax.checkpoint as ocp

  root = tmp_path_factory.mktemp('steps') / 'run'
  with ocp.CheckpointManager(root) as manager:
    manager.save(1, args=ocp.args.StandardSave({'w': jnp.ones((16, 8))}))
    manager.wait_until_finished()
  return str(root)


@pytest.mark.parametrize(
  'folder, flags, said',
  [
    ('', ['--step', '-1'], "--step: expected a step number of 0 or more, got '-1'"),
    ('', ['--devices-per-host', '3'], '--devices-per-host 3 does not divide'),
    ('/1', ['--step', '2'], 'with --step 2, or this folder without --step'),
  ],
)
def test_restore_plan_speaks_of_its_flags(capsys, step_root, folder, flags, said):
  # Was: "step=-1: expected an int of at least 0", "devices_per_host=3 ...".
  err = error_line(capsys, 'restore-plan', step_root + folder, '--model', 'mlp',
                   '--mesh', 'data=2,model=4', *flags)  # fmt: skip
  assert said in err
  assert 'step=' not in err and 'devices_per_host' not in err
