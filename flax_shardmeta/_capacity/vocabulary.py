"""The words a step's cost is told in: the memory categories of a report's
rows (``PARAMETERS``, ``TEMPORARIES``...), a row, a compiler's refusal and
what the compiler planned for. Everything that counts a step's memory (the
step's arguments, the estimate, the compiled figures, ``fit``, snapshots)
speaks them; ``report`` builds ``FitReport`` on them.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


class Category(enum.StrEnum):
  """A report row's memory category. Code keys rows by the member; its value
  is the row's display text (and its JSON), so ``report.row('parameters')``
  and ``report.row(Category.PARAMETERS)`` are the same row.

  Example:
    >>> Category.INPUTS == 'batch and other inputs', f'{Category.INPUTS}'
    (True, 'batch and other inputs')
  """

  PARAMETERS = 'parameters'
  OPTIMIZER = 'optimizer state'
  RNG = 'RNG state'
  INPUTS = 'batch and other inputs'
  PADDING = 'argument padding'
  OUTPUTS = 'outputs not donated'
  TEMPORARIES = 'temporaries'
  CODE = 'generated code'
  GRADIENTS = 'gradients'
  ACTIVATIONS = 'activations and workspace'


PARAMETERS = Category.PARAMETERS
OPTIMIZER = Category.OPTIMIZER
RNG = Category.RNG
INPUTS = Category.INPUTS
PADDING = Category.PADDING
OUTPUTS = Category.OUTPUTS
TEMPORARIES = Category.TEMPORARIES
CODE = Category.CODE
GRADIENTS = Category.GRADIENTS
ACTIVATIONS = Category.ACTIVATIONS

ARGUMENT_ROWS = (PARAMETERS, OPTIMIZER, RNG, INPUTS, PADDING)
"""The rows that together are XLA's ``argument_size_in_bytes``."""


@dataclasses.dataclass(frozen=True)
class Row:
  """One line of the per-chip breakdown.

  Attributes:
    name: what the bytes are, a :class:`Category` (``'parameters'``,
      ``'temporaries'``, ...); RNG streams (key arrays, NNX
      ``RngKey``/``RngCount``) are ``'RNG state'``, a row only when the
      step's arguments hold some.
    bytes: bytes per chip.
    note: where the figure comes from.
  """

  name: str
  bytes: int
  note: str = ''

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form."""
    return {'name': str(self.name), 'bytes': int(self.bytes), 'note': self.note}


@dataclasses.dataclass(frozen=True)
class Refusal:
  """The compiler refused the program for lack of memory.

  Attributes:
    required_bytes: what it said the program needs per chip.
    available_bytes: what it said the chip has.
    message: its message, first line.
  """

  required_bytes: int
  available_bytes: int
  message: str


@dataclasses.dataclass(frozen=True)
class CompilerPlan:
  """The memory XLA's compiler planned against, and what it did to meet it.

  Attributes:
    budget_bytes: the device memory the compiler was handed (GPUs: the
      allocator's pool, as a real run hands it); None when it planned with
      the device's own (TPUs).
    retargeted: the program was compiled for that budget (False: jax gave no
      way to, and the compiler planned with the description's memory).
    cublas_matmuls: the matmuls were compiled as cuBLAS calls, the most
      memory a real run's autotuning can pick (False: XLA's Triton fusions,
      the least, where the compiler no longer takes that option).
    remat_instructions: instructions XLA's rematerialization recomputes to
      meet the budget (0: none).
    remat_saved_bytes: bytes rematerialization saved, where XLA logs it.
    remat_target_bytes: the peak it aimed for, where XLA logs it (it says
      so when it cannot reach it).
    message: XLA's own line about it, if any.
  """

  budget_bytes: int | None = None
  retargeted: bool = False
  cublas_matmuls: bool = False
  remat_instructions: int = 0
  remat_saved_bytes: int | None = None
  remat_target_bytes: int | None = None
  message: str = ''

  @property
  def rematerialized(self) -> bool:
    """Whether the compiler recomputes values the step did not ask it to."""
    return self.remat_instructions > 0 or bool(self.message)

  @classmethod
  def from_found(cls, planned: dict[str, Any] | None) -> CompilerPlan | None:
    """From the compiled figures' ``planned`` entry."""
    if not planned:
      return None
    return cls(
      budget_bytes=planned.get('budget'),
      retargeted=bool(planned.get('retargeted')),
      cublas_matmuls=bool(planned.get('cublas_matmuls')),
      remat_instructions=int(planned.get('remat_instructions', 0)),
      remat_saved_bytes=planned.get('remat_saved_bytes'),
      remat_target_bytes=planned.get('remat_target_bytes'),
      message=planned.get('remat_message', ''),
    )

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form."""
    return dict(dataclasses.asdict(self), rematerialized=self.rematerialized)
