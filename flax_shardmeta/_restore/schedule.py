"""Leaves restored in groups, each host's staging within a budget.

orbax bounds a restore by the footprints of the reads in flight, not by what
they stage (stored chunks, a decoded one, the output shard). A group is
restored by one orbax call whose byte limit is the budget scaled by the most
any of its reads stages per footprint byte, so what its concurrent reads
stage stays within the budget. Leaves join a group in tree order while every
read still fits under that limit.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from flax_shardmeta._restore.reads import LeafCost


@dataclasses.dataclass(frozen=True)
class Group:
  """Leaves restored by one orbax call.

  Attributes:
    items: (path, cost) of its leaves, in tree order.
    limit: footprint bytes orbax may have in flight (None: orbax's default).
    staging: per host, the most its reads stage at once: with a limit, what
      the limit admits; without one, every read at once (at most).
  """

  items: tuple[tuple[str, LeafCost], ...]
  limit: int | None
  staging: np.ndarray

  @property
  def paths(self) -> tuple[str, ...]:
    return tuple(p for p, _ in self.items)


def schedule(
  costs: list[tuple[str, LeafCost]], budget: int | None, num_hosts: int
) -> list[Group]:
  """Leaves grouped greedily in tree order under ``budget`` per host (a leaf
  that cannot meet it alone gets a group of its own)."""
  if not costs:
    return []
  if budget is None:
    return [_group(costs, None, num_hosts)]
  groups: list[list[tuple[str, LeafCost]]] = [[costs[0]]]
  for item in costs[1:]:
    if _limit(groups[-1] + [item], budget) is not None:
      groups[-1].append(item)
    else:
      groups.append([item])
  return [_group(g, budget, num_hosts) for g in groups]


def _limit(items: list[tuple[str, LeafCost]], budget: int) -> int | None:
  """The footprint limit keeping ``items``' staging within ``budget``, or
  None if some read's footprint alone is over it."""
  ratio = max((c.ratio for _, c in items), default=0.0)
  limit = int(budget / ratio) if ratio > 0 else budget
  largest = max((int(c.footprint.max(initial=0)) for _, c in items), default=0)
  return limit if largest <= limit else None


def _group(
  items: list[tuple[str, LeafCost]], budget: int | None, num_hosts: int
) -> Group:
  zeros = np.zeros(num_hosts, dtype=np.int64)
  total = sum((c.staged_total for _, c in items), zeros)
  limit = None if budget is None else _limit(items, budget)
  if budget is None:
    return Group(tuple(items), None, total)
  if limit is None:  # cannot meet the budget: reads one at a time
    limit = max(int(c.footprint.max(initial=0)) for _, c in items)
  footprint = np.max([c.footprint for _, c in items], axis=0)
  staged = np.max([c.staged for _, c in items], axis=0)
  # orbax admits a read while the footprints in flight stay within the limit.
  admitted = np.maximum(1, limit // np.maximum(footprint, 1))
  staging = np.minimum(total, admitted * staged)
  return Group(tuple(items), limit, staging.astype(np.int64))


def min_budget(costs: list[tuple[str, LeafCost]]) -> int:
  """The smallest budget every leaf's reads can run under, one at a time."""
  return max((math.ceil(c.min_budget) for _, c in costs), default=0)
