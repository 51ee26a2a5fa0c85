"""``python -m flax_shardmeta`` and the ``flax-shardmeta`` script are one
program: on a mesh of more than the 8 devices a process gets by default, both
set up as many simulated CPU devices as the mesh has, in one place
(``_devices.simulated``). Meshes: Auto axes (the audit makes its own Explicit
copy).
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from flax_shardmeta._devices.simulated import (
  COUNT_FLAG,
  cpu_device_flags,
  simulate_cpu_devices,
)

SCRIPT = pathlib.Path(sys.executable).with_name('flax-shardmeta')


def run(argv):
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}  # no count set
  return subprocess.run(
    argv, capture_output=True, text=True, env=env, timeout=600, check=False
  )


@pytest.mark.skipif(not SCRIPT.exists(), reason='the console script is not installed')
def test_both_entry_points_audit_a_mesh_of_sixteen_devices():
  args = ['audit', '--model', 'mlp', '--mesh', 'data=4,model=4', '--format', 'json']
  module = run([sys.executable, '-m', 'flax_shardmeta', *args])
  script = run([str(SCRIPT), *args])
  assert module.returncode == script.returncode, (module.stderr, script.stderr)
  assert 'devices' not in module.stderr, module.stderr
  got, want = json.loads(module.stdout), json.loads(script.stdout)
  assert got == want
  assert got['mesh'] == {'data': 4, 'model': 4} and got['compiles']


def test_the_device_count_is_set_once_and_the_users_kept():
  env = {'XLA_FLAGS': '--xla_dump_to=/tmp/x'}
  assert simulate_cpu_devices(16, env)
  assert env['XLA_FLAGS'].split() == ['--xla_dump_to=/tmp/x', f'{COUNT_FLAG}=16']
  assert not simulate_cpu_devices(32, env)  # a count already set is kept
  assert env['XLA_FLAGS'].endswith(f'{COUNT_FLAG}=16')
  # A job's processes each get their share, replacing any count.
  assert cpu_device_flags(f'{COUNT_FLAG}=8 --xla_dump_to=/tmp/x', 2).split() == [
    '--xla_dump_to=/tmp/x',
    f'{COUNT_FLAG}=2',
  ]
