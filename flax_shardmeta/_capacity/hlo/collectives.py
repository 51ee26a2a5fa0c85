"""The collectives of a compiled program: kinds, bytes, runs, mesh axes and the
link each one uses.

The link is told from the devices a collective's groups join: on TPUs,
``'ici'`` inside a slice and ``'dcn'`` (the data-centre network) across
slices; on GPUs, ``'nvlink'`` inside a node (every member has the same
``process_index``, one host being one NVLink domain) and ``'network'`` across
nodes (InfiniBand / RoCE); a group with members in several nodes runs at the
network's speed even when some of them share one. CPU devices have none.
Between TPU slices XLA hands a collective to the Megascale runtime, as a
host-transfer send / recv pair naming it: counted once, over the axes along
which the slices differ, on ``'dcn'``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from flax_shardmeta._capacity.hlo.attribution import (
  Attribution,
  Attributor,
  operand_dims,
)
from flax_shardmeta._programs.hlo_text import (
  Computation,
  Instruction,
  largest_array_bytes,
  shape_bytes,
)
from flax_shardmeta._programs.hosts import host_count

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
  'reduce-scatter-start': 'reduce-scatter',
  'all-to-all-start': 'all-to-all',
  'all-reduce': 'all-reduce',
  'all-reduce-start': 'all-reduce',
  'all-to-all': 'all-to-all',
  'ragged-all-to-all': 'all-to-all',
  'ragged-all-to-all-start': 'all-to-all',
  'collective-permute': 'collective-permute',
  'collective-permute-start': 'collective-permute',
}

# Across TPU slices XLA leaves the collective to the Megascale runtime: a
# host-transfer send / recv pair whose attributes name the collective.
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')
_MEGASCALE_KIND = {
  'ALL_REDUCE': 'all-reduce',
  'ALL_GATHER': 'all-gather',
  'REDUCE_SCATTER': 'reduce-scatter',
  'ALL_TO_ALL': 'all-to-all',
}

LINKS = ('ici', 'dcn', 'nvlink', 'network')
"""The links a collective can use; the slow ones (across slices or nodes) are
``'dcn'`` and ``'network'``."""

_GPU_PLATFORMS = ('gpu', 'cuda', 'rocm')


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
    crosses_slices: whether a group spans slices or nodes (the slow network).
    link: ``'ici'``, ``'dcn'``, ``'nvlink'`` or ``'network'`` (see the module
      docstring); None on CPU devices or when the groups cannot be told.
    reason, parameters, source, scope, change, asked_by: why it is there
      (``hlo_attribution.Attribution``).
  """

  kind: str
  name: str
  bytes: int
  runs: int
  group_size: int
  axes: tuple[str, ...]
  crosses_slices: bool = False
  link: str | None = None
  reason: str = ''
  parameters: tuple[str, ...] = ()
  source: str = ''
  scope: str = ''
  change: str = ''
  asked_by: str = ''

  @property
  def bytes_per_step(self) -> int:
    """Bytes per device over a whole step."""
    return self.bytes * self.runs


def collectives(
  computations: dict[str, Computation],
  times: dict[str, int],
  mesh_devices: Any = None,
  axis_names: Sequence[str] = (),
  attributor: Attributor | None = None,
) -> list[CollectiveOp]:
  """Every collective of the program, weighed by how often a step runs it,
  each with why it is there when an ``attributor`` is given."""
  grid = None if mesh_devices is None else np.asarray(mesh_devices)
  n_devices = None if grid is None else int(grid.size)
  out = []
  for comp in computations.values():
    runs = times.get(comp.name, 0)
    if runs == 0:
      continue
    for inst in comp.instructions:
      kind = _OPCODE_KIND.get(inst.opcode)
      if kind is None and inst.opcode == 'send':
        for op in _across_slices(inst, runs, grid, axis_names):
          why = (
            attributor.attribute(inst, comp, op.kind, 0, op.axes)
            if attributor
            else None
          )
          out.append(dataclasses.replace(op, **_fields(why)) if why else op)
      if kind is None:
        continue
      group = inst.first_group(n_devices)
      axes = _axes_of(group, grid, axis_names)
      link = link_of(group, grid)
      slow = link in ('dcn', 'network')
      n = len(group) if group else (n_devices or 0)
      # XLA combines collectives of one kind and group into one instruction
      # of several operands: each value it moves is its own row.
      parts = _parts(inst, comp)
      for k, size in enumerate(parts):
        name = inst.name if len(parts) == 1 else f'{inst.name}#{k}'
        op = CollectiveOp(kind, name, size, runs, n, axes, slow, link)
        why = attributor.attribute(inst, comp, kind, k, axes) if attributor else None
        if (
          why is not None and why.reason == 'routing' and kind == 'all-gather' and n > 1
        ):
          # Every token goes to every shard; an all-to-all sends each token
          # only to the shard of its expert: 1/n of the bytes.
          said = f'{why.change}; an all-to-all: 1/{n} of it'
          why = dataclasses.replace(why, change=said)
        elif why is not None and kind == 'collective-permute' and n > 2 and _spmd(inst):
          # XLA's windowed einsum: a value passed shard by shard around a
          # ring of every device that holds a piece, overlapped with the
          # matmul that uses it (an all-gather or reduce-scatter in n-1 steps).
          said = '; '.join(
            x for x in (why.change, f'ring of {n} (windowed einsum)') if x
          )
          why = dataclasses.replace(why, change=said)
        elif why is not None and inst.opcode.startswith('ragged'):
          # How many tokens leave is known only at run time: the bytes are
          # its send buffer's, every token leaving.
          said = f'{why.change}; ragged: at most'.lstrip('; ')
          why = dataclasses.replace(why, change=said)
        out.append(dataclasses.replace(op, **_fields(why)) if why else op)
  return out


