"""The README runs: every ```python block as written, every error it quotes as raised.

Each python block runs in a fresh interpreter, as a newcomer would paste it (it
sets up its own 8 simulated CPU devices). Quoted messages are produced here by
the calls the README describes and compared with the README's text.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType

import flax_shardmeta as fsm

ROOT = pathlib.Path(fsm.__file__).resolve().parent.parent
README = (ROOT / 'README.md').read_text()
BLOCKS = re.findall(r'^```python\n(.*?)^```', README, re.MULTILINE | re.DOTALL)
AUTO = (AxisType.Auto,) * 2


def _first_line(block: str) -> str:
  return next(line for line in block.splitlines() if line and not line.startswith('#'))


def test_the_readme_has_python_blocks():
  assert len(BLOCKS) >= 3


@pytest.mark.parametrize('index', range(len(BLOCKS)))
def test_python_block_runs_as_written(index, tmp_path):
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  env['JAX_PLATFORMS'] = 'cpu'
  done = subprocess.run(
    [sys.executable, '-c', BLOCKS[index]],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert done.returncode == 0, f'README block {index}:\n{done.stderr[-3000:]}'
  # A printed value commented as `print(...)  # value` is what it prints.
  expected = [
    m.group(1)
    for m in re.finditer(r'^print\(.*\)  # (.+)$', BLOCKS[index], re.MULTILINE)
  ]
  assert done.stdout.splitlines()[: len(expected)] == expected


def test_shell_commands_work_with_the_venv_not_active():
  commands = re.findall(r'^(\S*flax-shardmeta) ', README, re.MULTILINE)
  assert commands and set(commands) == {'.venv/bin/flax-shardmeta'}
  prose = re.findall(r'`(\S*flax-shardmeta) (?:plan|demo)', README)
  assert set(prose) <= {'.venv/bin/flax-shardmeta'}, prose


# Quoted messages
# ------------------------------------------------------------------------------


def _message(error: BaseException) -> str:
  kind = type(error)
  return f'{kind.__module__}.{kind.__qualname__}: {error}'


def _sharding_error() -> str:
  mesh = AbstractMesh((2, 4), ('data', 'model'), axis_types=AUTO)
  tree = {'dense': {'kernel': fsm.Partitioned(jnp.zeros((6, 10)), ('data', 'model'))}}
  with pytest.raises(fsm.ShardingError) as info:
    fsm.get_sharding(tree, mesh)
  return _message(info.value)


def _rule_conflict_error() -> str:
  with pytest.raises(fsm.RuleConflictError) as info:
    fsm.composite_rules([('embed', 'data')], [('embed', 'model')])
  return _message(info.value)


def _no_mesh_error() -> str:
  with pytest.raises(fsm.NoMeshError) as info:
    fsm.shard_value(jnp.ones((8, 4)), ('data', None))
  return _message(info.value)


def _indivisible_warning() -> str:
  mesh = AbstractMesh((2, 4), ('data', 'model'), axis_types=AUTO)
  tree = {'kernel': fsm.Partitioned(jnp.zeros((6, 10)), (None, 'model'))}
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    fsm.get_sharding(tree, mesh, replicate_indivisible=True)
  (warning,) = caught
  return f'{warning.category.__name__}: {warning.message}'


MLP_WITHOUT_OUT_SHARDING = textwrap.dedent("""
    import flax.linen as nn, flax_shardmeta as fsm


    class MLP(nn.Module):
      @nn.compact
      def __call__(self, x):
        init = nn.initializers.lecun_normal()
        w1 = fsm.with_logical_partitioning(init, ('embed', 'mlp'))
        w2 = fsm.with_logical_partitioning(init, ('mlp', 'embed'))
        h = nn.relu(nn.Dense(16, kernel_init=w1)(x))
        return nn.Dense(4, kernel_init=w2)(h)
