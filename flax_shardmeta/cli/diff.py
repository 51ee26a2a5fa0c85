"""``flax-shardmeta diff``: what changed between two layout snapshots.

Reads two files written by ``flax-shardmeta snapshot`` (or by
``fsm.testing.assert_snapshot``) and prints one line per difference: a
parameter's spec, a new or removed parameter, a sharding constraint's layout,
a collective that appears, goes or moves more bytes (changes under 1% are not
differences).

Exit codes: 0 the layouts are the same, 1 they differ, 2 a file that cannot
be read or holds no snapshot (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from flax_shardmeta.cli import options

HELP = 'what changed between two layout snapshots'
DESCRIPTION = 'Compare two layout snapshots (from flax-shardmeta snapshot).'
EPILOG = (__doc__ or '').split('\n\n', 1)[1]


def add_arguments(p: argparse.ArgumentParser) -> None:
  """The ``diff`` subcommand's arguments: the two files."""
  p.add_argument('old', metavar='OLD.json', help='the snapshot before')
  p.add_argument('new', metavar='NEW.json', help='the snapshot after')


def run(args: argparse.Namespace) -> int:
  """The ``diff`` subcommand; returns the exit code."""
  old, new = _read(args.old), _read(args.new)
  import flax_shardmeta as fsm

  # Each file checked under its own name: which one to correct (exit 2).
  lines = fsm.snapshot_diff(old, new, names=(args.old, args.new))
  for line in lines:
    print(line)
  return 1 if lines else 0


def _read(path: str) -> Any:
  try:
    with open(path) as f:
      return json.load(f)
  except OSError as e:
    raise options.UsageError(f'cannot read {path!r}: {e.strerror}') from None
  except ValueError as e:  # UnicodeDecodeError included
    raise options.UsageError(f'{path!r} holds no JSON: {e}') from None
