"""A deep model's report: compiled whole, or from compiles of two shallow ones.

Identical layers add the same bytes, collectives and flops per layer, so
every figure of the report at ``layers`` is the line through the figures at
``a`` and ``b`` layers (exactly, for scanned layers). That saves time only
where compile time grows with depth: layers unrolled in Python make the
program grow by a layer's worth per layer. Scanned layers (``nn.scan`` /
``nnx.scan``) are one loop whose program has the same size at any depth: one
compile of all of them costs about what a compile of 2 does (XLA may even
unroll a loop of 2 or 4 steps, making those slower), so two shallow compiles
cost about twice the whole one.

:func:`fit_layers` decides before anything compiles, from the two shallow
programs as lowered: their size in StableHLO lines, which unlike compile
times on a busy machine (or a cached compile's zero) is the same every run.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

from jax.sharding import AbstractMesh

from flax_shardmeta._capacity.fit.traced_step import Step, prepare
from flax_shardmeta._capacity.hlo.roofline import CollectiveRow, roofline
from flax_shardmeta._capacity.peak.holders import extrapolated
from flax_shardmeta._capacity.report import FitReport
from flax_shardmeta._errors import FitError

EXTRAPOLATE_FROM = (2, 4)
"""The two depths compiled to extrapolate from."""

SAVING = 2.0
"""How many times larger than the two shallow programs together the whole one
must be for them to be compiled instead: a compile's fixed costs, and the work
XLA does once for identical layers (autotuning a matmul shape), are not in
the line count, and the whole compile's figures are exact."""


@dataclasses.dataclass(frozen=True)
class Depths:
  """The sizes of the program lowered at two depths, and what they predict.

  Attributes:
    a: the shallower depth.
    b: the deeper one.
    layers: the depth reported on.
    lines: StableHLO lines of the program lowered at ``a`` and at ``b``.

  Example:
    >>> unrolled = Depths(2, 4, 14, (248, 448))  # 100 lines a layer
    >>> unrolled.predicted, unrolled.extrapolate
    (1448.0, True)
    >>> Depths(2, 4, 14, (1575, 1575)).extrapolate  # scanned: the same size
    False
  """

  a: int
  b: int
  layers: int
  lines: tuple[int, int]

  @property
  def predicted(self) -> float:
    """StableHLO lines of the program at ``layers``, on their line."""
    small, large = self.lines
    return small + (large - small) * (self.layers - self.a) / (self.b - self.a)

  @property
  def extrapolate(self) -> bool:
    """Whether two compiles at ``a`` and ``b`` clearly cost less than one at
    ``layers`` (by :data:`SAVING`), compile time taken to grow with the
    program's size."""
    return SAVING * sum(self.lines) <= self.predicted

  def note(self) -> str:
    """The decision, in one sentence for the report's notes."""
    small, large = self.lines
    sizes = (
      f'the lowered program has {small:,} StableHLO lines at {self.a} layers and '
      f'{large:,} at {self.b}, so about {self.predicted:,.0f} at {self.layers}'
    )
    if self.extrapolate:
      return (
        f'extrapolated, not compiled whole: {sizes}; two compiles of {self.a} and '
        f'{self.b} layers cost at most half of one of all {self.layers}'
      )
    if large <= small:
      return (
        f'compiled whole, not extrapolated: {sizes} (the layers are scanned: the '
        f'program does not grow with depth); one compile of all {self.layers} '
        f'layers costs about one of {self.a}, two would cost twice that'
      )
    return (
      f'compiled whole, not extrapolated: {sizes}; two compiles of {self.a} and '
      f'{self.b} layers would not cost clearly less than one of all {self.layers}'
    )