""")


def _explicit_sharding_error(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
  (tmp_path / 'mlp.py').write_text(MLP_WITHOUT_OUT_SHARDING)
  monkeypatch.chdir(tmp_path)
  monkeypatch.syspath_prepend(str(tmp_path))
  import mlp  # type: ignore[import-not-found]

  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(AxisType.Explicit,) * 2)
  rules = [('batch', 'data'), ('mlp', 'model')]
  model = mlp.MLP()
  x = fsm.shard_value(jnp.ones((8, 4)), ('batch', None), rules, mesh)
  with fsm.logical_axis_rules(rules):
    variables = fsm.sharded_init(model.init, mesh)(jax.random.key(0), x)
  forward = fsm.jit(model.apply, mesh=mesh, rules=rules)
  with pytest.raises(fsm.ExplicitShardingError) as info:
    forward(variables, x)
  return _message(info.value)


def _text_blocks() -> list[str]:
  return re.findall(r'^```text\n(.*?)^```', README, re.MULTILINE | re.DOTALL)


def _block_starting(head: str) -> str:
  found = [b for b in _text_blocks() if b.startswith(head)]
  assert len(found) == 1, f'the README should quote one {head!r} block'
  return found[0].rstrip('\n')


def _unnumbered(text: str) -> str:
  # Source line numbers differ between flax releases; the rest must not.
  return re.sub(r'\.py:\d+ in ', '.py:N in ', text)


@pytest.mark.parametrize(
  'head, generate',
  [
    ('flax_shardmeta._errors.ShardingError:', _sharding_error),
    ('flax_shardmeta._errors.RuleConflictError:', _rule_conflict_error),
    ('flax_shardmeta._errors.NoMeshError:', _no_mesh_error),
    ('IndivisibleDimensionWarning:', _indivisible_warning),
  ],
)
def test_quoted_message_is_what_is_raised(head, generate):
  assert _block_starting(head) == generate()


def test_quoted_explicit_sharding_error_is_what_is_raised(tmp_path, monkeypatch):
  quoted = _block_starting('flax_shardmeta._errors.ExplicitShardingError:')
  generated = _explicit_sharding_error(tmp_path, monkeypatch)
  assert _unnumbered(quoted) == _unnumbered(generated)


def _normalized(text: str) -> str:
  return ' '.join(text.split())


@pytest.mark.parametrize(
  'call',
  [
    lambda: fsm.set_logical_axis_rules([('embed',)]),
    lambda: fsm.logical_to_mesh_axes(('embed', 'embed'), [('embed', 'data')]),
  ],
  ids=['InvalidRulesError', 'InvalidNamesError'],
)
def test_inline_quoted_message_is_what_is_raised(call):
  with pytest.raises(fsm.FlaxShardmetaError) as info:
    call()
  assert f'{type(info.value).__name__}` for' in README
  assert _normalized(str(info.value)) in _normalized(README)


@pytest.mark.slow
def test_across_hosts_block_runs_in_two_processes(tmp_path):
  from flax_shardmeta._hosts import launch

  (block,) = [b for b in BLOCKS if 'jax.distributed.initialize()' in b]
  # The block's own output, one file per process: collective libraries write
  # to the process's stdout from C++ (gloo's "[Gloo] Rank ... connected"
  # lines); those writes to file descriptor 1 do not reach a replaced
  # sys.stdout.
  own_output = (
    'import os, sys\n'
    f'sys.stdout = open(os.path.join({str(tmp_path)!r}, '
    f'"out-" + os.environ[{launch._PROCESS_ID!r}]), "w", buffering=1)\n'
  )
  # What `jax.distributed.initialize()` does on a pod, done for local processes.
  join = 'from flax_shardmeta._hosts import launch\nlaunch.initialize()\n'
  (tmp_path / 'hosts.py').write_text(own_output + join + block)
  results = launch.launch(
    [str(tmp_path / 'hosts.py')], num_processes=2, devices_per_process=4, timeout=300
  )
  printed = [(tmp_path / f'out-{r.process_id}').read_text() for r in results]
  assert printed == ["P(None, 'model')\n"] * 2, [r.stdout for r in results]


@pytest.mark.slow
def test_shell_plan_commands_of_builtin_models_succeed():
  import shlex

  lines = re.findall(r'^\.venv/bin/flax-shardmeta (plan --model .*)$', README, re.M)
  assert len(lines) >= 3
  for line in lines:
    done = subprocess.run(
      [sys.executable, '-m', 'flax_shardmeta', *shlex.split(line)],
      capture_output=True,
      text=True,
      timeout=300,
      env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
      check=False,
    )
    assert done.returncode == 0, f'{line}\n{done.stderr[-2000:]}'


def test_a_plain_script_in_the_readme_venv_prints_nothing_of_libtpu_or_cuda(tmp_path):
  # The venvs of `make demo` / `make test` carry libtpu (the tpu extra) and
  # jax's CUDA plugin (the gpu extra); a user's own script there, with no jax
  # settings of its own, stays quiet.
  script = tmp_path / 'my_script.py'
  script.write_text('import jax, jax.numpy as jnp\nprint(jnp.ones(3).sum())\n')
  env = {
    k: v
    for k, v in os.environ.items()
    if k not in ('JAX_PLATFORMS', 'XLA_FLAGS', 'JAX_SKIP_CUDA_CONSTRAINTS_CHECK')
    and not k.startswith('TPU_')
  }
  done = subprocess.run(
    [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
  )
  assert done.returncode == 0, done.stderr
  assert done.stdout.strip() == '3.0'
  assert done.stderr == '', done.stderr
