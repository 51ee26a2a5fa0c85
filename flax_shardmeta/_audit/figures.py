"""A compiled step's figures, to set Auto and Explicit programs side by side.

Collective bytes per step by kind and mesh axes (the compiled program's
collectives, loop trips counted), the sharding annotations the lowered
program carries (GSPMD's ``Sharding`` custom calls and Shardy's
``sharding_constraint`` / ``reshard`` ops: what Explicit code adds where it
names layouts), the transposes XLA left in the optimised program, and memory
per chip.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax_shardmeta._capacity.hlo.summary import summarize
from flax_shardmeta._programs.compiled_text import (
  program_text,
  sharding_annotations,
  transposes,
)
from flax_shardmeta._programs.memory import program_memory


@dataclasses.dataclass(frozen=True)
class ProgramFigures:
  """One compiled program's figures.

  Attributes:
    collectives: ``{(kind, axes): bytes per chip per step}``.
    sharding_ops: sharding annotations in the lowered program.
    transposes: transposes in the optimised program.
    memory: bytes per chip (arguments, outputs, temporaries and generated
      code, less donated aliases): ``fsm.fit``'s total for the same program.
  """

  collectives: dict[tuple[str, tuple[str, ...]], int]
  sharding_ops: int
  transposes: int
  memory: int

  @property
  def collective_bytes(self) -> int:
    """All collective bytes per chip per step."""
    return sum(self.collectives.values())

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form."""
    return {
      'collectives': [
        {'kind': k, 'axes': list(a), 'bytes_per_step': b}
        for (k, a), b in sorted(self.collectives.items())
      ],
      'collective_bytes': self.collective_bytes,
      'sharding_ops': self.sharding_ops,
      'transposes': self.transposes,
      'memory': self.memory,
    }


def figures(lowered: Any, compiled: Any, mesh: Any) -> ProgramFigures:
  """The figures of one lowered and compiled program on ``mesh``."""
  text = program_text(compiled)
  devices = getattr(mesh, 'devices', None)
  summary = summarize(text, devices, tuple(mesh.axis_names))
  by: dict[tuple[str, tuple[str, ...]], int] = {}
  for c in summary.collectives:
    key = (c.kind, tuple(c.axes))
    by[key] = by.get(key, 0) + c.bytes_per_step
  return ProgramFigures(
    by,
    sharding_annotations(lowered.as_text()),
    transposes(text),
    _memory(compiled),
  )


def _memory(compiled: Any) -> int:
  """Bytes per chip, as ``fsm.fit`` totals them (generated code included);
  0 where the backend gives no memory analysis."""
  memory = program_memory(compiled)
  return 0 if memory is None else memory.step_total
