"""``flax-shardmeta demo``: plan, init and train a small model on simulated devices.

Runs in this process on 8 simulated CPU devices, or across ``--processes``
local processes under ``jax.distributed`` and then compares with one process.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flax_shardmeta.cli import options

HELP = (
  'plan, init and train a small model on 8 simulated devices, checking every sharding'
)
DESCRIPTION = (
  'Plan, initialize and train a small model on 8 simulated CPU devices, and '
  'check every array against the planned layout.'
)
EPILOG = ''


def add_arguments(p: argparse.ArgumentParser) -> None:
  """The ``demo`` subcommand's options."""
  p.add_argument(
    '--steps',
    type=options.positive,
    default=5,
    metavar='N',
    help='training steps to run',
  )
  p.add_argument(
    '--processes',
    type=int,
    default=1,
    metavar='N',
    help='run across N local processes (8/N CPU devices each) under '
    'jax.distributed, then compare with 1 process',
  )
  p.add_argument('--out', type=Path, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
  """The ``demo`` subcommand: in this process, or across ``--processes``."""
  import flax_shardmeta as fsm

  n = args.processes
  if n < 1 or 8 % n:
    raise options.UsageError(f'--processes {n}: use 1, 2, 4 or 8 (8 devices in all)')
  _, launched = fsm.testing.join_launch()  # a worker of a launch joins it here
  if launched == 1:
    fsm.simulate_cpu_devices(8)  # before the first device query: still in time
  from flax_shardmeta.examples import demo as demo_lib

  if n == 1 or launched > 1:
    return demo_lib.run(args.steps, out=args.out)
  return _across_processes(n, args.steps)


def _across_processes(n: int, steps: int) -> int:
  """The demo in ``n`` processes, then in this one; the same parameters or 1."""
  import contextlib
  import io
  import tempfile

  import flax_shardmeta as fsm
  from flax_shardmeta.examples import demo as demo_lib

  with tempfile.TemporaryDirectory(prefix='fsm-demo-') as tmp:
    print(
      f'launching {n} processes x {8 // n} CPU devices on 127.0.0.1 (gloo)', flush=True
    )
    argv = ['-m', 'flax_shardmeta', 'demo', '--steps', str(steps)]
    try:
      results = fsm.testing.launch(
        [*argv, '--out', str(Path(tmp) / 'multi')],
        num_processes=n,
        devices_per_process=8 // n,
        timeout=600,
      )
    except Exception as e:  # LaunchError: the message holds each stderr
      print(f'FAILED: {e}', file=sys.stderr)
      return 1
    # gloo reports each connection on stdout; the demo's own output is the rest.
    shown = [
      line
      for line in results[0].stdout.splitlines(keepends=True)
      if not line.startswith('[Gloo]')
    ]
    print(''.join(shown), end='', flush=True)
    print('same run in 1 process x 8 devices, for comparison ...', flush=True)
    with contextlib.redirect_stdout(io.StringIO()) as single_out:
      code = demo_lib.run(steps, out=Path(tmp) / 'single')
    if code:
      print(single_out.getvalue())
      return code
    different = demo_lib.compare(Path(tmp) / 'single', Path(tmp) / 'multi')
  if different:
    print(f'FAILED: the {n}-process run differs from 1 process: {different}')
    return 1
  print(
    f'OK: same parameters as 1 process x 8 devices (rtol 1e-5), '
    f'from {n} processes x {8 // n} devices'
  )
  return 0
