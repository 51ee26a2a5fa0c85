"""The command line: ``plan`` output, formats, exit codes, rules files, ``demo``."""

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import flax_shardmeta as fsm
from flax_shardmeta import cli, examples
from flax_shardmeta.cli.main import build_parser
from flax_shardmeta.examples import linen as models

MLP = ['plan', '--model', 'mlp', '--mesh', 'data=2,model=4']


def run(capsys, *argv):
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


def test_builtin_model_names_match_the_registry():
  assert examples.MODEL_NAMES == models.MODEL_NAMES


def test_plan_table(capsys):
  code, out, err = run(capsys, *MLP)
  assert code == 0, err
  assert out.startswith('Sharding plan: 7 arrays on mesh data=2 x model=4 (8 devices)')
  assert "P(None, 'model', None)" in out and 'problems: none' in out


def test_plan_json_schema(capsys):
  code, out, _ = run(capsys, *MLP, '--format', 'json', '--optimizer', 'none')
  assert code == 0
  d = json.loads(out)
  assert {'entries', 'bytes_per_device', 'total_bytes', 'problems'} <= set(d)
  assert [e['path'] for e in d['entries']] == [
    'params/ScanDotReluDot_0/Dense_0/kernel',
    'params/ScanDotReluDot_0/W2',
  ]
  for e in d['entries']:
    assert set(e) == {
      'path',
      'shape',
      'dtype',
      'names',
      'spec',
      'shard_shape',
      'bytes_per_device',
    }
    assert isinstance(e['bytes_per_device'], int)
  assert d['entries'][1]['spec'] == [None, 'model', None]
  assert d['total_bytes'] == 2 * 4 * 1024 * 1024 * 4
  assert d['problems'] == []


def test_dtype_and_optimizer_change_the_memory(capsys):
  sizes = {}
  for dtype in ('float32', 'bfloat16'):
    for opt in ('adam', 'adafactor', 'none'):
      code, out, _ = run(
        capsys, *MLP, '--format', 'json', '--dtype', dtype, '--optimizer', opt
      )
      assert code == 0
      sizes[dtype, opt] = json.loads(out)['total_bytes']
  assert sizes['float32', 'none'] == 2 * sizes['bfloat16', 'none']
  assert sizes['float32', 'adafactor'] < sizes['float32', 'adam']
  assert sizes['float32', 'adam'] > 3 * sizes['float32', 'none']


def test_nnx_api(capsys):
  code, out, _ = run(capsys, *MLP, '--api', 'nnx', '--format', 'json')
  assert code == 0
  paths = {e['path']: e['spec'] for e in json.loads(out)['entries']}
  assert paths['params/layers/W1'] == [None, None, 'model']
  assert paths['opt_state/0/mu/layers/W2'] == [None, 'model', None]


def test_problems_exit_1_unless_allowed(capsys):
  bad = ['plan', '--model', 'mlp', '--mesh', 'data=3,model=5']
  code, out, err = run(capsys, *bad)
  assert code == 1
  assert 'problems (2):' in out and 'not divisible' in out
  assert '--allow-problems' in err
  code, out, _ = run(capsys, *bad, '--allow-problems', '--format', 'json')
  assert code == 0
  problems = json.loads(out)['problems']
  assert {p['path'] for p in problems} == {
    'params/ScanDotReluDot_0/Dense_0/kernel',
    'params/ScanDotReluDot_0/W2',
  }


@pytest.mark.parametrize('flag', ['--replicate-indivisible', '--fit'])
def test_replicate_indivisible_exits_0_and_lists_adjustments(capsys, flag):
  # --fit: the former name, kept for one release.
  code, out, err = run(
    capsys,
    'plan',
    '--model',
    'mlp',
    '--mesh',
    'data=3,model=5',
    flag,
    '--optimizer',
    'none',
  )
  assert code == 0, err
  assert 'replicated by replicate_indivisible=True (2):' in out


