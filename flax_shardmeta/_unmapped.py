"""Logical names no rule maps: ``strict=`` errors and the mesh-axis-name warning.

A logical name without a usable rule is replicated. That is the documented
fallback, but two cases deserve a word: with ``strict=True`` every such name
is a problem, and in any mode a name that is also a mesh-axis name gets one
:class:`UnmappedMeshAxisNameWarning` per call, since mesh axes were most
likely meant. Callers collect one :class:`Unmapped` record per leaf concerned
(paths are made only if something is reported) and hand them to :func:`report`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from flax_shardmeta._errors import (
  ShardingProblem,
  UnmappedMeshAxisNameWarning,
  unmapped_hint,
)

MAX_PATHS = 10
"""Paths listed per warning; the rest are counted."""


@dataclasses.dataclass
class Unmapped:
  """A leaf whose logical names include some that no rule maps.

  Attributes:
    path: the leaf's path, or a function making it (called only if needed).
    shape: the leaf's shape, if known.
    names: the annotation as written.
    spec: the resolved spec (those names replicated).
    unmapped: the logical names no rule maps, in dimension order.
  """

  path: str | Callable[[], str]
  shape: tuple[int, ...] | None
  names: tuple[Any, ...]
  spec: Any
  unmapped: tuple[str, ...]

  def path_text(self) -> str:
    return self.path() if callable(self.path) else self.path


def unmapped_names(
  names: Sequence[Any], resolved: Sequence[Any], unassigned: Any
) -> tuple[str, ...]:
  """The string names whose resolution is ``unassigned``."""
  return tuple(
    n for n, r in zip(names, resolved) if r is unassigned and isinstance(n, str)
  )


def report(
  records: Iterable[Unmapped],
  mesh_axis_names: Iterable[str],
  strict: bool,
  *,
  stacklevel: int = 3,
  also: str = '',
) -> list[ShardingProblem]:
  """Warns about mesh-axis names (non-strict) and returns the strict problems.

  Args:
    records: the leaves with unmapped names, in tree order.
    mesh_axis_names: the axes of the mesh in use (empty if none is known).
    strict: whether every unmapped name is a problem.
    stacklevel: passed to ``warnings.warn`` (2 + the caller's depth below the
      user's call).
    also: one more way out the caller offers, appended to the warning.

  Returns:
    With ``strict``, one problem per unmapped name and leaf; else ``[]``.
  """
  records = list(records)
  if not records:
    return []
  axes = frozenset(mesh_axis_names)
  if strict:
    return [
      ShardingProblem(
        r.path_text(),
        r.shape,
        r.names,
        r.spec,
        f"no usable rule maps logical name '{n}' (strict=True); "
        'fsm.explain_resolution shows which rules were tried',
        unmapped_hint(n)
        if n in axes
        else f"add a rule such as ('{n}', 'model'), or ('{n}', None) to "
        'replicate it on purpose',
        tuple(i for i, m in enumerate(r.names) if m == n),
      )
      for r in records
      for n in r.unmapped
    ]
  by_name: dict[str, list[Unmapped]] = {}
  for r in records:
    for n in r.unmapped:
      if n in axes:
        by_name.setdefault(n, []).append(r)
  for name, where in by_name.items():
    shown = [r.path_text() for r in where[:MAX_PATHS]]
    more = len(where) - len(shown)
    listed = ', '.join(shown) + (f' and {more} more' if more else '')
    warnings.warn(
      f"Logical name '{name}' is not mapped by any rule, so it was "
      f'replicated, but it is also a mesh-axis name: {unmapped_hint(name)} '
      f'{also}Concerned: {listed}.',
      UnmappedMeshAxisNameWarning,
      stacklevel=stacklevel,
    )
  return []