def fit_layers(
  build: Callable[[int], Any],
  layers: int,
  fit_at: Callable[[tuple[Any, ...]], FitReport],
  *,
  exact: bool = False,
) -> tuple[FitReport, bool]:
  """The report at ``layers`` of the model ``build(num_layers) -> (step,
  *args)`` makes, by the cheaper way, and whether it was extrapolated.

  Each depth is built once. The whole model is compiled when ``exact``, when
  it is no deeper than :data:`EXTRAPOLATE_FROM`'s second depth, on an abstract
  mesh (an estimate compiles nothing, so there is nothing to save), and when
  its program does not grow enough with depth for two shallow compiles to cost
  less (:class:`Depths`); otherwise every figure is extrapolated from the two
  shallow compiles, after the whole model's layout is checked. The report's
  notes say which, and why.

  Args:
    build: the model at a depth: ``num_layers -> (step, *abstract_args)``.
    layers: the depth to report on.
    fit_at: ``(step, *abstract_args) -> FitReport``, ``fit`` with its options.
    exact: compile all ``layers`` whatever the programs' sizes.

  Raises:
    FitError: ``layers`` is not a positive number, or ``build`` returns
      something else than ``(step, *args)``.
  """
  if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
    raise FitError(f'layers={layers!r}: give the number of layers, at least 1.')
  a, b = EXTRAPOLATE_FROM
  whole = built(build, layers)
  if exact or layers <= b:
    return _whole(fit_at(whole), layers), False
  target = Step.of(whole[0], len(whole) - 1)
  if isinstance(target.mesh, AbstractMesh):
    why = (
      f'estimated whole, not extrapolated: on an abstract mesh nothing compiles, '
      f'so two estimates at {a} and {b} layers would save nothing'
    )
    return _whole(fit_at(whole), layers, why), False
  shallow = built(build, a), built(build, b)
  depths = Depths(a, b, layers, (program_lines(shallow[0]), program_lines(shallow[1])))
  if not depths.extrapolate:
    return _whole(fit_at(whole), layers, depths.note()), False
  # The whole model is never compiled, but its layout must exist: its plan
  # raises what cannot be laid out, as fit at that depth would, before the
  # shallow compiles are spent.
  prepare(target, whole[1:])
  small, large = fit_at(shallow[0]), fit_at(shallow[1])
  if small.refusal is not None or large.refusal is not None:
    refused = small if small.refusal is not None else large
    depth = a if small.refusal is not None else b
    return dataclasses.replace(
      refused,
      method=f'the compiler refused the model already at {depth} of {layers} '
      'layers; deeper only needs more',
    ), False
  report = extrapolate(small, large, a, b, layers)
  return dataclasses.replace(report, notes=(*report.notes, depths.note())), True


def built(build: Callable[[int], Any], n: int) -> tuple[Any, ...]:
  """``build(n)``, checked to be ``(step, *args)``."""
  made = build(n)
  if not isinstance(made, (tuple, list)) or not made:
    raise FitError(
      f'the builder returned {type(made).__name__} for {n} layers; with layers=, '
      'fit takes a function num_layers -> (jitted_step, *abstract_args).'
    )
  return tuple(made)


def program_lines(made: tuple[Any, ...]) -> int:
  """StableHLO lines of ``(step, *args)`` as lowered for its mesh: the size of
  what the compiler is given. Lowering is cheap next to compiling; warnings
  are the compile's to give."""
  step, *args = made
  target = Step.of(step, len(args))
  arguments = prepare(target, args)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    lowered = target.lower(*arguments.lowered)
  return lowered.as_text().count('\n')


def _whole(report: FitReport, layers: int, why: str = '') -> FitReport:
  return dataclasses.replace(
    report,
    method=f'{report.method} ({layers} layers)',
    notes=(*report.notes, why) if why else report.notes,
  )


def extrapolate(
  small: FitReport, large: FitReport, a: int, b: int, layers: int
) -> FitReport:
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
  total = sum(r.bytes for r in rows)
  peak = None
  if small.peak_memory is not None and large.peak_memory is not None:
    peak = extrapolated(small.peak_memory, large.peak_memory, a, b, layers, total)
  flops = line(small.flops, large.flops)
  traffic = line(small.bytes_accessed, large.bytes_accessed)
  return dataclasses.replace(
    large,
    method=f'extrapolated linearly from compiles at {a} and {b} layers to {layers} '
    '(each layer adds the same bytes, collectives and flops); exact=True '
    'compiles all of them',
    rows=rows,
    total_bytes=total,
    memory_analysis=memory,
    donated_bytes=round(line(small.donated_bytes, large.donated_bytes) or 0),
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
    peak_memory=peak,
  )


def _collectives(small: FitReport, large: FitReport, line: Any) -> list[CollectiveRow]:
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
