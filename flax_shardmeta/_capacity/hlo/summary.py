"""What one step of a compiled program does beyond its memory: ``summarize``.

XLA reports memory per chip exactly, but two things a training step costs are
only in the optimised program itself: which collectives run and on which mesh
axes, and how often each loop body runs (``cost_analysis()`` counts a body
once). The text is read by ``hlo_text``, the loops by ``hlo_loops``, the
collectives by ``hlo_collectives`` and the kernels' work by ``hlo_work``; this
module weighs them by how many times a step runs each computation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from flax_shardmeta._capacity.hlo.attribution import Attributor
from flax_shardmeta._capacity.hlo.collectives import CollectiveOp, collectives
from flax_shardmeta._capacity.hlo.trip_counts import multiplicities
from flax_shardmeta._capacity.hlo.work import dot_flops, kernel_bytes
from flax_shardmeta._programs.hlo_text import Computation, parse


@dataclasses.dataclass(frozen=True)
class ProgramSummary:
  """What one step of a compiled program does beyond its memory figures.

  Attributes:
    collectives: every collective instruction, weighed by its runs per step.
    loops: ``(while instruction, trip count or None)`` for every loop.
    extra_flops: flops of the loop trips ``cost_analysis`` leaves out.
    extra_bytes: HBM bytes of those trips (operands and results of each
      kernel, as XLA counts them).
    hlo_flops: flops of one pass over the program text, by the same count
      (to compare with XLA's own).
  """

  collectives: tuple[CollectiveOp, ...]
  loops: tuple[tuple[str, int | None], ...]
  extra_flops: float
  extra_bytes: float
  hlo_flops: float

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form (cached with a compiled program's figures)."""
    return {
      'collectives': [dataclasses.asdict(c) for c in self.collectives],
      'loops': [list(loop) for loop in self.loops],
      'extra_flops': self.extra_flops,
      'extra_bytes': self.extra_bytes,
      'hlo_flops': self.hlo_flops,
    }

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> ProgramSummary:
    """Inverse of :meth:`to_dict`."""
    return cls(
      tuple(
        CollectiveOp(
          **{
            **c,
            'axes': tuple(c['axes']),
            'parameters': tuple(c.get('parameters', ())),
          }
        )
        for c in d['collectives']
      ),
      tuple((name, n) for name, n in d['loops']),
      d['extra_flops'],
      d['extra_bytes'],
      d['hlo_flops'],
    )


def summarize(
  text: str, mesh_devices: Any = None, axis_names: Sequence[str] = ()
) -> ProgramSummary:
  """Collectives, loops and the work ``cost_analysis`` misses, from HLO text.

  Example:
    >>> text = '''
    ... %add (a: f32[], b: f32[]) -> f32[] {
    ...   %a = f32[] parameter(0)
    ...   %b = f32[] parameter(1)
    ...   ROOT %s = f32[] add(%a, %b)
    ... }
    ... %cond (p: (s32[], f32[8])) -> pred[] {
    ...   %p = (s32[], f32[8]) parameter(0)
    ...   %i = s32[] get-tuple-element(%p), index=0
    ...   %n = s32[] constant(4)
    ...   ROOT %lt = pred[] compare(%i, %n), direction=LT
    ... }
    ... %body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
    ...   %p = (s32[], f32[8]) parameter(0)
    ...   %i = s32[] get-tuple-element(%p), index=0
    ...   %x = f32[8] get-tuple-element(%p), index=1
    ...   %r = f32[8] all-reduce(%x), replica_groups={{0,1}}, to_apply=%add
    ...   %one = s32[] constant(1)
    ...   %j = s32[] add(%i, %one)
    ...   ROOT %t = (s32[], f32[8]) tuple(%j, %r)
    ... }
    ... ENTRY %main (x: f32[8]) -> (s32[], f32[8]) {
    ...   %x = f32[8] parameter(0)
    ...   %z = s32[] constant(0)
    ...   %t = (s32[], f32[8]) tuple(%z, %x)
    ...   ROOT %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body
    ... }'''
    >>> s = summarize(text)
    >>> s.loops, [(c.kind, c.bytes, c.runs) for c in s.collectives]
    ((('w', 4),), [('all-reduce', 32, 4)])
  """
  return summarize_computations(parse(text), mesh_devices, axis_names)


def summarize_computations(
  computations: dict[str, Computation],
  mesh_devices: Any = None,
  axis_names: Sequence[str] = (),
  attributor: Attributor | None = None,
) -> ProgramSummary:
  """:func:`summarize` of a program already parsed by ``hlo_text.parse``; with
  an ``attributor``, each collective says why it is there."""
  times, loops = multiplicities(computations)
  ops = collectives(computations, times, mesh_devices, axis_names, attributor)
  # Kernels' own computations: their traffic is their caller's operands and
  # result, counted where they are called.
  fused = {
    callee
    for comp in computations.values()
    for inst in comp.instructions
    for role, callee in inst.called()
    if role in ('calls', 'to_apply') and inst.opcode not in ('call', 'async-start')
  }
  extra_flops = extra_bytes = hlo_flops = 0.0
  for comp in computations.values():
    runs = times.get(comp.name, 0)
    flops = sum(dot_flops(i, comp) for i in comp.instructions)
    hlo_flops += flops if runs else 0.0
    if runs > 1:
      extra_flops += (runs - 1) * flops
      if comp.name not in fused:
        kernels = sum(kernel_bytes(i, comp, computations) for i in comp.instructions)
        extra_bytes += (runs - 1) * kernels
  return ProgramSummary(tuple(ops), tuple(loops), extra_flops, extra_bytes, hlo_flops)