def test_strict_turns_unmapped_names_into_problems(capsys, tmp_path):
  rules = tmp_path / 'rules.json'
  rules.write_text(json.dumps([['hidden', 'model'], ['layers', None]]))
  argv = [*MLP, '--optimizer', 'none', '--rules', str(rules)]
  code, out, err = run(capsys, *argv)
  assert code == 0, err  # 'embed' has no rule: replicated, no problem
  code, out, err = run(capsys, *argv, '--strict')
  assert code == 1
  assert "no usable rule maps logical name 'embed' (strict=True)" in out
  assert '--allow-problems' in err


def test_mesh_axis_name_warning_goes_to_stderr(capsys, tmp_path):
  rules = tmp_path / 'rules.json'
  rules.write_text(json.dumps([['hidden', 'data'], ['layers', None]]))
  code, out, err = run(
    capsys,
    *MLP,
    '--optimizer',
    'none',
    '--rules',
    str(rules),
    '--mesh',
    'data=2,embed=4',
  )
  assert code == 0, err
  assert err.startswith("flax-shardmeta: warning: Logical name 'embed'")


@pytest.mark.parametrize(
  'argv, message',
  [
    (['--model', 'gpt5', '--mesh', 'data=2'], "unknown model 'gpt5'"),
    (['--model', 'mlp', '--mesh', 'data2'], 'malformed --mesh'),
    (['--model', 'mlp', '--mesh', 'data=2,,model=4'], 'malformed --mesh'),
    (['--model', 'mlp', '--mesh', 'data=0'], 'positive integers'),
    (['--model', 'mlp', '--mesh', 'data=-2'], 'positive integers'),
    (['--model', 'mlp', '--mesh', 'data=1.5'], 'positive integers'),
    (['--model', 'mlp', '--mesh', 'data=2,data=4'], 'twice'),
    (
      ['--model', 'mlp', '--mesh', 'data=2', '--rules', 'missing.json'],
      "--rules 'missing.json' is not valid",
    ),
    (['--model', 'mlp', '--mesh', 'data=2', '--format', 'xml'], 'invalid choice'),
    (['--mesh', 'data=2'], 'one of the arguments --model --module is required'),
    (['--module', 'nocolon', '--mesh', 'data=2'], 'PKG.MOD:FACTORY'),
    (['--module', 'no_such_pkg_xyz:f', '--mesh', 'data=2'], 'no_such_pkg_xyz'),
    (
      ['--model', 'mlp', '--mesh', 'data=2,modle=4'],
      "no rule uses mesh axis 'modle', and the rules shard over 'model', which "
      "the mesh lacks: did you mean 'model'?",
    ),
    (['--model', 'mlp', '--mesh', 'data=2', '--rules', '[["a"'], 'as JSON'),
    (['--model', 'mlp', '--mesh', 'data=2', '--rules', '[["a"]]'], '--rules'),
  ],
)
def test_bad_arguments_exit_2_with_one_line(capsys, argv, message):
  code, out, err = run(capsys, 'plan', *argv)
  assert code == 2
  assert out == ''
  assert err.count('\n') == 1 and err.startswith('flax-shardmeta: error: ')
  assert message in err


@pytest.mark.parametrize(
  'argv',
  [
    ['plan', '--help'],
    ['--help'],
    ['fit', '--help'],
    ['suggest', '--help'],
    ['snapshot', '--help'],
    ['diff', '--help'],
    ['plan', '--model', 'gpt5', '--mesh', 'data=2'],
    ['plan', '--model', 'mlp', '--mesh', 'data=0'],
    ['plan', '--model', 'mlp', '--mesh', 'data=2', '--rules', 'missing.json'],
  ],
)
def test_help_and_argument_errors_do_not_import_jax(argv):
  # What `python -m flax_shardmeta` and the console script import: with jax
  # left out, help and usage errors answer at once.
  proc = subprocess.run(
    [sys.executable, '-X', 'importtime', '-m', 'flax_shardmeta', *argv],
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )
  assert proc.returncode == (0 if '--help' in argv else 2), proc.stderr
  imported = [
    line.rsplit('|', 1)[-1].strip()
    for line in proc.stderr.splitlines()
    if line.startswith('import time:')
  ]
  assert 'flax_shardmeta.cli' in imported
  assert not [m for m in imported if m.split('.')[0] in ('jax', 'flax', 'numpy')]


