"""fsm.suggest on llama3-8b and a v5p:4x4x8 pod: how long, and what it ranks.

Runs ``flax-shardmeta suggest`` in a fresh process with the cache off and the
default candidates (presets fsdp, fsdp+tp and tp, remat none and full, at most
8 compiled), times it against the 15-minute budget and publishes the ranked
table. Needs libtpu (``pip install '.[tpu]'``). Usage: ``python
benchmarks/suggest.py [--no-write]``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

from _common import ROOT, machine, machine_line, publish

COMMAND = [
  'suggest',
  '--model',
  'llama3-8b',
  '--topology',
  'v5p:4x4x8',
  '--batch',
  '256',
  '--seq',
  '2048',
  '--top',
  '8',
  '--no-cache',
]
BUDGET_S = 15 * 60


def main(write: bool = True) -> int:
  info = machine()
  with tempfile.TemporaryDirectory() as cache:
    start = time.perf_counter()
    result = subprocess.run(
      [sys.executable, '-m', 'flax_shardmeta', *COMMAND],
      capture_output=True,
      text=True,
      cwd=ROOT,
      env={**os.environ, 'FLAX_SHARDMETA_CACHE': cache},
    )
    seconds = time.perf_counter() - start
  compiled = [line for line in result.stderr.splitlines() if line.startswith('[')]
  ok = seconds < BUDGET_S and result.returncode in (0, 1) and len(compiled) >= 8
  lines = [
    f'Command: `python -m flax_shardmeta {" ".join(COMMAND)}` '
    '(fresh process, cache off).',
    '',
    '| measure | result | target |',
    '| --- | --- | --- |',
    f'| wall time | {seconds / 60:.1f} min | < {BUDGET_S // 60} min |',
    f'| candidates compiled | {len(compiled)} | >= 8 |',
    f'| exit code | {result.returncode} | 0 (something fits) |',
    '',
    'Progress (one line per compiled candidate):',
    '',
    '```text',
    *compiled,
    '```',
    '',
    'The ranked table and the explanation of the first choice:',
    '',
    '```text',
    result.stdout.rstrip(),
    '```',
    '',
    machine_line(info),
  ]
  publish('## Choosing a layout: fsm.suggest', lines, write)
  if not ok:
    print(f'target missed: {seconds:.0f} s, exit {result.returncode}', file=sys.stderr)
    print(result.stderr[-3000:], file=sys.stderr)
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main(write='--no-write' not in sys.argv))