def _parts(inst: Instruction, comp: Computation) -> list[int]:
  """Bytes of each value a collective moves (the larger of its operand and
  its result, per device per run); one entry for a collective of one."""
  if inst.opcode.startswith('ragged') and inst.operands:
    # Its operands are a send buffer, the receiving buffer and the sizes and
    # offsets: what leaves is at most the send buffer.
    return [shape_bytes(comp.shapes.get(inst.operands[0], ''))]
  total = sum(shape_bytes(comp.shapes.get(o, '')) for o in inst.operands)
  whole = int(max(total, largest_array_bytes(inst.shape)))
  if len(inst.operands) < 2 or inst.opcode.startswith(('all-to-all', 'ragged')):
    return [whole]  # an all-to-all's operands are one value's pieces
  parts = []
  for k, operand in enumerate(inst.operands):
    dims_in, dims_out = operand_dims(inst, comp, k)
    given = shape_bytes(comp.shapes.get(operand, ''))
    scale = (
      math.prod(dims_out) / max(math.prod(dims_in), 1) if dims_in and dims_out else 1
    )
    parts.append(int(max(given, given * scale)))
  return parts


def _spmd(inst: Instruction) -> bool:
  """Whether XLA's partitioner made ``inst`` (not the step's own ppermute)."""
  return 'is_spmd_generated="true"' in inst.attributes


def _fields(why: Attribution) -> dict[str, Any]:
  return dataclasses.asdict(why)


def _across_slices(
  inst: Any, runs: int, grid: np.ndarray | None, axis_names: Sequence[str]
) -> list[CollectiveOp]:
  """A collective between TPU slices (its send; the recv is its other half)."""
  found = _MEGASCALE.search(inst.attributes)
  if found is None:
    return []
  kind = _MEGASCALE_KIND.get(found.group(1), 'collective-permute')
  slices = 1 if grid is None else np.vectorize(lambda d: _slice(d))(grid)
  axes: tuple[str, ...] = ()
  if grid is not None and len(axis_names) == grid.ndim:
    axes = tuple(
      name for i, name in enumerate(axis_names) if (np.diff(slices, axis=i) != 0).any()
    )
  n = len(np.unique(slices)) if grid is not None else 0
  size = int(largest_array_bytes(inst.shape))
  return [CollectiveOp(kind, inst.name, size, runs, n, axes, True, 'dcn')]


def _slice(device: Any) -> int:
  return getattr(device, 'slice_index', 0) or 0


def _axes_of(
  group: list[int] | None, grid: np.ndarray | None, axis_names: Sequence[str]
) -> tuple[str, ...]:
  """The mesh axes along which a group's devices differ."""
  if (
    not group or grid is None or max(group) >= grid.size or len(axis_names) != grid.ndim
  ):
    return ()
  coords = np.array(np.unravel_index(group, grid.shape))  # (ndim, len(group))
  return tuple(
    name for name, row in zip(axis_names, coords) if len(set(row.tolist())) > 1
  )


def link_of(group: list[int] | None, grid: np.ndarray | None) -> str | None:
  """The link a group of devices (positions in the mesh) uses.

  Example:
    >>> import types, numpy as np
    >>> gpus = np.array([types.SimpleNamespace(platform='gpu', process_index=i // 4)
    ...                  for i in range(8)])
    >>> link_of([0, 1, 2, 3], gpus), link_of([0, 4], gpus)
    ('nvlink', 'network')
  """
  if not group or grid is None or max(group) >= grid.size:
    return None
  members = [grid.flat[i] for i in group]
  platform = getattr(members[0], 'platform', None)
  if platform == 'tpu':
    slices = {getattr(d, 'slice_index', 0) or 0 for d in members}
    return 'dcn' if len(slices) > 1 else 'ici'
  if platform in _GPU_PLATFORMS:
    return 'network' if host_count(members) > 1 else 'nvlink'
  return None