@pytest.mark.parametrize('text', ['{not json', '[["embed"]]', '{"rules": 1}'])
def test_bad_rules_file_exits_2(capsys, tmp_path, text):
  path = tmp_path / 'rules.json'
  path.write_text(text)
  code, _, err = run(capsys, *MLP, '--rules', str(path))
  assert code == 2 and err.count('\n') == 1 and 'rules file' in err


def test_a_mesh_without_a_rule_axis_is_no_typo(capsys):
  # A 1-D mesh: 'model' is missing, but no axis is spelled like it.
  code, out, _ = run(capsys, 'plan', '--model', 'mlp', '--mesh', 'data=8')
  assert code == 1 and "mesh axis 'model' (dimension 2) is not in the mesh" in out


def test_inline_json_rules(capsys):
  rules = json.dumps([['hidden', ['data', 'model']], ['embed', None]])
  code, out, _ = run(capsys, *MLP, '--rules', rules, '--format', 'json')
  assert code == 0
  assert json.loads(out)['entries'][-1]['spec'] == [None, ['data', 'model'], None]


def test_rules_from_json_and_toml(capsys, tmp_path):
  as_json = tmp_path / 'rules.json'
  as_json.write_text(json.dumps([['hidden', ['data', 'model']], ['embed', None]]))
  as_toml = tmp_path / 'rules.toml'
  as_toml.write_text('rules = [["hidden", ["data", "model"]], ["embed", []]]\n')
  specs = []
  for path in (as_json, as_toml):
    code, out, _ = run(capsys, *MLP, '--rules', str(path), '--format', 'json')
    assert code == 0
    specs.append(json.loads(out)['entries'][-1]['spec'])
  assert specs[0] == specs[1] == [None, ['data', 'model'], None]


@pytest.mark.parametrize('rules, embed', [('t5x', None), ('t5x-2d', 'data')])
def test_standard_rules(capsys, rules, embed):
  code, out, _ = run(
    capsys,
    'plan',
    '--model',
    'llama3-8b',
    '--mesh',
    'data=4,model=2',
    '--rules',
    rules,
    '--format',
    'json',
    '--optimizer',
    'none',
  )
  assert code == 0
  entries = {e['path']: e['spec'] for e in json.loads(out)['entries']}
  assert entries['params/layers/w1'] == [None, embed, 'model']


FACTORIES = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from flax import linen as nn, nnx
    import flax_shardmeta as fsm

    class Tiny(nn.Module):
      @nn.compact
      def __call__(self, x):
        return nn.Dense(16, kernel_init=fsm.with_logical_partitioning(
            nn.initializers.lecun_normal(), ('embed', 'mlp')))(x)

    def linen_tuple():
      return Tiny(), jax.ShapeDtypeStruct((2, 8), jnp.float32)

    def linen_init():
      return lambda: Tiny().init(jax.random.key(0), jnp.ones((2, 8)))

    def nnx_init():
      return lambda: nnx.Linear(8, 16, rngs=nnx.Rngs(0),
          kernel_init=fsm.nnx.with_logical_partitioning(
              nnx.initializers.lecun_normal(), ('embed', 'mlp')))

    def nnx_reduced():
      # jax accepts reduced axes only on Explicit mesh axes.
      return lambda: nnx.Linear(8, 16, rngs=nnx.Rngs(0), kernel_metadata={
          'out_sharding': jax.P(None, 'model', reduced={'data'}),
          'eager_sharding': False})

    def wrong():
      return 42

    def _tiny_step(params, batch):
      return Tiny().apply({'params': params}, batch).sum()

    def step_and_args():
      # What fit and suggest take: the step and its abstract arguments.
      params = jax.eval_shape(
          lambda: Tiny().init(jax.random.key(0), jnp.ones((2, 8))))['params']
      return _tiny_step, params, jax.ShapeDtypeStruct((2, 8), jnp.float32)

    def step_without_annotations():
      x = jax.ShapeDtypeStruct((2, 8), jnp.float32)
      return (lambda w, x: (x @ w).sum()), x, x
