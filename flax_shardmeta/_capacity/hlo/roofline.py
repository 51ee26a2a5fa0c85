"""Collectives per step, grouped, and a roofline step-time estimate.

The estimate is the classic roofline: a step takes at least as long as its
matmuls at peak throughput, its HBM traffic at full bandwidth, and its
collectives at the interconnect's bandwidth. With perfect overlap it takes
the largest of the three (``step_s``); with none, their sum (``serial_s``).
Real steps land in between. Collective time per run, for a group of ``n``
devices and ``B`` bytes (the full buffer per device): all-gather,
reduce-scatter and all-to-all move ``B (n-1)/n``; all-reduce ``2 B (n-1)/n``;
collective-permute ``B``; over the slow network (``dcn`` across TPU slices,
``network`` across GPU nodes) at the chip's network bandwidth, else over its
per-axis ICI or NVLink bandwidth (``chips.Chip.collective_bandwidth``).

Those factors are the ones nccl-tests turns a measured time into a bus
bandwidth with (NVIDIA/nccl-tests doc/PERFORMANCE.md and the *GetBw functions
of its src/*.cu: ``busbw = algbw * 2(n-1)/n`` for all-reduce, ``algbw *
(n-1)/n`` for all-gather, reduce-scatter and all-to-all, ``algbw`` for
send/receive, ``algbw`` being ``B`` over the time), so a collective takes
``moved / busbw``. On GPUs that bandwidth is the bus bandwidth NCCL reaches on
NVLink or the network (about a fifth below the link's peak), as nccl-tests
reports it; on TPUs it is the ICI or DCN figure itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from flax_shardmeta._capacity.hlo.collectives import COLLECTIVE_KINDS, CollectiveOp
from flax_shardmeta._devices.chips import Chip


@dataclasses.dataclass(frozen=True)
class CollectiveRow:
  """Collectives of one kind over the same mesh axes, per step and per device.

  Attributes:
    kind: ``'all-gather'``, ``'reduce-scatter'``, ``'all-reduce'``,
      ``'all-to-all'`` or ``'collective-permute'``.
    axes: the mesh axes the groups span (empty when they cannot be told).
    count: runs per step (async start/done pairs once; loop trips included).
    bytes: bytes per device per step (the full buffer of each run).
    seconds: the time they take at the interconnect's bandwidth (None
      without a known chip).
    crosses_slices: the groups span slices or nodes (the slow network).
    link: the link they use: ``'ici'`` / ``'dcn'`` on TPUs, ``'nvlink'`` /
      ``'network'`` on GPUs, None on CPUs or when it cannot be told.
    reason: why they run: ``'parameter'`` (gathering a parameter for use),
      ``'gradient'`` (reducing a parameter's gradient), ``'routing'``
      (moving a mixture-of-experts layer's tokens to and from their experts),
      ``'activation'``
      (resharding a value computed in the step), ``'explicit'`` (a collective
      the step's code calls, ``ppermute`` in a ``shard_map``), ``'other'`` (scalars, the
      loss and metrics) or ``'unknown'`` (the data flow does not tell);
      ``''`` when not attributed.
    parameters: the plan paths involved (``'parameter'``, ``'gradient'``).
    sources: the user's lines (``'file:line'``).
    scope: the module scope from the jax name stack.
    change: for ``'activation'``, how the layout changes.
    asked_by: ``'constraint'``, or the operation that needed the reshard.
    instructions: how many collective instructions of the program the row
      groups (a parameter gathered by two is gathered twice per use).
    scopes: every module scope the row's collectives are in, where there
      are several (one line of a layer unrolled over several layers), in
      program order; ``()`` when there is one (``scope``).

  Example:
    >>> row = CollectiveRow('all-gather', ('data',), 64, 2**30, 0.01)
    >>> row.over
    'data'
  """

  kind: str
  axes: tuple[str, ...]
  count: int
  bytes: float
  seconds: float | None = None
  crosses_slices: bool = False
  link: str | None = None
  reason: str = ''
  parameters: tuple[str, ...] = ()
  sources: tuple[str, ...] = ()
  scope: str = ''
  change: str = ''
  asked_by: str = ''
  instructions: int = 1
  scopes: tuple[str, ...] = ()

  @property
  def over(self) -> str:
    """The axes as text: ``'data'``, ``'data+model'`` or ``'?'``."""
    return '+'.join(self.axes) if self.axes else '?'

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form."""
    return {
      'kind': self.kind,
      'axes': list(self.axes),
      'link': self.link,
      'count': self.count,
      'bytes': int(self.bytes),
      'seconds': self.seconds,
      'crosses_slices': self.crosses_slices,
      'reason': self.reason,
      'parameters': list(self.parameters),
      'sources': list(self.sources),
      'scope': self.scope,
      'change': self.change,
      'asked_by': self.asked_by,
      'instructions': self.instructions,
      'scopes': list(self.scopes),
    }


def op_seconds(op: CollectiveOp, chip: Chip) -> float:
  """Seconds one step spends on ``op`` at ``chip``'s bandwidths: the bytes
  the ring moves per device over the bus bandwidth (see the module's text).

  Example:
    >>> from flax_shardmeta._devices.chips import chip_named
    >>> from flax_shardmeta._capacity.hlo.collectives import CollectiveOp
    >>> op = CollectiveOp('all-gather', 'ag', 8 * 10**9, 1, 8, ('model',))
    >>> round(op_seconds(op, chip_named('h100')), 4)  # 7 GB at 360 GB/s
    0.0194
  """
  n = max(op.group_size, 1)
  share = (n - 1) / n
  moved = {
    'all-reduce': 2 * op.bytes * share,
    'collective-permute': float(op.bytes),
  }.get(op.kind, op.bytes * share)
  return op.runs * moved / chip.collective_bandwidth(op.crosses_slices)


def group(ops: Iterable[CollectiveOp], chip: Chip | None) -> tuple[CollectiveRow, ...]:
  """Rows per kind, axes, link and attribution (reason, parameters, source),
  in :data:`COLLECTIVE_KINDS` order, largest first."""
  rows: dict[tuple[Any, ...], list[Any]] = {}
  for op in ops:
    key = (
      op.kind,
      op.axes,
      op.crosses_slices,
      op.link,
      op.reason,
      op.parameters,
      (op.source,) if op.source else (),
    )
    acc = rows.setdefault(key, [0, 0.0, 0.0, op, 0, {}])
    acc[4] += 1
    acc[5][op.scope] = None
    acc[0] += op.runs
    acc[1] += op.bytes_per_step
    acc[2] += op_seconds(op, chip) if chip is not None else 0.0
  out = [
    CollectiveRow(
      kind,
      axes,
      int(n),
      b,
      s if chip is not None else None,
      crosses,
      link,
      reason,
      parameters,
      sources,
      first.scope,
      first.change,
      first.asked_by,
      k,
      tuple(scopes) if len(scopes) > 1 else (),
    )
    for (kind, axes, crosses, link, reason, parameters, sources), (
      n,
      b,
      s,
      first,
      k,
      scopes,
    ) in (rows.items())
  ]
  order = {k: i for i, k in enumerate(COLLECTIVE_KINDS)}
  return tuple(sorted(out, key=lambda r: (order.get(r.kind, 99), -r.bytes)))


def by_link(rows: Iterable[CollectiveRow]) -> list[CollectiveRow]:
  """Rows summed per kind, axes and link (attribution set aside), as the
  report's table shows them."""
  out: dict[tuple[Any, ...], CollectiveRow] = {}
  for r in rows:
    key = (r.kind, r.axes, r.crosses_slices, r.link)
    if key not in out:
      out[key] = CollectiveRow(r.kind, r.axes, 0, 0.0, None, r.crosses_slices, r.link)
    had = out[key]
    seconds = None if r.seconds is None else (had.seconds or 0.0) + r.seconds
    out[key] = dataclasses.replace(
      had, count=had.count + r.count, bytes=had.bytes + r.bytes, seconds=seconds
    )
  order = {k: i for i, k in enumerate(COLLECTIVE_KINDS)}
  return sorted(out.values(), key=lambda r: (order.get(r.kind, 99), -r.bytes))


@dataclasses.dataclass(frozen=True)
class Roofline:
  """A step-time estimate from peak throughput and bandwidths (an estimate).

  Attributes:
    chip: the figures used.
    compute_s: flops / peak bf16 flops.
    memory_s: HBM bytes accessed / HBM bandwidth.
    collective_s: collective time at the interconnect's bandwidth.
    transfer_s: host <-> device transfers at the host link's bandwidth (0
      when the step moves nothing, or the link's bandwidth is unknown).

  Example:
    >>> from flax_shardmeta._devices.chips import chip_named
    >>> r = Roofline(chip_named('v5p'), 0.8, 0.3, 0.5)
    >>> r.step_s, r.serial_s, r.bound
    (0.8, 1.6, 'compute')
  """

  chip: Chip
  compute_s: float
  memory_s: float
  collective_s: float
  transfer_s: float = 0.0

  @property
  def step_s(self) -> float:
    """With perfect overlap: the largest of them."""
    return max(self.compute_s, self.memory_s, self.collective_s, self.transfer_s)

  @property
  def serial_s(self) -> float:
    """With no overlap: their sum."""
    return self.compute_s + self.memory_s + self.collective_s + self.transfer_s

  @property
  def bound(self) -> str:
    """What limits the step: ``'compute'``, ``'memory'``, ``'collectives'``
    or ``'host transfers'``."""
    parts = {
      'compute': self.compute_s,
      'memory': self.memory_s,
      'collectives': self.collective_s,
      'host transfers': self.transfer_s,
    }
    return max(parts, key=lambda k: parts[k])

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form."""
    return {
      'chip': self.chip.name,
      'compute_s': self.compute_s,
      'memory_s': self.memory_s,
      'collective_s': self.collective_s,
      'transfer_s': self.transfer_s,
      'step_s': self.step_s,
      'serial_s': self.serial_s,
      'bound': self.bound,
    }


def roofline(
  chip: Chip | None, flops: float, bytes_accessed: float, rows: Iterable[CollectiveRow]
) -> Roofline | None:
  """The estimate for a step, or None without a known chip."""
  if chip is None:
    return None
  collective_s = sum(r.seconds or 0.0 for r in rows)
  return Roofline(
    chip, flops / chip.peak_flops, bytes_accessed / chip.hbm_bandwidth, collective_s
  )
