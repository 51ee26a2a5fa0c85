"""The README and the guides run: every ```python block as written.

Each python block runs in a fresh interpreter, as a newcomer would paste it (it
sets up its own 8 simulated CPU devices). The errors page's quoted messages are
checked in tests/test_docs.py.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
from floor import ON_THE_FLOOR

import flax_shardmeta as fsm

ROOT = pathlib.Path(fsm.__file__).resolve().parent.parent
PAGES = [
  ROOT / 'README.md',
  ROOT / 'docs' / 'getting_started.md',
  ROOT / 'docs' / 'install.md',
  *sorted((ROOT / 'docs' / 'guides').glob('*.md')),
]
TEXTS = {page.relative_to(ROOT).as_posix(): page.read_text() for page in PAGES}
README = TEXTS['README.md']
BLOCKS = [
  (name, block)
  for name, text in TEXTS.items()
  for block in re.findall(r'^```python\n(.*?)^```', text, re.MULTILINE | re.DOTALL)
]


def _quoted(text: str) -> dict[str, str]:
  """Each python block's output as the page quotes it: a ```text block
  right after it, with nothing but a blank line between."""
  fences = list(re.finditer(r'^```(\w*)\n(.*?)^```\n', text, re.MULTILINE | re.DOTALL))
  return {
    a.group(2): b.group(2)
    for a, b in zip(fences, fences[1:])
    if a.group(1) == 'python'
    and b.group(1) == 'text'
    and not text[a.end() : b.start()].strip()
  }


QUOTED = {
  (name, block): quoted
  for name, text in TEXTS.items()
  for block, quoted in _quoted(text).items()
}


def test_the_readme_and_guides_have_python_blocks():
  assert len([b for name, b in BLOCKS if name == 'README.md']) >= 3
  assert len(BLOCKS) >= 10


def test_the_readme_is_short():
  assert len(README.splitlines()) <= 250


@pytest.mark.parametrize(
  'index', range(len(BLOCKS)), ids=[f'{n}:{i}' for i, (n, _) in enumerate(BLOCKS)]
)
def test_python_block_runs_as_written(index, tmp_path):
  name, block = BLOCKS[index]
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  env['JAX_PLATFORMS'] = 'cpu'
  done = subprocess.run(
    [sys.executable, '-c', block],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert done.returncode == 0, f'{name} block {index}:\n{done.stderr[-3000:]}'
  # A printed value commented as `print(...)  # value` is what it prints.
  expected = [
    m.group(1) for m in re.finditer(r'^print\(.*\)  # (.+)$', block, re.MULTILINE)
  ]
  assert done.stdout.splitlines()[: len(expected)] == expected
  # The output quoted after it is printed as quoted (`...` marks lines left out),
  # by the versions the pages were written with: another XLA compiles otherwise.
  if not ON_THE_FLOOR:
    return
  printed = {line.rstrip() for line in done.stdout.splitlines()}
  stale = [
    line
    for line in QUOTED.get((name, block), '').splitlines()
    if line.strip() and '...' not in line and line.rstrip() not in printed
  ]
  assert not stale, f'{name} block {index} no longer prints:\n' + '\n'.join(stale)


@pytest.mark.parametrize('name', list(TEXTS))
def test_shell_commands_work_with_the_venv_not_active(name):
  commands = re.findall(r'^(\S*flax-shardmeta) ', TEXTS[name], re.MULTILINE)
  assert set(commands) <= {'.venv/bin/flax-shardmeta'}, commands
  prose = re.findall(r'`(\S*flax-shardmeta) (?:plan|demo)', TEXTS[name])
  assert set(prose) <= {'.venv/bin/flax-shardmeta'}, prose


@pytest.mark.slow
def test_across_hosts_block_runs_in_two_processes(tmp_path):
  from flax_shardmeta._hosts import launch

  (block,) = [b for _, b in BLOCKS if 'jax.distributed.initialize()' in b]
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
  text = '\n'.join(TEXTS.values())
  lines = re.findall(r'^\.venv/bin/flax-shardmeta (plan --model .*)$', text, re.M)
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
  # The venv of `make test` carries libtpu (the tpu extra) and
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


# A guide's `flax-shardmeta fit` command and the output it quotes right after.
QUOTED_FITS = [
  (name, command, quoted)
  for name, text in TEXTS.items()
  for command, quoted in re.findall(
    r'^```bash\n\.venv/bin/flax-shardmeta (fit [^\n\\]*)\n```\n\n```text\n(.*?)^```',
    text,
    re.MULTILINE | re.DOTALL,
  )
]


def test_guides_quote_fit_outputs():
  assert len(QUOTED_FITS) >= 3, [c for _, c, _ in QUOTED_FITS]


@pytest.mark.slow
@pytest.mark.parametrize(
  'index',
  range(len(QUOTED_FITS)),
  ids=[f'{n}:{i}' for i, (n, _, _) in enumerate(QUOTED_FITS)],
)
def test_a_quoted_fit_output_is_what_the_command_prints(index):
  from flax_shardmeta._devices import gpu, topology

  name, command, quoted = QUOTED_FITS[index]
  if not ON_THE_FLOOR:
    pytest.skip('the guides quote what the floor versions print (.ci/floor.txt)')
  on_gpu = 'h100' in command or 'h200' in command
  if not (gpu.cuda_plugin_available() if on_gpu else topology.libtpu_available()):
    pytest.skip('the compiler for this target is not installed')
  done = subprocess.run(
    [sys.executable, '-m', 'flax_shardmeta', *shlex.split(command)],
    capture_output=True,
    text=True,
    timeout=1200,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
    check=False,
  )
  printed = {line.rstrip() for line in done.stdout.splitlines()}
  # Every line the guide quotes is printed as quoted (an excerpt may leave
  # lines out, marked `...`): its figures cannot go stale.
  stale = [
    line
    for line in quoted.splitlines()
    if line.strip() and '...' not in line and line.rstrip() not in printed
  ]
  assert not stale, (
    f'{name}: `flax-shardmeta {command}` no longer prints:\n' + '\n'.join(stale)
  )
