"""Checking the command's arguments before anything is built: model names,
remat policies, sizes, meshes, mesh-axis names; each fault one
:class:`~flax_shardmeta.cli.options.UsageError` naming the flag and the fix.

Nothing here imports jax or flax at module level.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from typing import Any

from flax_shardmeta.cli.options import REMAT, UsageError
from flax_shardmeta.examples import state as example_state


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
  import flax_shardmeta as fsm

  try:
    fsm.parse_bytes(text)
  except fsm.SizeError as e:
    raise UsageError(f'{flag}: {e.message}') from None


def check_gpu_run(args: argparse.Namespace) -> None:
  """``--hbm`` and ``--reserve``, when given, are sizes (``--mem-fraction`` is
  checked by the parser), and the two GPU options come with a GPU."""
  for flag, text in (('--hbm', args.hbm), ('--reserve', args.reserve)):
    check_hbm(text, flag)
  check_gpu_only(args)


def check_gpu_only(args: argparse.Namespace) -> None:
  """``--mem-fraction`` and ``--reserve`` size a GPU run's allocator pool: on
  a TPU, or with no GPU named, they would do nothing, so they are refused."""
  import flax_shardmeta as fsm

  given = [
    f'{flag} {value}'
    for flag, value in (
      ('--mem-fraction', args.mem_fraction),
      ('--reserve', args.reserve),
    )
    if value is not None
  ]
  if not given:
    return
  chip = getattr(args, 'chip', None)
  if args.topology:
    if fsm.is_gpu_topology(args.topology):
      return
    where = f'--topology {args.topology} is not a GPU cluster'
  else:
    named = fsm.chip_named(chip) if chip else None
    if named is not None and named.is_gpu:
      return
    where = (
      f'--chip {chip} is not a GPU'
      if chip
      else 'no GPU is named (no GPU --topology or --chip)'
    )
  raise UsageError(
    f"{given[0]}: applies to GPU runs only (the memory of jax's GPU allocator), "
    f'and {where}; leave it out, or name a GPU: --topology h100:1x8 or --chip h100'
  )


def step_arguments(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[int, ...]]:
  """Every check of a step's options (``fit``, ``snapshot``) before jax
  starts; the mesh's names and sizes.

  Raises:
    UsageError: the first bad option, saying what was expected.
  """
  check_model_name(args.model)
  names, sizes = parse_mesh(args.mesh)
  if args.remat is not None:
    check_remat(args.remat, [args.remat], builtin=args.model is not None)
  require_positive(args, ('batch', 'seq', 'num_slices'))
  check_gpu_run(args)
  return names, sizes


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


def check_mesh_axis_names(
  text: str, axis_names: tuple[str, ...], rules: tuple[tuple[str, Any], ...]
) -> None:
  """A mesh axis the rules never use, spelled like one they use but the mesh
  lacks, is a typo: say so once, instead of a problem per array."""
  # The core's: fsm.plan's problems give the same "did you mean" fix.
  from flax_shardmeta import misspelt_axis

  typo = misspelt_axis(axis_names, rules)
  if typo is not None:
    wanted, given = typo
    raise UsageError(
      f'--mesh {text!r}: no rule uses mesh axis {given!r}, and the rules '
      f'shard over {wanted!r}, which the mesh lacks: did you mean {wanted!r}?'
    )
