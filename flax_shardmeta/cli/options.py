"""The ``flax-shardmeta`` command's options: the parser and its help text, the
options the subcommands share, and the one error a bad argument raises
(:class:`UsageError`).

Nothing here imports jax or flax: ``--help`` and argument errors answer before
either is loaded.
"""

from __future__ import annotations

import argparse
import textwrap
from typing import Any, NoReturn

from flax_shardmeta.examples import state as example_state

REMAT = ('none', 'full', 'dots')
"""The built-in models' remat policies (``examples.linen.REMAT_POLICIES``),
kept in step with them by a test: repeated here so that argument errors are
reported before jax and flax are imported."""

OPTIMIZERS = example_state.TRAINING_OPTIMIZERS
"""The built-in training step's optimizers: the examples' one table (importing
it imports neither jax nor flax)."""


class UsageError(Exception):
  """A bad command-line argument, or your factory failing: one line, exit code 2.

  Attributes:
    cause: the exception your code raised, printed in full with ``--traceback``.
  """

  def __init__(self, message: str, *, cause: BaseException | None = None) -> None:
    super().__init__(message)
    self.cause = cause


class Parser(argparse.ArgumentParser):
  """argparse, but errors raise instead of printing usage and exiting."""

  def error(self, message: str) -> NoReturn:
    raise UsageError(message)


class HelpFormatter(
  argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter
):
  """Descriptions kept as written; every option's help ends with its default."""

  def _get_help_string(self, action: argparse.Action) -> str:
    text = action.help or ''
    if 'default' in text or action.default in (None, argparse.SUPPRESS):
      return text  # said in the text, or required
    if action.nargs == 0:  # a flag
      return f'{text} (default: off)'
    return f'{text} (default: %(default)s)'


def plain(text: str) -> str:
  """Docstring text as --help shows it: no reStructuredText markup, each
  paragraph (and each ``* `` item) refilled to the terminal's usual width.

  Example:
    >>> print(plain('``--mesh`` is\\n  required.\\n\\n* one\\n* two'))
    --mesh is required.
    <BLANKLINE>
    * one
    * two
  """
  paragraphs = []
  for paragraph in text.replace('``', '').strip().split('\n\n'):
    first, *items = ('\n' + paragraph).split('\n* ')
    filled = [_fill(first)] if first.strip() else []
    paragraphs.append('\n'.join(filled + [_fill(item, '* ') for item in items]))
  return '\n\n'.join(paragraphs)


def _fill(text: str, bullet: str = '') -> str:
  # Options (--mesh) and calls (fsm.LogicalPartitioned(...)) stay whole.
  return textwrap.fill(
    ' '.join(text.split()),
    79,
    initial_indent=bullet,
    subsequent_indent=' ' * len(bullet),
    break_on_hyphens=False,
    break_long_words=False,
  )


def positive(text: str) -> int:
  """argparse ``type=`` for a count of at least 1."""
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f'expected a positive integer, got {text!r}')
  return value


def fraction(text: str) -> float:
  """argparse ``type=`` for a fraction in (0, 1]."""
  try:
    value = float(text)
  except ValueError:
    value = 0.0
  if not 0 < value <= 1:  # also refuses nan
    raise argparse.ArgumentTypeError(
      f'expected a fraction greater than 0 and at most 1, e.g. 0.9, got {text!r}'
    )
  return value


def reserve_size(text: str) -> str:
  """argparse ``type=`` for ``--reserve``: a size of 0 or more (parsed later)."""
  if text.strip().startswith('-'):
    raise argparse.ArgumentTypeError(
      f'{text!r} is below 0; give 0 or more, e.g. 2GiB or 0'
    )
  return text


def add_command(
  sub: Any, name: str, *, help: str, description: str, epilog: str = ''
) -> argparse.ArgumentParser:
  """A subcommand whose ``--help`` shows every default and no markup."""
  return sub.add_parser(
    name,
    help=help,
    description=description,
    epilog=plain(epilog),
    formatter_class=HelpFormatter,
  )


def add_model_or_module(p: argparse.ArgumentParser, mine: str) -> None:
  """``--model NAME`` or ``--module PKG.MOD:FACTORY``, one of them required."""
  which = p.add_mutually_exclusive_group(required=True)
  names = ', '.join(example_state.MODEL_NAMES)
  which.add_argument('--model', help=f'a built-in model: {names}')
  which.add_argument('--module', metavar='PKG.MOD:FACTORY', help=mine)


def add_mesh(p: argparse.ArgumentParser, example: str) -> None:
  """``--mesh AXIS=SIZE,...`` (required)."""
  p.add_argument(
    '--mesh',
    required=True,
    metavar='AXIS=SIZE,...',
    help=f'mesh axes and sizes, e.g. {example} (required)',
  )