""")


@pytest.mark.parametrize(
  'factory, api, path',
  [
    ('linen_tuple', 'linen', 'params/Dense_0/kernel'),
    ('linen_init', 'linen', 'params/Dense_0/kernel'),
    ('nnx_init', 'nnx', 'params/kernel'),
  ],
)
def test_user_module(capsys, tmp_path, monkeypatch, factory, api, path):
  (tmp_path / 'my_models.py').write_text(FACTORIES)
  monkeypatch.syspath_prepend(str(tmp_path))
  code, out, err = run(
    capsys,
    'plan',
    '--module',
    f'my_models:{factory}',
    '--api',
    api,
    '--mesh',
    'data=2,model=4',
    '--format',
    'json',
  )
  assert code == 0, err
  entries = {e['path']: e['spec'] for e in json.loads(out)['entries']}
  # t5x rules by default: 'mlp' goes to 'model', 'embed' is replicated.
  assert entries[path] == [None, 'model']


@pytest.mark.parametrize('types, problems', [('auto', 1), ('explicit', 0)])
def test_the_mesh_has_the_axis_types_asked_for(
  capsys, tmp_path, monkeypatch, types, problems
):
  (tmp_path / 'my_models.py').write_text(FACTORIES)
  monkeypatch.syspath_prepend(str(tmp_path))
  argv = ['plan', '--module', 'my_models:nnx_reduced', '--api', 'nnx']
  argv += ['--mesh', 'data=2,model=4', '--format', 'json', '--allow-problems']
  code, out, err = run(capsys, *argv, '--axis-types', types)
  assert code == 0, err
  d = json.loads(out)
  assert len(d['problems']) == problems
  if not problems:
    kernel = next(e for e in d['entries'] if e['path'] == 'params/kernel')
    assert kernel['reduced'] == ['data']


T5X_NOTE = (
  'flax-shardmeta: rules: T5X defaults (pass --rules t5x-2d, inline JSON or a '
  'JSON / TOML file to choose)\n'
)


def test_plan_takes_the_step_factory_of_fit_and_suggest(capsys, tmp_path, monkeypatch):
  # Abstract mesh, Auto axes (plan's default --axis-types).
  (tmp_path / 'my_models.py').write_text(FACTORIES)
  monkeypatch.syspath_prepend(str(tmp_path))
  argv = ['plan', '--mesh', 'data=2,model=4', '--format', 'json']
  code, out, err = run(capsys, *argv, '--module', 'my_models:step_and_args')
  assert code == 0, err
  entries = {e['path']: e['spec'] for e in json.loads(out)['entries']}
  # The step's arguments by its parameter names, the state as given (no
  # optimizer state added); the batch has no annotations: named, not planned.
  assert entries == {
    'params/Dense_0/kernel': [None, 'model'],
    'params/Dense_0/bias': [],
  }
  assert err == T5X_NOTE + (
    'flax-shardmeta: plan: arguments of the step without annotations, not '
    'planned: batch\n'
  )
  # The same layout as the model given as (module, *inputs).
  code, out, _ = run(capsys, *argv, '--module', 'my_models:linen_tuple')
  assert code == 0
  kernel = [e for e in json.loads(out)['entries'] if e['path'].endswith('kernel')]
  assert kernel[0]['spec'] == entries['params/Dense_0/kernel']


def test_plan_of_a_step_with_nothing_annotated_exits_2(capsys, tmp_path, monkeypatch):
  (tmp_path / 'my_models.py').write_text(FACTORIES)
  monkeypatch.syspath_prepend(str(tmp_path))
  argv = ['plan', '--module', 'my_models:step_without_annotations']
  code, out, err = run(capsys, *argv, '--mesh', 'data=2,model=4')
  assert (code, out) == (2, '')
  assert err == (
    'flax-shardmeta: error: --module my_models:step_without_annotations: none of '
    'the arguments of the step it returned (w, x) carries annotations, so there '
    'is nothing to plan; annotate them (fsm.with_logical_partitioning, '
    'fsm.LogicalPartitioned) or see the layout with flax-shardmeta fit\n'
  )


def test_the_default_rules_are_said_only_when_used(capsys, tmp_path, monkeypatch):
  (tmp_path / 'my_models.py').write_text(FACTORIES)
  monkeypatch.syspath_prepend(str(tmp_path))
  argv = ['plan', '--module', 'my_models:linen_tuple', '--mesh', 'data=2,model=4']
  code, _, err = run(capsys, *argv)
  assert (code, err) == (0, T5X_NOTE)
  code, _, err = run(capsys, *argv, '--rules', 't5x')
  assert (code, err) == (0, '')
  code, _, err = run(capsys, *MLP)  # a built-in model: its own rules
  assert (code, err) == (0, '')


def test_user_module_with_a_wrong_factory(capsys, tmp_path, monkeypatch):
  (tmp_path / 'my_models.py').write_text(FACTORIES)
  monkeypatch.syspath_prepend(str(tmp_path))
  code, _, err = run(capsys, 'plan', '--module', 'my_models:wrong', '--mesh', 'data=2')
  assert code == 2 and 'returned int' in err


MINE = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from flax import linen as nn
    import flax_shardmeta as fsm

    SEEN = []

    class Heads(nn.Module):
      heads: int = 0

      @nn.compact
      def __call__(self, x):
        return nn.Dense(x.shape[-1] // self.heads)(x)

    def buggy_model():
      return Heads(), jax.ShapeDtypeStruct((2, 8), jnp.float32)

    def raises():
      return {}['params']

    def needs_mesh(mesh):
      return mesh

    def records():
      SEEN.append((jax.sharding.get_abstract_mesh().axis_names,
                   fsm.get_logical_axis_rules()))
      return Heads(heads=2), jax.ShapeDtypeStruct((2, 8), jnp.float32)
""")


