"""A deep scanned model's report from compiles of two shallow ones.

Scanned layers (``nn.scan`` / ``nnx.scan``) add the same bytes, collectives
and flops per layer, so every figure of the report at ``layers`` is the line
through the figures at ``a`` and ``b`` layers; compile time, which grows with
depth when layers are unrolled in Python, is spent only on the two.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax_shardmeta._capacity import report as rep
from flax_shardmeta._capacity.roofline import CollectiveRow, roofline
from flax_shardmeta._errors import FitError


def extrapolate(
  small: rep.FitReport, large: rep.FitReport, a: int, b: int, layers: int
) -> rep.FitReport:
  """The report at ``layers`` from compiled reports at ``a`` and ``b`` layers.

  Every figure, each row of the breakdown included, is ``f(a) + (f(b) -
  f(a)) (layers - a) / (b - a)``: all of them from the two compiled programs.

  Example:
    >>> # fsm.fit(build, layers=32) compiles 2 and 4 layers and calls this.
    >>> t = (32 - 2) / (4 - 2)
    >>> 100 + (160 - 100) * t  # a row of 100 B at 2 layers, 160 B at 4
    1000.0
  """
  if small.memory_analysis is None or large.memory_analysis is None:
    raise FitError('extrapolation needs two compiled reports with memory figures.')
  t = (layers - a) / (b - a)

  def line(x: float | None, y: float | None) -> float | None:
    return None if x is None or y is None else x + (y - x) * t

  memory = {
    k: round(line(small.memory_analysis[k], large.memory_analysis[k]) or 0)
    for k in small.memory_analysis
  }
  rows = tuple(
    dataclasses.replace(r, bytes=max(round(line(small.row(r.name), r.bytes) or 0), 0))
    for r in large.rows
  )
  collectives = _collectives(small, large, line)
  flops = line(small.flops, large.flops)
  traffic = line(small.bytes_accessed, large.bytes_accessed)
  return dataclasses.replace(
    large,
    method=f'extrapolated linearly from compiles at {a} and {b} layers to {layers} '
    '(each scanned layer adds the same bytes, collectives and flops); '
    'exact=True compiles all of them',
    rows=rows,
    total_bytes=sum(r.bytes for r in rows),
    memory_analysis=memory,
    donated_bytes=memory['alias_size_in_bytes'],
    collectives=tuple(sorted(collectives, key=lambda c: (c.kind, -c.bytes))),
    flops=flops,
    bytes_accessed=traffic,
    cost_analysis=None,
    roofline=roofline(large.chip, flops or 0.0, traffic or 0.0, collectives)
    if flops is not None
    else None,
    loops=(),
    compile_seconds=small.compile_seconds + large.compile_seconds,
    cached=small.cached and large.cached,
  )


def _collectives(
  small: rep.FitReport, large: rep.FitReport, line: Any
) -> list[CollectiveRow]:
  """Each (kind, axes) row on the line through its two figures (a row one
  report lacks counts zero there)."""
  pairs: dict[Any, list[Any]] = {}
  for which, r in ((0, small), (1, large)):
    for c in r.collectives:
      pairs.setdefault(_key(c), [None, None])[which] = c
  out = []
  for (kind, axes, crosses, link, *_), (x, y) in pairs.items():
    zero = dataclasses.replace(x or y, count=0, bytes=0.0, seconds=0.0)
    x, y = x or zero, y or zero
    out.append(
      dataclasses.replace(
        x,
        kind=kind,
        axes=axes,
        crosses_slices=crosses,
        link=link,
        count=round(line(x.count, y.count) or 0),
        bytes=line(x.bytes, y.bytes) or 0.0,
        seconds=line(x.seconds, y.seconds),
      )
    )
  return out


def _key(c: CollectiveRow) -> tuple[Any, ...]:
  """What makes a row the same row at two depths."""
  return (c.kind, c.axes, c.crosses_slices, c.link, c.reason, c.parameters, c.sources)