def add_rules(p: argparse.ArgumentParser) -> None:
  """``--rules``: a preset, inline JSON or a file (see :func:`load_rules`)."""
  p.add_argument(
    '--rules',
    metavar='t5x-1d|t5x-2d|JSON|FILE.json|FILE.toml',
    help='logical axis rules: a preset, an inline JSON list of [name, target] '
    "pairs or a file (default: the built-in model's own rules, t5x-1d for "
    '--module; t5x is its short name)',
  )


def add_pod(p: argparse.ArgumentParser, *, required: bool) -> None:
  """``--topology GEN:SHAPE``, ``--num-slices`` and ``--target-config``."""
  without = '' if required else '; without it the figures are an estimate (default)'
  p.add_argument(
    '--topology',
    required=required,
    metavar='GEN:SHAPE',
    help='devices to compile for: a TPU pod, e.g. v5p:4x4x8 (from a checkout: '
    "pip install '.[tpu]'), or a GPU cluster, <gpu>:<nodes>x<GPUs per node>, "
    'e.g. h100:4x8 (a100, h100, h200, b200, or custom:2x8 with --target-config; '
    f"pip install '.[gpu]'){without}" + (' (required)' if required else ''),
  )
  p.add_argument('--num-slices', type=int, default=1, help='slices of a TPU topology')
  p.add_argument(
    '--target-config',
    metavar='FILE',
    help='with --topology custom:NxG: the GPU, as an XLA GpuTargetConfigProto '
    'text file (default: none; a100, h100, h200 and b200 are described by '
    'flax_shardmeta)',
  )


def add_step(p: argparse.ArgumentParser, *, remat: str, batch_required: bool) -> None:
  """A training step's options, and ``--hbm`` to judge it against."""
  p.add_argument(
    '--batch',
    type=int,
    required=batch_required,
    help='global batch size'
    + (' (required)' if batch_required else ' (default: 8 for a built-in model)'),
  )
  p.add_argument(
    '--seq', type=int, help='tokens per sequence (default: 2048 for a built-in model)'
  )
  p.add_argument('--remat', help=remat)
  p.add_argument(
    '--optimizer',
    choices=OPTIMIZERS,
    default='adamw',
    help="a built-in model's optimizer",
  )
  p.add_argument(
    '--hbm', help="memory per chip to judge against, e.g. 95GiB (default: the chip's)"
  )
  p.add_argument(
    '--mem-fraction',
    type=fraction,
    metavar='FLOAT',
    help="GPU runs: the fraction of each GPU's memory jax's allocator takes "
    "(XLA_CLIENT_MEM_FRACTION; default: the environment's, else jax's 0.75)",
  )
  p.add_argument(
    '--reserve',
    type=reserve_size,
    metavar='SIZE',
    help="GPU runs: memory held outside XLA's pool per GPU (CUDA context, "
    "NCCL); default: the project's table",
  )


def add_front_end(p: argparse.ArgumentParser, *, api: str, dtype: str) -> None:
  """``--api`` and ``--dtype``."""
  p.add_argument('--api', choices=('linen', 'nnx'), default='linen', help=api)
  p.add_argument(
    '--dtype',
    choices=('float32', 'bfloat16'),
    default=dtype,
    help="a built-in model's parameter dtype",
  )


def add_output(p: argparse.ArgumentParser, *, table: str, cache: bool) -> None:
  """``--format``, ``--traceback`` (and ``--no-cache``)."""
  if cache:
    p.add_argument(
      '--no-cache', action='store_true', help='compile even if the figures are cached'
    )
  p.add_argument(
    '--format', choices=('table', 'json'), default='table', help=f'output: {table}'
  )
  p.add_argument(
    '--traceback',
    action='store_true',
    help='when your factory or its model fails, print the whole traceback',
  )


def add_optimizer(p: argparse.ArgumentParser, what: str) -> None:
  """``--optimizer``: the built-in optimizer whose state comes with the
  parameters (``what``: planned, restored...)."""
  from flax_shardmeta.examples import state as example_state

  p.add_argument(
    '--optimizer',
    choices=example_state.OPTIMIZERS,
    default='adam',
    help=f'optimizer state {what} with the parameters',
  )


def add_state(p: argparse.ArgumentParser, what: str) -> None:
  """The abstract state a layout is made for: ``--rules``, ``--optimizer``
  (its state ``what`` with the parameters), ``--api`` and ``--dtype``."""
  add_rules(p)
  add_optimizer(p, what)
  add_front_end(p, api='the Flax front end', dtype='float32')
