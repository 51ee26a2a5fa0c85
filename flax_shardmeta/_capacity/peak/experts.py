"""A mixture-of-experts step's values at the peak by their routing role:
the names of the roles, what shrinks each, and the bytes per layer."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from flax_shardmeta._units import format_bytes, table


class _Held(Protocol):
  """What of a row (``rows.PeakRow``) the grouping reads."""

  @property
  def role(self) -> str: ...
  @property
  def scope(self) -> str: ...
  @property
  def layers(self) -> int: ...
  @property
  def bytes(self) -> int: ...


ROUTING_ROLES = ('dispatch', 'experts', 'combine', 'mask')
"""What a value of a mixture-of-experts layer is, by its line's role:
``'dispatch'``, the tokens grouped by expert (the dispatch buffer);
``'experts'``, what the experts compute on them; ``'combine'``, the experts'
outputs brought back to their tokens (the combine buffer); ``'mask'``, the
routing masks, slots and indices made from the experts' choice."""

ROLE_TEXT = {
  'dispatch': 'dispatch buffer',
  'experts': "experts' activation",
  'combine': 'combine buffer',
  'mask': 'routing mask',
}

_CAPACITY = (
  'a smaller capacity_factor (fsm.suggest(knobs={"capacity_factor": [...]}) '
  'ranks them), or the experts over more devices'
)
ROLE_SHRINKS = {
  'dispatch': _CAPACITY,
  'combine': _CAPACITY,
  'experts': f'{_CAPACITY}; or remat of the experts',
  'mask': (
    'a smaller capacity_factor, or routing by indices (a sort and a gather, '
    'ragged_all_to_all) instead of one-hot masks over every slot'
  ),
}
"""What would shrink a mixture-of-experts value, by its routing role."""


@dataclasses.dataclass(frozen=True)
class MoeLayerPeak:
  """A mixture-of-experts layer's routing memory at the peak
  (:meth:`PeakMemory.moe_layers`).

  Attributes:
    scope: the layer's module scope (``'Moe/layers'``).
    layers: how many layers these values are stacked over (a scan's saved
      values); 1 for one layer's (the layer running, an unrolled layer).
    bytes: bytes per chip of one layer, per routing role
      (:data:`ROUTING_ROLES`).
    total_bytes: bytes per chip of all ``layers`` together.

  Example:
    >>> m = MoeLayerPeak('Moe/layers', 4, {'dispatch': 1024}, 4096)
    >>> m.per_layer
    1024
  """

  scope: str
  layers: int
  bytes: dict[str, int]
  total_bytes: int

  @property
  def per_layer(self) -> int:
    """Bytes per chip of one layer, every role together."""
    return sum(self.bytes.values())

  def to_dict(self) -> dict[str, Any]:
    return {**dataclasses.asdict(self), 'per_layer': self.per_layer}


def moe_text(layers: Sequence[MoeLayerPeak]) -> list[str]:
  """The per-layer table of a mixture-of-experts step's routing memory."""
  if not layers:
    return []
  roles = [role for role in ROUTING_ROLES if any(role in m.bytes for m in layers)]
  head = ('mixture of experts, per layer', *(ROLE_TEXT[r] + 's' for r in roles))
  cells: list[tuple[str, ...]] = [head]
  for m in layers:
    stacked = f'each of {m.layers} layers' if m.layers > 1 else 'one layer'
    label = f'  {m.scope or "(no scope)"}, {stacked}'
    cells.append((label, *(format_bytes(m.bytes.get(r, 0)) for r in roles)))
  return table(cells, set(range(1, len(roles) + 1)))


def moe_layers(rows: Iterable[_Held]) -> tuple[MoeLayerPeak, ...]:
  """The rows with a routing role grouped by scope and stacking, per layer
  (:meth:`PeakMemory.moe_layers`)."""
  groups: dict[tuple[str, int], dict[str, int]] = {}
  for r in rows:
    if r.role:
      got = groups.setdefault((r.scope, r.layers or 1), {})
      got[r.role] = got.get(r.role, 0) + r.bytes
  out = [
    MoeLayerPeak(
      scope,
      n,
      {role: got[role] // n for role in ROUTING_ROLES if role in got},
      sum(got.values()),
    )
    for (scope, n), got in groups.items()
  ]
  return tuple(sorted(out, key=lambda m: (-m.total_bytes, m.scope, m.layers)))
