"""Errors raised by flax_shardmeta, and the problem records they carry."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from flax_shardmeta._specs import format_spec


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


class MeshShapeError(FlaxShardmetaError):
  """Raised when mesh axis sizes do not fit the devices or the hosts."""


class BatchLayoutError(FlaxShardmetaError):
  """Raised when a global batch cannot be split over the hosts as laid out."""


class LaunchError(FlaxShardmetaError):
  """Raised when a process of a local multi-process launch fails or times out.

  ``results`` holds each process's ``(returncode, stdout, stderr)``.
  """

  def __init__(self, message: str, results: Sequence[tuple[int | None, str, str]]):
    self.results = tuple(results)
    super().__init__(message)


class ShardingFitWarning(UserWarning):
  """Issued when ``fit=True`` replicated dimensions that could not be sharded."""
