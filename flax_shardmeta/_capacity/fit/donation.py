"""A hint for a step whose state is not donated: which arguments the step
returns again (same shape, same bytes per device), and ``donate_argnums=``.

A training step returns new parameters and optimizer state of the layout it
was given; without donation jax keeps both copies, and the report's
"outputs not donated" row holds the second. The compiled program's inputs and
outputs tell which arguments come back; the dtype is not in the figures, so
the match is by global shape and bytes per device, and the note says
"could", not "should".
"""

from __future__ import annotations

import collections
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from flax_shardmeta._programs.memory import ProgramMemory
from flax_shardmeta._units import format_bytes

if TYPE_CHECKING:
  from flax_shardmeta._capacity.fit.compiled_figures import CompiledFigures

_ARGUMENT = re.compile(r'^\[(\d+)\]')


def donation_notes(
  found: CompiledFigures, memory: ProgramMemory, names: Sequence[str]
) -> tuple[str, ...]:
  """A note naming the arguments that could be donated, and the bytes that
  would save; none when the step donates anything already, or returns none
  of its arguments.

  Args:
    found: the compiled figures (``input_bytes``, ``outputs``, ``output_bytes``).
    memory: XLA's memory figures of the program.
    names: the step's positional parameter names.
  """
  not_donated = memory.outputs - memory.aliased
  if memory.aliased or not_donated <= 0:
    return ()  # donating already: the user chose what to donate
  outputs = collections.Counter(
    (tuple(path_shape[1]), int(size[0]))
    for path_shape, size in zip(found.outputs or [], found.output_bytes)
  )
  by_argument: dict[int, list[tuple[tuple[int, ...], int]]] = {}
  for leaf in found.input_bytes:
    at = _ARGUMENT.match(str(leaf[0]))
    if at is not None:
      by_argument.setdefault(int(at.group(1)), []).append(
        (tuple(leaf[3]), int(leaf[1]))
      )
  donatable: list[tuple[int, int]] = []
  for index, leaves in sorted(by_argument.items()):
    wanted = collections.Counter(leaf for leaf in leaves if leaf[1] > 0)
    if wanted and all(outputs[k] >= n for k, n in wanted.items()):
      outputs -= wanted
      donatable.append((index, sum(size for _, size in leaves)))
  saved = min(sum(size for _, size in donatable), not_donated)
  if not donatable or saved <= 0:
    return ()
  numbers = ', '.join(str(i) for i, _ in donatable)
  named = ', '.join(
    f'{i} ({names[i]})' if i < len(names) else str(i) for i, _ in donatable
  )
  return (
    f'the step donates none of its arguments, and returns argument'
    f'{"s" if len(donatable) > 1 else ""} {named} again (outputs of the same '
    'shape and bytes per device): donating '
    f'{"them" if len(donatable) > 1 else "it"}, '
    f'jax.jit(step, donate_argnums=({numbers},)) or fsm.jit(..., '
    f'donate_argnums=({numbers},)), lets those outputs reuse their memory and '
    f'would save up to {format_bytes(saved)} per chip ("outputs not donated")',
  )
