"""The ``flax-shardmeta`` parser, built from each command's module, and ``main``.

Each command (``demo``, ``plan``, ``fit``, ``suggest``, ``snapshot``, ``diff``,
``restore-plan``, ``audit``, ``explain``) is a module of this package with the shape of
:class:`Command`; adding one is adding a module and a line to :data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from typing import Protocol

from flax_shardmeta import FlaxShardmetaError
from flax_shardmeta.cli import (
  audit,
  demo,
  diff,
  explain,
  fit,
  options,
  plan,
  process,
  restore_plan,
  snapshot,
  suggest,
)


class Command(Protocol):
  """What a command's module holds: its ``--help`` texts, options and run."""

  # Read-only, as a module's constants are to the parser.
  @property
  def HELP(self) -> str:
    """One line in ``flax-shardmeta --help``."""
    ...

  @property
  def DESCRIPTION(self) -> str:
    """The first paragraph of the command's own ``--help``."""
    ...

  @property
  def EPILOG(self) -> str:
    """The rest of its ``--help`` (docstring markup is removed)."""
    ...

  def add_arguments(self, p: argparse.ArgumentParser) -> None:
    """Adds the command's options to ``p``."""
    ...

  def run(self, args: argparse.Namespace) -> int:
    """Runs the command on parsed arguments; returns the exit code."""
    ...


COMMANDS: dict[str, Command] = {
  'demo': demo,
  'plan': plan,
  'fit': fit,
  'suggest': suggest,
  'snapshot': snapshot,
  'diff': diff,
  'restore-plan': restore_plan,
  'audit': audit,
  'explain': explain,
}
"""Each subcommand's module, in the order ``flax-shardmeta --help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
  """The whole command line: one subparser per entry of :data:`COMMANDS`."""
  parser = options.Parser(
    prog='flax-shardmeta',
    description='Lay Flax models out on device meshes: plan a layout without '
    'devices, see whether a training step fits a TPU pod, search for the best '
    'layout, or run the demo on 8 simulated CPU devices.',
    formatter_class=options.HelpFormatter,
  )
  sub = parser.add_subparsers(
    dest='command',
    required=True,
    parser_class=options.Parser,
    metavar='{plan,fit,suggest,snapshot,diff,restore-plan,audit,explain,demo}',
  )
  for name, command in COMMANDS.items():
    p = options.add_command(
      sub,
      name,
      help=command.HELP,
      description=command.DESCRIPTION,
      epilog=command.EPILOG,
    )
    command.add_arguments(p)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of ``flax-shardmeta`` and ``python -m flax_shardmeta``.

  Example:
    >>> main(['plan', '--model', 'mlp', '--mesh', 'data=0'])
    2
  """
  process.local_jax_on_cpu()
  args = None
  try:
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command].run(args)
  except options.UsageError as e:
    shown = e.cause is not None and getattr(args, 'traceback', False)
    if shown:
      traceback.print_exception(e.cause)
    hint = ' (--traceback shows where)' if e.cause is not None and not shown else ''
    print(f'flax-shardmeta: error: {e}{hint}', file=sys.stderr)
    return 2
  except FlaxShardmetaError as e:  # a layout that cannot be, a topology unknown...
    # The command that explains it at the end of the line: a one-line error
    # stays one line.
    print(f'flax-shardmeta: error: {e.message} {e.errors_page}', file=sys.stderr)
    return 2
  except SystemExit as e:  # --help
    return e.code if isinstance(e.code, int) else 0
