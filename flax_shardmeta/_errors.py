"""Errors raised by flax_shardmeta, and the problem records they carry."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from jax.sharding import PartitionSpec


def format_spec(spec: Any) -> str:
  """Short, stable rendering of a PartitionSpec or names tuple."""
  if spec is None:
    return 'None'
  entries = ', '.join(_format_entry(e) for e in tuple(spec))
  # jax >= 0.9 names the class `P`, so the type is checked, not its name.
  if isinstance(spec, PartitionSpec):
    return f'P({entries})'
  return f'({entries}{"," if len(tuple(spec)) == 1 else ""})'


def _format_entry(entry: Any) -> str:
  if isinstance(entry, str):
    return repr(entry)
  if isinstance(entry, tuple):
    return '(' + ', '.join(_format_entry(e) for e in entry) + ')'
  if entry is None:
    return 'None'
  return 'UNCONSTRAINED' if 'UNCONSTRAINED' in repr(entry) else repr(entry)


@dataclasses.dataclass(frozen=True)
class ShardingProblem:
  """One thing wrong with one leaf's sharding.

  Attributes:
    path: '/'-joined key path of the leaf, e.g. ``params/Dense_0/kernel``.
    shape: the leaf's shape (None when unknown).
    names: the annotation as written (None for an unannotated leaf).
    spec: the resolved PartitionSpec (None when resolution itself failed).
    reason: what is wrong.
    hint: how to fix it.
    dims: the array dimensions concerned (used by fit mode to replicate them).
  """

  path: str
  shape: tuple[int, ...] | None
  names: Any
  spec: Any
  reason: str
  hint: str
  dims: tuple[int, ...] = ()

  def __str__(self) -> str:
    return (
        f'{self.path}: shape {self.shape}, names {format_spec(self.names)}, '
        f'spec {format_spec(self.spec)}: {self.reason}. Fix: {self.hint}'
    )

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form."""
    return {
        'path': self.path,
        'shape': list(self.shape) if self.shape is not None else None,
        'names': format_spec(self.names) if self.names is not None else None,
        'spec': format_spec(self.spec) if self.spec is not None else None,
        'reason': self.reason,
        'hint': self.hint,
    }


class FlaxShardmetaError(ValueError):
  """Base of every error flax_shardmeta raises.

  A ``ValueError``, so code that already catches bad values keeps working;
  ``except fsm.FlaxShardmetaError`` catches exactly this library's errors.
  """


class ShardingError(FlaxShardmetaError):
  """Raised when annotations cannot become a valid sharding.

  Every problem found in a tree is listed in one message, each naming the
  parameter path, its shape, its names, the resolved spec, what is wrong and
  how to fix it. ``problems`` holds them as :class:`ShardingProblem` records.
  """

  def __init__(self, problems: Sequence[ShardingProblem], context: str = ''):
    self.problems = tuple(problems)
    n = len(self.problems)
    head = f'{n} leaf cannot' if n == 1 else f'{n} leaves cannot'
    lines = [f'{head} be sharded as annotated{context}:']
    lines += [f'  - {p}' for p in self.problems]
    super().__init__('\n'.join(lines))


class RuleConflictError(FlaxShardmetaError):
  """Raised when global and per-variable logical rules disagree on a name."""


class NoMeshError(FlaxShardmetaError):
  """Raised when a sharding must be applied but no mesh was given or set."""


class InvalidRulesError(FlaxShardmetaError):
  """Raised when logical axis rules are not ``(logical_name, mesh_axes)`` pairs."""


class InvalidNamesError(FlaxShardmetaError):
  """Raised when an annotation's names are malformed (a bare string, a repeat,
  a transform's axis name that does not match)."""


class ShardingFitWarning(UserWarning):
  """Issued when ``fit=True`` replicated dimensions that could not be sharded.

  The message lists the changes (summarised per kind of change on large
  trees); ``adjustments`` holds every change as a ``'path: change'`` line,
  built only when first read.
  """

  def __init__(
      self,
      message: str,
      adjustments: Sequence[str] | Callable[[], Iterable[str]] | None = None,
  ):
    super().__init__(message)
    self._adjustments = adjustments

  @property
  def adjustments(self) -> tuple[str, ...]:
    """Every change, one ``'path: change'`` line each, in tree order."""
    if callable(self._adjustments):
      self._adjustments = tuple(self._adjustments())
    return tuple(self._adjustments or ())


class UnmappedMeshAxisNameWarning(UserWarning):
  """Issued when a logical name no rule maps is also a mesh-axis name.

  Such a dimension is replicated, which is rarely what was meant: either the
  names were meant as mesh axes (annotate with ``with_partitioning`` /
  ``Partitioned``, or pass ``logical=False`` to ``shard_value``), or a rule
  such as ``('data', 'data')`` is missing. One warning per such name and
  call, listing the parameters concerned.
  """


def unmapped_hint(name: str) -> str:
  """How to fix a logical name no rule maps (with the mesh-axis case spelled out)."""
  return (
      f'did you mean mesh-axis annotations (`with_partitioning`) or a rule '
      f'({name!r}, {name!r})?'
  )
