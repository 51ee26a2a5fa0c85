"""How compiled candidates rank, and the one-line reason of each.

Those that fit (on GPUs: at the run's allocator fraction) first, then those
that fit only with a raised ``XLA_CLIENT_MEM_FRACTION`` (the smallest first),
then the rest; within each by estimated step time (equal to three significant
digits is a tie), then without offload before with it, then by headroom. So an
offload never ranks above a layout that fits without one at an equal or better
step time: its transfers are in its step time where the host link's bandwidth
is known. Last, a layout never ranks above the same mesh, preset and offload
with less remat when both fit: more remat only adds recompute.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from flax_shardmeta._capacity.suggest.candidate import Candidate, offload_cost, summary
from flax_shardmeta._capacity.vocabulary import TEMPORARIES
from flax_shardmeta._units import format_bytes


def rank(chosen: Sequence[Candidate], policies: Sequence[str]) -> list[Candidate]:
  """Best first (see the module's doc), then no layout above the same mesh
  and preset with less remat when both fit."""
  return _less_remat_first(sorted(chosen, key=_rank_key), policies)


def _rank_key(c: Candidate) -> tuple[Any, ...]:
  r = c.report
  if r is None:
    return (3, 0.0, math.inf, 0)
  kind = r.verdict_kind
  tier = 0 if kind == 'fits' else 1 if kind == 'fits_with_fraction' else 2
  fraction = (r.needed_fraction or 0.0) if tier == 1 else 0.0
  step = c.rank_s if c.rank_s is not None else math.inf
  # The step time is an estimate: ones equal to three significant digits (as
  # printed) are a tie, and the headroom decides.
  if math.isfinite(step):
    step = float(f'{step:.3g}')
  return (tier, fraction, step, c.offload.offloads, -(r.headroom_bytes or 0))


def _remat_order(policies: Sequence[str]) -> Callable[[Candidate], int]:
  order = {p: i for i, p in enumerate(policies)}
  return lambda c: order.get(c.remat, len(order))


def _less_remat_first(
  ranked: list[Candidate], policies: Sequence[str]
) -> list[Candidate]:
  """``ranked`` with the fitting layouts of each (preset, mesh) reordered
  among their own places, least remat (first in ``policies``) first: more
  remat only adds recompute, so it never outranks less when both fit."""
  places: dict[tuple[Any, ...], list[int]] = {}
  for i, c in enumerate(ranked):
    if c.fits:
      places.setdefault(_layout(c), []).append(i)
  out = list(ranked)
  for slots in places.values():
    members = sorted((ranked[i] for i in slots), key=_remat_order(policies))
    for i, c in zip(slots, members):
      out[i] = c
  return out


def _layout(c: Candidate) -> tuple[Any, ...]:
  return (c.preset.name, tuple(c.shape.items()), c.offload.name)


def reasons(ranked: list[Candidate], policies: Sequence[str] = ()) -> None:
  """A one-line reason per candidate, against the one ranked just above it
  (the first against the second)."""
  later = _remat_order(policies)
  for i, c in enumerate(ranked):
    ref = ranked[1] if i == 0 and len(ranked) > 1 else (ranked[i - 1] if i else None)
    c._next = ranked[i + 1] if i + 1 < len(ranked) else None
    c.reason = _reason(c, ref, first=i == 0)
    cost = offload_cost(c)
    if cost:
      c.reason += f'; {cost}'
    held = [
      o
      for o in ranked[i + 1 :]
      if o.fits
      and c.fits
      and _layout(o) == _layout(c)
      and later(o) > later(c)
      and _rank_key(o) < _rank_key(c)
    ]
    if held:
      c.reason += (
        f'; ranked above remat {held[0].remat} of the same layout, which step '
        'time and headroom alone put first: both fit, and more remat only adds '
        'recompute'
      )


def _reason(c: Candidate, ref: Candidate | None, first: bool) -> str:
  r = c.report
  if r is None:
    return c.rejected or 'not compiled'
  kinds = sorted(r.collectives, key=lambda x: -x.bytes)
  top = kinds[0] if kinds else None
  comm = (
    f'{top.kind}s {format_bytes(int(top.bytes))} per step over {top.over}'
    if top is not None
    else 'no collectives'
  )
  short = format_bytes(-(r.headroom_bytes or 0))
  limit = 'the usable memory' if r.usable is not None else 'the HBM'
  kind = r.verdict_kind
  if kind == 'fits_with_fraction':
    at = f' at {r.usable.fraction:.2f}' if r.usable is not None else ''
    return f'{r.verdict_words}: needs {short} more than {limit}{at}; {comm}'
  if kind == 'unknown':
    return f'no verdict: the memory per chip is unknown (pass hbm=); {comm}'
  host = r.host
  if not r.fits and host is not None and host.fits is False and r.fits_device:
    over = format_bytes(host.per_host_bytes - (host.capacity_bytes or 0))
    return f"the hosts lack memory: {over} over each host's RAM; {comm}"
  if not r.fits:
    return f'needs {short} more than {limit}; {comm}'
  if ref is None or ref.report is None:
    return f'{summary(c)}; {comm}'
  other = 'the next' if first else 'the one above'
  parts = []
  if c.rank_s and ref.rank_s:
    parts.append(f"step {c.rank_s / ref.rank_s:.2f}x {other}'s")
  temp = r.row(TEMPORARIES) - ref.report.row(TEMPORARIES)
  sign = '+' if temp >= 0 else '-'
  parts.append(f'activations {sign}{format_bytes(abs(temp))} vs {other}')
  parts.append(comm)
  return '; '.join(parts)
