"""What compiling a step found: one typed record, :class:`CompiledFigures`.

``compiled.figures()`` returns it and ``fit`` reads it; the disk cache keeps
its JSON parts (XLA's memory analysis as ``ProgramMemory``'s form, the
cost, the inputs and outputs), never a record of its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax_shardmeta._capacity.hlo.summary import ProgramSummary
from flax_shardmeta._capacity.vocabulary import Refusal
from flax_shardmeta._programs.buffers import Buffers
from flax_shardmeta._programs.memory import ProgramMemory


@dataclasses.dataclass(frozen=True)
class CompiledFigures:
  """The figures of one compile (or of the cache's copy of one).

  Attributes:
    refusal: the compiler ran out of memory (then no figures but ``planned``).
    planned: what the compiler planned for (rematerialisation, its limit).
    memory: XLA's memory analysis, unaltered.
    device_memory: the same less what the program keeps in host memory.
    cost: XLA's cost analysis (flops, bytes accessed...).
    input_bytes: per input leaf ``(path, bytes per device, is a key, shape,
      in host memory)``.
    outputs, output_bytes: per output leaf its ``(path, shape)`` and bytes.
    reader: where the HLO reader disagreed with XLA's module objects.
    summary: the program's collectives, loops and work.
    host_notes: what was split off to host memory, in words.
    replicated: the dimensions ``replicate_indivisible`` replicated, in words.
    cached: read from the cache, not compiled.
    compile_seconds: the compile's wall time (0 when cached).
    buffers: XLA's buffer assignment at the heap's peak (None: not dumped).
    aliases: output position -> the donated argument it reuses.
    attributor: why's reader of this program (not cached: made anew from the
      program text each time).
  """

  refusal: Refusal | None = None
  planned: dict[str, Any] | None = None
  memory: ProgramMemory | None = None
  device_memory: ProgramMemory | None = None
  cost: dict[str, float] = dataclasses.field(default_factory=dict)
  input_bytes: list[list[Any]] = dataclasses.field(default_factory=list)
  outputs: list[list[Any]] | None = None
  output_bytes: list[list[Any]] = dataclasses.field(default_factory=list)
  reader: list[str] = dataclasses.field(default_factory=list)
  summary: ProgramSummary | None = None
  host_notes: tuple[str, ...] = ()
  replicated: tuple[str, ...] = ()
  cached: bool = False
  compile_seconds: float = 0.0
  buffers: Buffers | None = None
  aliases: dict[int, int] = dataclasses.field(default_factory=dict)
  attributor: Any = None
  offload: Any = None  # the step's OffloadAsks (from its trace: never cached)

  @classmethod
  def of(cls, found: dict[str, Any]) -> CompiledFigures:
    """The record of ``compiled.figures``' working dict (the cache's JSON
    parts, with the summary and host split added)."""
    refusal = found.get('refusal')
    memory, device = found.get('memory'), found.get('device_memory')
    summary = found.get('summary')
    return cls(
      refusal=None if refusal is None else Refusal(**refusal),
      planned=found.get('planned'),
      memory=None if memory is None else ProgramMemory.from_dict(memory),
      device_memory=None if device is None else ProgramMemory.from_dict(device),
      cost=dict(found.get('cost') or {}),
      input_bytes=list(found.get('input_bytes') or []),
      outputs=found.get('outputs'),
      output_bytes=list(found.get('output_bytes') or []),
      reader=list(found.get('reader') or []),
      summary=None if summary is None else ProgramSummary.from_dict(summary),
      host_notes=tuple(found.get('host_notes') or ()),
      replicated=tuple(found.get('replicated') or ()),
      cached=bool(found.get('cached')),
      compile_seconds=float(found.get('compile_seconds') or 0.0),
      buffers=Buffers.from_dict(found['buffers']) if found.get('buffers') else None,
      aliases=dict(found.get('aliases') or {}),
      attributor=found.get('attributor'),
      offload=found.get('offload'),
    )
