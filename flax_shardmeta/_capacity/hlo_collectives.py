"""The collectives of a compiled program: kinds, bytes, runs and mesh axes."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from flax_shardmeta._capacity.hlo_text import (
  Computation,
  largest_array_bytes,
  shape_bytes,
)

COLLECTIVE_KINDS = (
  'all-gather',
  'reduce-scatter',
  'all-reduce',
  'all-to-all',
  'collective-permute',
)
"""The collective kinds reported, in the order tables list them."""

_OPCODE_KIND = {
  'all-gather': 'all-gather',
  'all-gather-start': 'all-gather',
  'reduce-scatter': 'reduce-scatter',
  'all-reduce': 'all-reduce',
  'all-reduce-start': 'all-reduce',
  'all-to-all': 'all-to-all',
  'ragged-all-to-all': 'all-to-all',
  'collective-permute': 'collective-permute',
  'collective-permute-start': 'collective-permute',
}


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
  """One collective instruction and what one step spends on it.

  Attributes:
    kind: one of :data:`COLLECTIVE_KINDS` (async start/done pairs count once).
    name: the instruction's name in the HLO.
    bytes: bytes of its larger side (the full buffer) per device, per run.
    runs: how many times a step runs it (loop trips included).
    group_size: devices in each of its groups.
    axes: the mesh axes its groups span (empty when they cannot be told).
    crosses_slices: whether a group spans slices (the data-centre network).
  """

  kind: str
  name: str
  bytes: int
  runs: int
  group_size: int
  axes: tuple[str, ...]
  crosses_slices: bool = False

  @property
  def bytes_per_step(self) -> int:
    """Bytes per device over a whole step."""
    return self.bytes * self.runs


def collectives(
  computations: dict[str, Computation],
  times: dict[str, int],
  mesh_devices: Any = None,
  axis_names: Sequence[str] = (),
) -> list[CollectiveOp]:
  """Every collective of the program, weighed by how often a step runs it."""
  grid = None if mesh_devices is None else np.asarray(mesh_devices)
  n_devices = None if grid is None else int(grid.size)
  out = []
  for comp in computations.values():
    runs = times.get(comp.name, 0)
    if runs == 0:
      continue
    for inst in comp.instructions:
      kind = _OPCODE_KIND.get(inst.opcode)
      if kind is None:
        continue
      operand_bytes = sum(shape_bytes(comp.shapes.get(o, '')) for o in inst.operands)
      size = int(max(operand_bytes, largest_array_bytes(inst.shape)))
      group = inst.first_group(n_devices)
      axes, crosses = _axes_of(group, grid, axis_names)
      n = len(group) if group else (n_devices or 0)
      out.append(CollectiveOp(kind, inst.name, size, runs, n, axes, crosses))
  return out


def _axes_of(
  group: list[int] | None, grid: np.ndarray | None, axis_names: Sequence[str]
) -> tuple[tuple[str, ...], bool]:
  """The mesh axes along which a group's devices differ, and whether it spans
  slices."""
  if (
    not group or grid is None or max(group) >= grid.size or len(axis_names) != grid.ndim
  ):
    return (), False
  coords = np.array(np.unravel_index(group, grid.shape))  # (ndim, len(group))
  varying = tuple(
    name for name, row in zip(axis_names, coords) if len(set(row.tolist())) > 1
  )
  slices = {getattr(grid.flat[i], 'slice_index', 0) or 0 for i in group}
  return varying, len(slices) > 1
