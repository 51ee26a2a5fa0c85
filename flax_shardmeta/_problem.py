"""The record of one thing wrong with one leaf, carried by errors and plans."""

from __future__ import annotations

import dataclasses
from typing import Any


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
    dims: the array dimensions concerned (``replicate_indivisible=True``
      replicates them).

  Example:
    >>> import flax_shardmeta as fsm
    >>> problem = fsm.ShardingProblem(
    ...     'dense/kernel', (6, 10), ('data', 'model'), None,
    ...     "mesh has no axis 'model'", "use one of the mesh's axes")
    >>> print(problem)
    dense/kernel: shape (6, 10), names ('data', 'model'), spec None: mesh has no
    axis 'model'. Fix: use one of the mesh's axes
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
      f'{self.path}: shape {self.shape}, names {_format(self.names)}, '
      f'spec {_format(self.spec)}: {self.reason}. Fix: {self.hint}'
    )

  def shards(self, mesh: Any) -> tuple[int, ...]:
    """How many shards ``mesh`` (its ``axis_names`` and ``axis_sizes``) cuts
    each of :attr:`dims` into under :attr:`spec`: what the dimensions must be
    multiples of.

    Example:
      >>> import jax, flax_shardmeta as fsm
      >>> from jax.sharding import PartitionSpec as P
      >>> problem = fsm.ShardingProblem('w', (6, 10), ('batch', 'mlp'),
      ...     P(None, ('data', 'model')), 'indivisible', '...', dims=(1,))
      >>> problem.shards(jax.sharding.AbstractMesh((2, 4), ('data', 'model')))
      (8,)
    """
    import math

    from flax_shardmeta._specs import mesh_axes_of, spec_entries

    if self.spec is None:
      return ()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    entries = spec_entries(self.spec)
    return tuple(
      math.prod(sizes.get(a, 1) for a in mesh_axes_of(entries[d]))
      for d in self.dims
      if d < len(entries)
    )

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form."""
    return {
      'path': self.path,
      'shape': list(self.shape) if self.shape is not None else None,
      'names': _format(self.names) if self.names is not None else None,
      'spec': _format(self.spec) if self.spec is not None else None,
      'reason': self.reason,
      'hint': self.hint,
    }


def _format(spec: Any) -> str:
  # Imported when a message is made: importing the errors (as the command
  # line does) must not load jax.
  from flax_shardmeta._specs import format_spec

  return format_spec(spec)