@pytest.fixture
def mine(tmp_path, monkeypatch):
  """``mine_models`` (the factories above) and ``mine_broken`` (which cannot
  be imported) on the path."""
  (tmp_path / 'mine_models.py').write_text(MINE)
  (tmp_path / 'mine_broken.py').write_text('import no_such_dependency_xyz\n')
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.delitem(sys.modules, 'mine_models', raising=False)


@pytest.mark.parametrize(
  'target, error',
  [
    ('mine_models:raises', "KeyError: 'params'"),
    (
      'mine_models:needs_mesh',
      "TypeError: needs_mesh() missing 1 required positional argument: 'mesh'",
    ),
    (
      'mine_models:buggy_model',
      'ZeroDivisionError: integer division or modulo by zero',
    ),
    (
      'mine_broken:make',
      "ModuleNotFoundError: No module named 'no_such_dependency_xyz'",
    ),
  ],
)
def test_a_failing_factory_is_one_line_naming_it(capsys, mine, target, error):
  code, out, err = run(capsys, 'plan', '--module', target, '--mesh', 'data=2,model=4')
  assert (code, out) == (2, '')
  assert err == (
    f'flax-shardmeta: error: --module {target}: {error} (--traceback shows where)\n'
  )


def test_a_missing_factory_is_one_line_naming_it(capsys, mine):
  code, _, err = run(capsys, 'plan', '--module', 'mine_models:nope', '--mesh', 'data=2')
  assert code == 2
  assert err == (
    'flax-shardmeta: error: --module mine_models:nope: AttributeError: module '
    "'mine_models' has no attribute 'nope'\n"
  )


def test_traceback_shows_where_the_factory_failed(capsys, mine):
  argv = ['plan', '--module', 'mine_models:buggy_model', '--mesh', 'data=2,model=4']
  code, _, err = run(capsys, *argv, '--traceback')
  assert code == 2
  assert err.startswith('Traceback (most recent call last):')
  assert 'return nn.Dense(x.shape[-1] // self.heads)(x)' in err  # the user's line
  assert err.splitlines()[-1] == (
    'flax-shardmeta: error: --module mine_models:buggy_model: ZeroDivisionError: '
    'integer division or modulo by zero'
  )


