"""What the ``flax-shardmeta`` subcommands share: errors, options, meshes, rules.

Nothing here imports jax or flax at module level: ``--help`` and argument
errors answer before either is loaded.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import textwrap
import tomllib
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

from flax_shardmeta.examples import state as example_state

REMAT = ('none', 'full', 'dots')
"""The built-in models' remat policies (``examples.linen.REMAT_POLICIES``)."""

OPTIMIZERS = ('adamw', 'adam', 'adafactor', 'sgd')
"""The built-in training step's optimizers (``examples.train.OPTIMIZERS``)."""
# Both kept in step with the examples by a test; repeated here so that argument
# errors are reported before jax and flax are imported.


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
    metavar='t5x|t5x-2d|JSON|FILE.json|FILE.toml',
    help='logical axis rules: a preset, an inline JSON list of [name, target] '
    "pairs or a file (default: the built-in model's own rules, t5x for --module)",
  )


def add_pod(p: argparse.ArgumentParser, *, required: bool) -> None:
  """``--topology GEN:SHAPE``, ``--num-slices`` and ``--target-config``."""
  without = '' if required else '; without it the figures are an estimate (default)'
  p.add_argument(
    '--topology',
    required=required,
    metavar='GEN:SHAPE',
    help='devices to compile for: a TPU pod, e.g. v5p:4x4x8 (pip install '
    "'flax_shardmeta[tpu]'), or a GPU cluster, <gpu>:<nodes>x<GPUs per node>, "
    'e.g. h100:4x8 (a100, h100, h200, b200, or custom:2x8 with --target-config; '
    f"pip install 'flax_shardmeta[gpu]'){without}"
    + (' (required)' if required else ''),
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


def check_model_name(name: str | None) -> None:
  """An unknown ``--model`` is a usage error listing the built-in ones."""
  names = example_state.MODEL_NAMES
  if name is not None and name not in names:
    raise UsageError(
      f'unknown model {name!r}; choose from {", ".join(names)} '
      'or pass --module PKG.MOD:FACTORY'
    )


def check_remat(text: str | None, policies: Sequence[str], *, builtin: bool) -> None:
  """``--remat``: the built-in models know :data:`REMAT`; a factory any name."""
  if not policies or (builtin and not set(policies) <= set(REMAT)):
    raise UsageError(f'--remat {text!r}: choose from {", ".join(REMAT)}')


def require_positive(args: argparse.Namespace, flags: Iterable[str]) -> None:
  """Each of ``flags`` (attribute names), when given, is at least 1."""
  for flag in flags:
    value = getattr(args, flag)
    if value is not None and value < 1:
      raise UsageError(f'--{flag.replace("_", "-")} {value}: must be at least 1')


def check_hbm(text: str | None, flag: str = '--hbm') -> None:
  """``--hbm`` (or another size ``flag``), when given, is a size (``95GiB``)."""
  if text is None:
    return
  from flax_shardmeta._devices.chips import parse_bytes
  from flax_shardmeta._errors import FitError

  try:
    parse_bytes(text)
  except FitError as e:
    raise UsageError(f'{flag}: {e}') from None


def check_gpu_run(args: argparse.Namespace) -> None:
  """``--reserve``, when given, is a size (``--mem-fraction`` is checked by
  the parser)."""
  check_hbm(args.reserve, '--reserve')


def gpu_run_options(args: argparse.Namespace) -> dict[str, Any]:
  """``mem_fraction=`` and ``reserve=`` for ``fsm.fit`` and ``fsm.suggest``,
  each only when its option is given (the library's defaults otherwise)."""
  given = {'mem_fraction': args.mem_fraction, 'reserve': args.reserve}
  return {k: v for k, v in given.items() if v is not None}


def parse_mesh(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
  """``'data=32,model=8'`` -> ``(('data', 'model'), (32, 8))``.

  Raises:
    UsageError: for anything else, saying what was expected.

  Example:
    >>> parse_mesh('data=32,model=8')
    (('data', 'model'), (32, 8))
  """
  names: list[str] = []
  sizes: list[int] = []
  for item in text.split(','):
    name, eq, size = item.strip().partition('=')
    name, size = name.strip(), size.strip()
    if not eq or not name or not name.isidentifier():
      raise UsageError(
        f'malformed --mesh {text!r}: expected AXIS=SIZE pairs separated by '
        "commas, e.g. 'data=32,model=8'"
      )
    if name in names:
      raise UsageError(f'--mesh {text!r} names axis {name!r} twice')
    if not size.isdigit() or int(size) < 1:
      raise UsageError(
        f'--mesh {text!r}: size of {name!r} is {size!r}; sizes must be '
        'positive integers'
      )
    names.append(name)
    sizes.append(int(size))
  return tuple(names), tuple(sizes)


def load_rules(spec: str) -> tuple[tuple[str, Any], ...]:
  """Rules from ``t5x``, ``t5x-2d``, inline JSON or a JSON / TOML file.

  JSON: a list of ``[name, target]`` pairs, given inline (``'[["batch",
  "data"]]'``) or in a file. TOML: ``rules = [[name, target], ...]``. A target
  is a mesh axis, a list of mesh axes, or null for replicated; TOML has no
  null, so an empty list ``[]`` means replicated there (and in JSON too).

  Raises:
    UsageError: if the text or file does not hold valid rules.

  Example:
    >>> load_rules('[["batch", "data"], ["embed", null]]')
    (('batch', 'data'), ('embed', None))
  """
  if spec in ('t5x', 't5x-2d'):
    from flax_shardmeta._standard_rules import standard_logical_axis_rules

    if spec == 't5x-2d':
      return standard_logical_axis_rules(1, 2)
    return standard_logical_axis_rules()
  if spec.lstrip().startswith('['):  # inline JSON: a file name never starts so
    try:
      data = json.loads(spec)
    except ValueError as e:
      raise UsageError(f'cannot parse --rules {spec!r} as JSON: {e}') from None
    return _rule_pairs(data, f'--rules {spec!r}')
  try:
    with open(spec, 'rb') as f:
      raw = f.read()
  except OSError as e:
    raise UsageError(f'cannot read rules file {spec!r}: {e.strerror}') from None
  try:
    if spec.endswith('.toml'):
      data = tomllib.loads(raw.decode()).get('rules')
    else:
      data = json.loads(raw)
  except (ValueError, UnicodeDecodeError) as e:
    raise UsageError(f'cannot parse rules file {spec!r}: {e}') from None
  return _rule_pairs(data, f'rules file {spec!r}')


def _rule_pairs(data: Any, where: str) -> tuple[tuple[str, Any], ...]:
  if not isinstance(data, list):
    raise UsageError(
      f'{where} must hold a list of [name, target] pairs '
      '(TOML: rules = [[name, target], ...])'
    )
  # An empty list target means replicated, the only way to say None in TOML.
  pairs: Any = [
    (r[0], None if r[1] == [] else r[1]) if isinstance(r, list) and len(r) == 2 else r
    for r in data
  ]
  # The rule engine (and with it jax) only once the file has been read.
  from flax_shardmeta._rules import normalize_rules

  try:
    return normalize_rules(pairs)
  except ValueError as e:
    raise UsageError(f'{where}: {e}') from None


def command_rules(args: argparse.Namespace) -> tuple[tuple[str, Any], ...]:
  """``--rules``, else the built-in model's own rules, else T5X's."""
  if args.rules:
    return load_rules(args.rules)
  if args.model is not None:
    return example_state.model_rules(args.model)
  return load_rules('t5x')


def note_default_rules(args: argparse.Namespace) -> None:
  """One line on stderr when :func:`command_rules` fell back to T5X's rules
  (your own model, no ``--rules``): a layout from rules nobody chose should
  say whose they are. Said with the output, so that errors stay one line."""
  if not args.rules and args.model is None:
    print(
      'flax-shardmeta: rules: T5X defaults (pass --rules t5x-2d, inline JSON or '
      'a JSON / TOML file to choose)',
      file=sys.stderr,
    )


def mesh_rules(
  args: argparse.Namespace, axis_names: tuple[str, ...]
) -> tuple[tuple[str, Any], ...]:
  """The command's rules (:func:`command_rules`), checked against the mesh's
  axis names for a misspelt axis (:func:`check_mesh_axis_names`)."""
  rules = command_rules(args)
  check_mesh_axis_names(args.mesh, axis_names, rules)
  return rules


def param_dtype(args: argparse.Namespace) -> Any:
  """``--dtype`` as a jax dtype (imports jax: call once the arguments are good)."""
  import jax.numpy as jnp

  return jnp.bfloat16 if args.dtype == 'bfloat16' else jnp.float32


def _rule_axes(target: Any) -> tuple[str, ...]:
  if isinstance(target, str):
    return (target,)
  return tuple(a for a in (target or ()) if isinstance(a, str))


def misspelt_axis(
  axes: Sequence[str], rules: Iterable[Sequence[Any]]
) -> tuple[str, str] | None:
  """``(in_rules, in_axes)``: a mesh axis the rules shard over that ``axes``
  lacks, spelled like one of ``axes`` that no rule uses; else None.

  Example:
    >>> misspelt_axis(('data', 'modle'), [('batch', 'data'), ('mlp', 'model')])
    ('model', 'modle')
  """
  rules = [
    tuple(r)
    for r in rules
    if isinstance(r, Sequence) and not isinstance(r, str) and len(r) == 2
  ]
  used = {a for _, target in rules for a in _rule_axes(target)}
  unused = [a for a in axes if a not in used]
  for _, target in rules:
    for axis in _rule_axes(target):
      close = difflib.get_close_matches(axis, unused, n=1) if axis not in axes else []
      if close:
        return axis, close[0]
  return None


def check_mesh_axis_names(
  text: str, axis_names: tuple[str, ...], rules: tuple[tuple[str, Any], ...]
) -> None:
  """A mesh axis the rules never use, spelled like one they use but the mesh
  lacks, is a typo: say so once, instead of a problem per array."""
  typo = misspelt_axis(axis_names, rules)
  if typo is not None:
    wanted, given = typo
    raise UsageError(
      f'--mesh {text!r}: no rule uses mesh axis {given!r}, and the rules '
      f'shard over {wanted!r}, which the mesh lacks: did you mean {wanted!r}?'
    )
