"""Simulated CPU devices, set up in one place.

XLA's CPU client makes as many devices as ``XLA_FLAGS``'
``--xla_force_host_platform_device_count`` says, read once when jax starts
its CPU backend: the flag must be in the environment before that. The
command line gives a mesh's commands as many devices as the mesh has, each
process of a local multi-process job its share, and the test suite its 8,
all through these two functions. Nothing here imports jax.

Example:
  >>> cpu_device_flags(f'--xla_dump_to=/tmp/d {COUNT_FLAG}=8', 16).split()
  ['--xla_dump_to=/tmp/d', '--xla_force_host_platform_device_count=16']
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

COUNT_FLAG = '--xla_force_host_platform_device_count'


def cpu_device_flags(flags: str, count: int) -> str:
  """``XLA_FLAGS`` text ``flags`` with ``count`` simulated CPU devices (a
  count already there replaced, every other flag kept)."""
  kept = [f for f in flags.split() if not f.startswith(COUNT_FLAG)]
  return ' '.join([*kept, f'{COUNT_FLAG}={count}'])


def simulate_cpu_devices(
  count: int, env: MutableMapping[str, str] | None = None
) -> bool:
  """Asks for ``count`` simulated CPU devices, to lay out and run meshes
  bigger than this machine's on its CPU. Returns whether it was set.

  Before jax is imported the count goes into ``XLA_FLAGS`` (and so into every
  process started from this one); after, into jax's ``jax_num_cpu_devices``
  option, which holds until the first device query starts the backends. A
  count the user's ``XLA_FLAGS`` already name is kept, and once the backends
  have started the devices are fixed: nothing is set then.

  Example:
    >>> import flax_shardmeta as fsm
    >>> env = {'XLA_FLAGS': '--xla_dump_to=/tmp/d'}
    >>> fsm.simulate_cpu_devices(16, env), env['XLA_FLAGS']
    (True, '--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=16')
  """
  env = os.environ if env is None else env
  flags = env.get('XLA_FLAGS', '')
  if COUNT_FLAG in flags:
    return False
  if env is not os.environ or 'jax' not in sys.modules:
    env['XLA_FLAGS'] = cpu_device_flags(flags, count)
    return True
  import jax

  try:
    jax.config.update('jax_num_cpu_devices', count)
  except RuntimeError:  # the backends have started: the devices are fixed
    return False
  return True
