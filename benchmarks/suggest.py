"""fsm.suggest on llama3-8b and a v5p:4x4x8 pod: how long, and what it ranks.

Runs ``flax-shardmeta suggest`` in a fresh process with an empty cache and the
default candidates (presets fsdp, fsdp+tp and tp, remat none and full, at most
8 compiled), times it against the 15-minute budget and publishes the ranked
table. Needs libtpu (``pip install '.[tpu]'``). Usage: ``python
benchmarks/suggest.py [--no-write] [--cache-dir DIR]``: with an empty DIR,
the compiled figures stay there, so the same command answers at once
afterwards (``FLAX_SHARDMETA_CACHE=DIR``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

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
]
BUDGET_S = 15 * 60


def cold_run(
  command: list[str], cache_dir: str | None = None
) -> tuple[float, subprocess.CompletedProcess[str], list[str]]:
  """Seconds, result and progress lines (one per compiled candidate) of
  ``flax_shardmeta *command`` in a fresh process with an empty cache."""
  with tempfile.TemporaryDirectory() as scratch:
    cache = cache_dir or scratch
    if os.path.isdir(cache) and os.listdir(cache):
      sys.exit(f'--cache-dir {cache} is not empty: the run would not be cold')
    start = time.perf_counter()
    result = subprocess.run(
      [sys.executable, '-m', 'flax_shardmeta', *command],
      capture_output=True,
      text=True,
      cwd=ROOT,
      env={**os.environ, 'FLAX_SHARDMETA_CACHE': cache},
    )
    seconds = time.perf_counter() - start
  compiled = [line for line in result.stderr.splitlines() if line.startswith('[')]
  return seconds, result, compiled


def cold_rows(
  command: list[str],
  cache_dir: str | None = None,
  extra: tuple[Callable[[str], str], ...] = (),
) -> tuple[list[str], bool, Any]:
  """A cold run of ``command`` as a table (wall time, candidates compiled,
  exit code, ``extra`` rows) and its progress lines; whether it met the
  targets; and the finished process."""
  seconds, result, compiled = cold_run(command, cache_dir)
  ok = seconds < BUDGET_S and result.returncode in (0, 1) and len(compiled) >= 8
  rows = [
    f'Command: `python -m flax_shardmeta {" ".join(command)}` '
    '(fresh process, empty cache).',
    '',
    '| measure | result | target |',
    '| --- | --- | --- |',
    f'| wall time | {seconds / 60:.1f} min | < {BUDGET_S // 60} min |',
    f'| candidates compiled | {len(compiled)} | >= 8 |',
    f'| exit code | {result.returncode} | 0 (something fits) |',
    *(row(result.stdout) for row in extra),
    '',
    'Progress (one line per compiled candidate):',
    '',
    '```text',
    *compiled,
    '```',
  ]
  if not ok:
    print(f'target missed: {seconds:.0f} s, exit {result.returncode}', file=sys.stderr)
    print(result.stderr[-3000:], file=sys.stderr)
  return rows, ok, result


def main(write: bool = True, cache_dir: str | None = None) -> int:
  info = machine()
  rows, ok, result = cold_rows(COMMAND, cache_dir)
  lines = [
    *rows,
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
  return 0 if ok else 1


if __name__ == '__main__':
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--no-write', action='store_true')
  parser.add_argument('--cache-dir')
  args = parser.parse_args()
  sys.exit(main(write=not args.no_write, cache_dir=args.cache_dir))