def test_the_factory_is_called_under_the_mesh_and_rules(capsys, mine):
  # The contract fit and suggest follow too: plan's abstract mesh, its rules.
  argv = ['plan', '--module', 'mine_models:records', '--mesh', 'data=2,model=4']
  code, _, err = run(capsys, *argv, '--rules', '[["mlp", "model"]]')
  assert code == 0, err
  assert sys.modules['mine_models'].SEEN == [(('data', 'model'), (('mlp', 'model'),))]


def test_cli_modules_share_their_pieces_not_their_privates():
  # Shared argument pieces live in cli.options, cli.checks and cli.rule_files,
  # the factory contract in cli.factory. The command line is built on the
  # public library: no CLI module imports a private module of the package
  # (`flax_shardmeta._x`, `from flax_shardmeta import _x`), nor reaches for a
  # private name, by name (`from m import _x`) or through a module (`m._x`).
  import ast
  import importlib.util

  def is_module(name):
    try:
      return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a name inside a module, not a submodule
      return False

  paths = sorted((Path(fsm.__file__).parent / 'cli').glob('*.py'))
  shared = {'options', 'checks', 'rule_files', 'factory'}
  assert {p.stem for p in paths} >= {*shared, 'plan', 'fit', 'suggest'}
  taken = []
  for path in paths:
    tree = ast.parse(path.read_text())
    modules = set()
    for node in ast.walk(tree):
      imported = []
      if isinstance(node, ast.ImportFrom) and node.module:
        imported = [node.module, *(f'{node.module}.{a.name}' for a in node.names)]
      elif isinstance(node, ast.Import):
        imported = [a.name for a in node.names]
      for name in imported:
        parts = name.split('.')
        if parts[0] == 'flax_shardmeta' and any(p.startswith('_') for p in parts[1:]):
          if is_module(name) or name == getattr(node, 'module', None):
            taken.append(f'{path.name}:{node.lineno}: private module {name}')
      if isinstance(node, ast.ImportFrom) and (node.module or '').startswith('flax'):
        for alias in node.names:
          name = f'{node.module}.{alias.name}'
          if is_module(name):
            modules.add(alias.asname or alias.name)
          elif alias.name.startswith('_'):
            taken.append(f'{path.name}: {name}')
      elif isinstance(node, ast.Import):
        modules |= {
          a.asname for a in node.names if a.name.startswith('flax') and a.asname
        }
    for node in ast.walk(tree):
      if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in modules
        and node.attr.startswith('_')
        and not node.attr.startswith('__')
      ):
        taken.append(f'{path.name}:{node.lineno}: {node.value.id}.{node.attr}')
  assert taken == []


def test_each_command_is_a_module_adding_its_own_arguments():
  import importlib

  from flax_shardmeta.cli.main import COMMANDS, build_parser

  names = [
    'demo',
    'plan',
    'fit',
    'suggest',
    'snapshot',
    'diff',
    'restore-plan',
    'audit',
    'explain',
  ]
  assert list(COMMANDS) == names
  for name, command in COMMANDS.items():
    module = name.replace('-', '_')
    assert command is importlib.import_module(f'flax_shardmeta.cli.{module}')
    assert callable(command.add_arguments) and callable(command.run)
  sub = next(a for a in build_parser()._actions if a.dest == 'command')
  assert list(sub.choices or ()) == list(COMMANDS)


@pytest.mark.slow
def test_demo(capsys):
  code, out, _ = run(capsys, 'demo', '--steps', '3')
  assert code == 0
  assert 'Sharding plan:' in out and 'step 2: loss' in out
  assert out.rstrip().splitlines()[-1].startswith('OK: all 8 arrays')


