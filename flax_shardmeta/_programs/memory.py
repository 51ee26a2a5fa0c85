"""Per-device memory of a compiled XLA program, as its buffer assignment reports it.

jax documents ``Compiled.memory_analysis()`` as a debugging aid whose structure
may change between versions and which some backends do not provide; decisions
taken from it (how to generate parameters, whether a step fits, what an
Explicit audit costs) read it here, defensively, in one place: nothing else in
the package calls ``memory_analysis()``.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
  """Bytes one device needs to run a compiled program.

  Attributes:
    arguments: the program's inputs.
    outputs: its results (XLA's result tuple included: a pointer per output).
    temporaries: buffers alive only while it runs.
    aliased: inputs whose buffers are reused for outputs (donation).
    generated_code: the compiled code itself.
    host_arguments, host_outputs, host_aliased, host_temporaries,
    host_generated_code: the same in host memory (``pinned_host``), where
      the backend reports it (0 elsewhere).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile()
    >>> m = program_memory(compiled)
    >>> m.arguments, m.outputs, m.peak == m.arguments + m.outputs + m.temporaries
    (16, 16, True)
  """

  arguments: int
  outputs: int
  temporaries: int
  aliased: int = 0
  generated_code: int = 0
  host_arguments: int = 0
  host_outputs: int = 0
  host_aliased: int = 0
  host_temporaries: int = 0
  host_generated_code: int = 0

  @property
  def peak(self) -> int:
    """Arguments, outputs and temporaries, donated buffers counted once."""
    return self.arguments + self.outputs + self.temporaries - self.aliased

  @property
  def step_total(self) -> int:
    """What one device holds over a whole step: :attr:`peak` and the
    generated code (``fsm.fit``'s ``total_bytes``, the audit's memory)."""
    return self.peak + self.generated_code

  def to_dict(self) -> dict[str, int]:
    """XLA's field names and figures, unaltered (``FitReport.memory_analysis``)."""
    return {f: getattr(self, a) for f, a in zip(MEMORY_FIELDS, _ATTRIBUTES)}

  @classmethod
  def from_dict(cls, fields: dict[str, int]) -> ProgramMemory:
    """The record of :meth:`to_dict`'s form (missing fields: 0)."""
    return cls(**{a: int(fields.get(f, 0)) for f, a in zip(MEMORY_FIELDS, _ATTRIBUTES)})


def program_memory(compiled: Any) -> ProgramMemory | None:
  """``compiled.memory_analysis()`` per device, or None where it is unavailable.

  Args:
    compiled: a ``jax.stages.Compiled`` (``jax.jit(f).lower(...).compile()``).
      For a program over several devices the numbers are those of one device.

  Returns:
    The :class:`ProgramMemory`, or None when the backend reports nothing.
  """
  try:
    stats = compiled.memory_analysis()
  except NotImplementedError:
    return None
  if stats is None:
    return None
  arguments, outputs, temporaries = (
    getattr(stats, name, None)
    for name in ('argument_size_in_bytes', 'output_size_in_bytes', 'temp_size_in_bytes')
  )
  if not (
    isinstance(arguments, int)
    and isinstance(outputs, int)
    and isinstance(temporaries, int)
  ):
    return None  # not the structure this reads
  optional = {
    a: int(getattr(stats, f, 0) or 0)
    for f, a in zip(MEMORY_FIELDS, _ATTRIBUTES)
    if a not in ('arguments', 'outputs', 'temporaries')
  }
  return ProgramMemory(arguments, outputs, temporaries, **optional)


MEMORY_FIELDS = (
  'argument_size_in_bytes',
  'output_size_in_bytes',
  'alias_size_in_bytes',
  'temp_size_in_bytes',
  'generated_code_size_in_bytes',
  'host_argument_size_in_bytes',
  'host_output_size_in_bytes',
  'host_alias_size_in_bytes',
  'host_temp_size_in_bytes',
  'host_generated_code_size_in_bytes',
)
"""The fields of ``memory_analysis()`` reported unaltered (``fsm.fit``)."""
_ATTRIBUTES = (
  'arguments',
  'outputs',
  'aliased',
  'temporaries',
  'generated_code',
  'host_arguments',
  'host_outputs',
  'host_aliased',
  'host_temporaries',
  'host_generated_code',
)


def memory_fields(compiled: Any) -> dict[str, int] | None:
  """Every field of ``compiled.memory_analysis()`` by name, missing optional
  ones (the ``host_*`` figures, alias, code) as 0; None where the backend
  reports nothing or another structure.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile()
    >>> memory_fields(compiled)['argument_size_in_bytes']
    16
  """
  memory = program_memory(compiled)
  return None if memory is None else memory.to_dict()


def step_total(fields: dict[str, int]) -> int:
  """The peak one device holds over a whole step, from :func:`memory_fields`:
  arguments + outputs - aliased + temporaries + generated code (what
  ``fsm.fit`` reports as ``total_bytes``).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile()
    >>> step_total(memory_fields(compiled)) >= 32
    True
  """
  return ProgramMemory.from_dict(fields).step_total
