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
import re
from typing import Any

from flax_shardmeta._capacity.hlo.summary import summarize
from flax_shardmeta._capacity.hlo.text import program_text

_SHARDING_OPS = re.compile(
  r'custom_call @Sharding\b|custom_call_target="Sharding"'
  r'|sdy\.sharding_constraint|sdy\.reshard'
)
_TRANSPOSE = re.compile(r'=\s*\S+\s+transpose\(')


@dataclasses.dataclass(frozen=True)
class ProgramFigures:
  """One compiled program's figures.

  Attributes:
    collectives: ``{(kind, axes): bytes per chip per step}``.
    sharding_ops: sharding annotations in the lowered program.
    transposes: transposes in the optimised program.
    memory: bytes per chip (arguments, outputs and temporaries, less
      donated aliases).
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
    len(_SHARDING_OPS.findall(lowered.as_text())),
    len(_TRANSPOSE.findall(text)),
    _memory(compiled),
  )


def _memory(compiled: Any) -> int:
  try:
    m = compiled.memory_analysis()
  except Exception:  # noqa: BLE001 - some backends have none
    return 0
  if m is None:
    return 0
  fields = ('argument_size_in_bytes', 'output_size_in_bytes', 'temp_size_in_bytes')
  total = sum(int(getattr(m, f, 0) or 0) for f in fields)
  return total - int(getattr(m, 'alias_size_in_bytes', 0) or 0)