@pytest.mark.slow
def test_demo_across_two_processes():
  env = {**os.environ, 'PYTHONPATH': str(Path(fsm.__file__).resolve().parents[1])}
  env.pop('XLA_FLAGS', None)
  done = subprocess.run(
    [
      sys.executable,
      '-m',
      'flax_shardmeta',
      'demo',
      '--processes',
      '2',
      '--steps',
      '3',
    ],
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  lines = done.stdout.strip().splitlines()
  assert lines[0].startswith('launching 2 processes x 4 CPU devices')
  assert '2 process(es) x 4 devices; each loads 8 of 16 rows' in done.stdout
  assert any(line.startswith('OK: all 8 arrays carry') for line in lines)
  assert lines[-1].startswith('OK: same parameters as 1 process x 8 devices')
  assert not any(line.startswith('[Gloo]') for line in lines)


@pytest.mark.parametrize('steps', ['0', '-3', 'two'])
def test_demo_steps_must_be_positive(capsys, steps):
  code, out, err = run(capsys, 'demo', '--steps', steps)
  assert code == 2 and out == '' and err.count('\n') == 1
  assert f"argument --steps: expected a positive integer, got '{steps}'" in err


MODEL_FLAGS = ('--model', '--module')


def _actions(parser):
  for action in parser._actions:
    if isinstance(action, argparse._SubParsersAction):
      for sub in action.choices.values():
        yield from _actions(sub)
    elif (
      not isinstance(action, argparse._HelpAction) and action.help != argparse.SUPPRESS
    ):
      yield parser.prog, action


@pytest.mark.parametrize(
  'command', [[], ['plan'], ['fit'], ['suggest'], ['snapshot'], ['diff'], ['demo']]
)
def test_help_shows_every_default_and_no_markup(capsys, command):
  code, out, _ = run(capsys, *command, '--help')
  assert code == 0
  assert '``' not in out and ':func:' not in out
  options = out[out.index('options:') :]
  for prog, action in _actions(build_parser()):
    if prog == ' '.join(['flax-shardmeta', *command]) and action.option_strings:
      flag = action.option_strings[0]
      assert action.help, f'{prog} {flag} has no help'
      shown = options[options.index(f'  {flag}') :].split('\n  -')[0]
      # --model / --module: one of the two is required, neither has a default.
      assert 'default' in shown or 'required' in shown or flag in MODEL_FLAGS, shown


def test_demo_processes_must_divide_the_devices(capsys):
  code, _, err = run(capsys, 'demo', '--processes', '3')
  assert code == 2 and 'use 1, 2, 4 or 8' in err


@pytest.mark.slow
def test_python_dash_m_in_a_subprocess():
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
  proc = subprocess.run(
    [
      sys.executable,
      '-m',
      'flax_shardmeta',
      'plan',
      '--model',
      'llama3-8b',
      '--mesh',
      'data=64,model=8',
      '--format',
      'json',
      '--dtype',
      'bfloat16',
    ],
    capture_output=True,
    text=True,
    env=env,
    timeout=120,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr
  d = json.loads(proc.stdout)
  assert len(d['entries']) == 3 * 12 + 1
  assert d['problems'] == []
  bad = subprocess.run(
    [sys.executable, '-m', 'flax_shardmeta', 'plan', '--model', 'x', '--mesh', 'a=1'],
    capture_output=True,
    text=True,
    env=env,
    timeout=120,
    check=False,
  )
  assert bad.returncode == 2 and bad.stderr.count('\n') == 1


def test_the_model_names_the_command_line_lists_are_the_models():
  from flax_shardmeta.examples import _common, _model_names as _names

  assert _names.MODEL_NAMES == ('mlp', *_common.LLAMA_CONFIGS)


@pytest.mark.parametrize(
  'argv, message',
  [
    (['--offload', 'optimiser'], "--offload 'optimiser': choose from none, optimizer"),
    (['--offload', ''], "--offload '': choose from"),
    (['--host-memory', 'lots'], '--host-memory'),
  ],
)
def test_suggest_offload_arguments(capsys, argv, message):
  common = ['--model', 'mlp', '--topology', 'v5p:2x2x1', '--batch', '8']
  code, out, err = run(capsys, 'suggest', *common, *argv)
  assert code == 2 and out == ''
  assert err.startswith('flax-shardmeta: error: ') and message in err
