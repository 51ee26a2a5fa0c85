"""Start-up: importing the package, and the command line's help and usage errors.

Each command runs in a fresh process (start-up is what is measured), the
commands taking turns (A B C ... A B C ...) so the load of the shared machine
spreads evenly; medians per command.

* ``import flax_shardmeta`` and ``import flax_shardmeta`` followed by the first
  use of its Linen API (``fsm.get_sharding``, ``fsm.plan``, the boxes,
  ``fsm.sharded_init``: what a Linen user loads) against ``import flax.linen``.
  Target: no slower than ``import flax.linen`` + 0.1 s.
* ``flax-shardmeta plan --help`` and a usage error, through ``python -m`` and
  the console script. Target: under 0.3 s.

Usage: ``python benchmarks/startup.py [--rounds N] [--no-write]``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import ROOT, machine, machine_line, publish

SECTION = '## Start-up: import and command line'
PYTHON = sys.executable
SCRIPT = str(Path(sys.executable).parent / 'flax-shardmeta')
LINEN_API = (
  'import flax_shardmeta as fsm; '
  'fsm.get_sharding, fsm.plan, fsm.with_logical_partitioning, fsm.sharded_init'
)
COMMANDS = {
  'python': [PYTHON, '-c', 'pass'],
  'flax.linen': [PYTHON, '-c', 'import flax.linen'],
  'flax.linen + flax.nnx': [PYTHON, '-c', 'import flax.linen, flax.nnx'],
  'fsm': [PYTHON, '-c', 'import flax_shardmeta'],
  'fsm Linen API': [PYTHON, '-c', LINEN_API],
  'help -m': [PYTHON, '-m', 'flax_shardmeta', 'plan', '--help'],
  'error -m': [PYTHON, '-m', 'flax_shardmeta', 'plan', '--model', 'x', '--mesh', 'a=1'],
  'help script': [SCRIPT, 'plan', '--help'],
  'error script': [SCRIPT, 'plan', '--model', 'mlp', '--mesh', 'data=0'],
}
IMPORT_SLACK = 0.1
CLI_SECONDS = 0.3


def run(argv: list[str]) -> float:
  start = time.perf_counter()
  subprocess.run(argv, cwd=ROOT, capture_output=True, check=False)
  return time.perf_counter() - start


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--rounds', type=int, default=9)
  parser.add_argument('--no-write', action='store_true')
  args = parser.parse_args()
  info = machine()
  for argv in COMMANDS.values():  # warm the file cache
    run(argv)
  times: dict[str, list[float]] = {name: [] for name in COMMANDS}
  for _ in range(args.rounds):
    for name, argv in COMMANDS.items():
      times[name].append(run(argv))
  t = {name: statistics.median(v) for name, v in times.items()}
  linen = t['flax.linen']
  rows = [
    ('`import flax.linen`', 'flax.linen', '(baseline)'),
    (
      '`import flax.linen, flax.nnx` (what `import flax_shardmeta` loaded before)',
      'flax.linen + flax.nnx',
      '-',
    ),
    ('`import flax_shardmeta`', 'fsm', f'<= flax.linen + {IMPORT_SLACK} s'),
    (
      '`import flax_shardmeta`, then its Linen API used (`get_sharding`, `plan`, '
      'boxes, `sharded_init`)',
      'fsm Linen API',
      f'<= flax.linen + {IMPORT_SLACK} s',
    ),
  ]
  ok = True
  lines = [
    'Command: `python benchmarks/startup.py` (each command in a fresh process, '
    f'{args.rounds} rounds taking turns after a warm-up; medians, wall time '
    'including Python start-up).',
    '',
    '| import | median (s) | minus `import flax.linen` | target |',
    '| --- | --- | --- | --- |',
  ]
  for label, name, target in rows:
    if target.startswith('<='):
      ok &= t[name] <= linen + IMPORT_SLACK
    lines.append(f'| {label} | {t[name]:.3f} | {t[name] - linen:+.3f} s | {target} |')
  lines += [
    '',
    '| command | median (s) | x `python -c pass` | target |',
    '| --- | --- | --- | --- |',
  ]
  for label, name in (
    ('`python -m flax_shardmeta plan --help`', 'help -m'),
    ('`python -m flax_shardmeta plan --model x --mesh a=1` (usage error)', 'error -m'),
    ('`flax-shardmeta plan --help`', 'help script'),
    ('`flax-shardmeta plan --model mlp --mesh data=0` (usage error)', 'error script'),
  ):
    ok &= t[name] < CLI_SECONDS
    lines.append(
      f'| {label} | {t[name]:.3f} | {t[name] / t["python"]:.1f}x | < {CLI_SECONDS} s |'
    )
  lines += [
    '',
    f'`python -c pass` takes {t["python"]:.3f} s here. Importing the package '
    'loads none of its modules: each public name is imported from its module '
    'when first used (PEP 562), so the command line parses its arguments and '
    'prints help or a usage error before jax is imported, and Linen users '
    'never load flax.nnx (`fsm.nnx`, or the first NNX Variable the library '
    'meets, loads it). A test checks both in fresh processes, without timing.',
    '',
    machine_line(info),
  ]
  publish(SECTION, lines, write=not args.no_write)
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
