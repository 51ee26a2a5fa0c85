"""``flax-shardmeta explain``: the errors page's section on an error or warning.

Every message flax_shardmeta raises or warns ends with the command that prints
its section, e.g. ``(what to do: flax-shardmeta explain ShardingError)``. The
page is part of the installed package, so this works without the repository
or the documentation site. The name is the class name in any case, with or
without a module (``fsm.ShardingError``); with no name the sections are
listed, one line each.
"""

from __future__ import annotations

import argparse

from flax_shardmeta.cli.options import UsageError

HELP = 'what an error or warning means and what to do about it'
DESCRIPTION = (
  "Prints the errors page's section on an error or warning class: what raises "
  'it, a message as it reads, and what to do. Every message names the command.'
)
EPILOG = (__doc__ or '').split('\n\n', 1)[1]


def add_arguments(p: argparse.ArgumentParser) -> None:
  """The ``explain`` subcommand's options."""
  p.add_argument(
    'name',
    nargs='?',
    metavar='NAME',
    help='an error or warning class, e.g. ShardingError (none: list them)',
  )


def run(args: argparse.Namespace) -> int:
  """The ``explain`` subcommand; returns the exit code."""
  import flax_shardmeta as fsm

  try:
    print(fsm.explain_error(args.name), end='')
  except LookupError as e:
    raise UsageError(str(e)) from None
  return 0
