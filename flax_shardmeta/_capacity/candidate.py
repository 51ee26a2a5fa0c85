"""A layout ``fsm.suggest`` tried, and what it returns: ``Candidate``, ``Suggestions``.

A candidate is a rule preset, a split of the chips over its mesh axes and a
remat policy, with the compiled report of the step under it (or why it was
rejected without compiling). ``Suggestions`` is the ranked list and its table.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from typing import Any

from flax_shardmeta._capacity import presets as presets_lib
from flax_shardmeta._capacity.fit_format import format_seconds
from flax_shardmeta._capacity.presets import RulePreset
from flax_shardmeta._capacity.report import FitReport
from flax_shardmeta._planning.format import format_bytes


@dataclasses.dataclass
class Candidate:
  """One layout tried: a preset, a split of the chips over its axes, a remat.

  Attributes:
    preset: the rule preset.
    shape: mesh axis -> size.
    remat: the remat policy.
    report: the compiled :class:`FitReport` (None if not compiled).
    rejected: why it was rejected without compiling (None otherwise).
    lower_bound: parameters + optimizer state + gradients per chip, exact.
    estimate: the estimated total per chip (for ordering), if made.
    reason: one line on how it compares (set when ranked).

  Example:
    >>> import flax_shardmeta as fsm
    >>> c = fsm.Candidate(fsm.RULE_PRESETS['tp'], {'data': 2, 'model': 4}, 'none')
    >>> c.label, c.fits
    ('tp data=2 model=4, remat none', None)
  """

  preset: RulePreset
  shape: dict[str, int]
  remat: str
  report: FitReport | None = None
  rejected: str | None = None
  lower_bound: int | None = None
  estimate: int | None = None
  reason: str = ''
  _topology: str | None = dataclasses.field(default=None, repr=False)
  _num_slices: int = dataclasses.field(default=1, repr=False)
  _tokens: int = dataclasses.field(default=0, repr=False)

  @property
  def label(self) -> str:
    """``'fsdp+tp data=2 fsdp=16 model=4, remat none'``."""
    mesh = ' '.join(f'{k}={v}' for k, v in self.shape.items())
    return f'{self.preset.name} {mesh}, remat {self.remat}'

  @property
  def fits(self) -> bool | None:
    """Whether the compiled step fits (None if not compiled)."""
    return None if self.report is None else self.report.fits

  @property
  def total_bytes(self) -> int | None:
    """Bytes per chip of the compiled step."""
    return None if self.report is None else self.report.total_bytes

  @property
  def step_s(self) -> float | None:
    """Estimated step time (roofline, perfect overlap)."""
    if self.report is None or self.report.roofline is None:
      return None
    return self.report.roofline.step_s

  @property
  def tokens_per_second_per_chip(self) -> float | None:
    """Tokens (or examples) per second per chip at the estimated step time."""
    step, chips = self.step_s, math.prod(self.shape.values())
    if not step or not self._tokens:
      return None
    return self._tokens / step / chips

  def make_mesh_call(self) -> str:
    """The ``fsm.make_mesh(...)`` call that builds this candidate's mesh."""
    sizes = tuple(self.shape.values())
    names = tuple(self.shape)
    where = f", topology='{self._topology}'" if self._topology else ''
    if self._num_slices > 1:
      where += f', num_slices={self._num_slices}'
    if self._topology and self._topology.startswith('custom:'):
      where += ', target_config=YOUR_CONFIG'
    return (
      f'fsm.make_mesh({sizes}, {names}{where},\n'
      f'              axis_types=(jax.sharding.AxisType.Auto,) * {len(names)})'
    )

  def compare(self, other: Candidate | None = None) -> str:
    """Why this candidate beats ``other`` (the next one, when ranked), category by
    category, then the mesh and rules to paste into a training script."""
    other = other if other is not None else self._next
    lines = [f'{self.label}']
    if self.report is not None:
      lines.append(f'  {summary(self)}')
    if other is not None and other.report is not None and self.report is not None:
      lines.append(f'against {other.label}:')
      for row in self.report.rows:
        theirs = other.report.row(row.name)
        if row.bytes or theirs:
          lines.append(
            f'  {row.name:24s} {format_bytes(row.bytes):>11s} vs '
            f'{format_bytes(theirs):>11s} ({signed(row.bytes - theirs)})'
          )
      lines.append(
        f'  {"total per chip":24s} {format_bytes(self.total_bytes or 0):>11s} vs '
        f'{format_bytes(other.total_bytes or 0):>11s}'
      )
      mine, theirs = self.report.collective_bytes, other.report.collective_bytes
      lines.append(
        f'  {"collectives per step":24s} {format_bytes(int(mine)):>11s} vs '
        f'{format_bytes(int(theirs)):>11s}'
      )
      if self.step_s and other.step_s:
        lines.append(
          f'  {"step time (estimate)":24s} {format_seconds(self.step_s):>11s} vs '
          f'{format_seconds(other.step_s):>11s} ({other.step_s / self.step_s:.2f}x)'
        )
    lines += [
      '',
      'mesh and rules for the training script:',
      f'  mesh = {self.make_mesh_call()}',
      f'  rules = {presets_lib.rules_text(self.preset.rules)}',
    ]
    if self.remat != 'none':
      lines.append(f'  remat policy: {self.remat!r} on each layer')
    return '\n'.join(lines)

  def explain(self, other: Candidate | None = None) -> str:
    """The former name of :meth:`compare` (deprecated: an explanation, as in
    ``fsm.explain_resolution``, is per dimension of a layout)."""
    warnings.warn(
      'Candidate.explain() is deprecated: use Candidate.compare(), the same text.',
      DeprecationWarning,
      stacklevel=2,
    )
    return self.compare(other)

  _next: Candidate | None = dataclasses.field(default=None, repr=False)

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form."""
    return {
      'preset': self.preset.name,
      'mesh': dict(self.shape),
      'remat': self.remat,
      'fits': self.fits,
      'total_bytes': self.total_bytes,
      'largest': None if self.report is None else self.report.largest_row.name,
      'headroom_bytes': None if self.report is None else self.report.headroom_bytes,
      'collective_bytes': None if self.report is None else self.report.collective_bytes,
      'step_s': self.step_s,
      'tokens_per_second_per_chip': self.tokens_per_second_per_chip,
      'reason': self.reason,
      'rejected': self.rejected,
      'lower_bound_bytes': self.lower_bound,
      'estimate_bytes': self.estimate,
    }


def signed(n: int) -> str:
  """``-1536`` -> ``'-1.5 KiB'``, ``0`` -> ``'+0 B'``."""
  return ('+' if n >= 0 else '-') + format_bytes(abs(n))


def summary(c: Candidate) -> str:
  """One line: bytes per chip, the largest row, the verdict, the step time."""
  r = c.report
  if r is None:
    return c.rejected or 'not compiled'
  big = r.largest_row
  parts = [
    f'{format_bytes(r.total_bytes)} per chip ({big.name} {format_bytes(big.bytes)})',
    'fits' if r.fits else 'does not fit',
  ]
  if c.step_s:
    parts.append(f'step ~{format_seconds(c.step_s)}')
  return ', '.join(parts)


class Suggestions(list):
  """What :func:`suggest` returns: compiled candidates, best first.

  A list of :class:`Candidate` (those that fit first, then by estimated step
  time, then by headroom); ``rejected`` holds those rejected without
  compiling and why, ``skipped`` those beyond ``max_candidates``. ``print``
  shows the ranked table; ``to_dict()`` is JSON.

  Attributes:
    rejected: candidates rejected by the exact cheap checks, with the reason.
    skipped: viable candidates not compiled (beyond ``max_candidates``).
    hbm_bytes: the memory per chip judged against.
    seconds: how long the search took.

  Example:
    >>> import flax_shardmeta as fsm
    >>> c = fsm.Candidate(fsm.RULE_PRESETS['fsdp'], {'data': 1, 'fsdp': 8}, 'none',
    ...                   rejected='the batch of 6 does not divide over 8 batch shards')
    >>> found = fsm.Suggestions([], [c], [], hbm_bytes=2**30, seconds=0.0)
    >>> found.fitting, [r.rejected for r in found.rejected]
    ([], ['the batch of 6 does not divide over 8 batch shards'])
  """

  def __init__(
    self,
    ranked: Sequence[Candidate],
    rejected: Sequence[Candidate],
    skipped: Sequence[Candidate],
    hbm_bytes: int | None,
    seconds: float,
  ):
    super().__init__(ranked)
    self.rejected = list(rejected)
    self.skipped = list(skipped)
    self.hbm_bytes = hbm_bytes
    self.seconds = seconds

  @property
  def fitting(self) -> list[Candidate]:
    """The compiled candidates that fit, best first."""
    return [c for c in self if c.fits]

  @property
  def closest(self) -> Candidate | None:
    """When nothing fits: the compiled candidate needing the least memory."""
    compiled = [c for c in self if c.report is not None]
    return min(compiled, key=lambda c: c.total_bytes or 0) if compiled else None

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form (see the CLI's ``suggest --format json``)."""
    return {
      'hbm_bytes': self.hbm_bytes,
      'seconds': self.seconds,
      'ranked': [c.to_dict() for c in self],
      'rejected': [c.to_dict() for c in self.rejected],
      'skipped': [c.to_dict() for c in self.skipped],
    }

  def format(self, top: int | None = None) -> str:
    """The ranked table (the first ``top`` rows), then the rejected ones."""
    rows = [
      (
        '#',
        'mesh',
        'preset',
        'remat',
        'per chip',
        'largest',
        'headroom',
        'collectives',
        'step (est.)',
        'tokens/s/chip',
      )
    ]
    for i, c in enumerate(self[:top] if top else self, 1):
      r = c.report
      if r is None:
        continue
      big = r.largest_row
      tps = c.tokens_per_second_per_chip
      rows.append(
        (
          str(i),
          ' '.join(f'{k}={v}' for k, v in c.shape.items()),
          c.preset.name,
          c.remat,
          format_bytes(r.total_bytes),
          f'{big.name} {format_bytes(big.bytes)}',
          '-' if r.headroom_bytes is None else signed(r.headroom_bytes),
          format_bytes(int(r.collective_bytes)),
          '-' if not c.step_s else format_seconds(c.step_s),
          '-' if tps is None else f'{tps:,.0f}',
        )
      )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
      '  '.join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows
    ]
    lines.insert(1, '-' * len(lines[0]))
    out = [f'{len(self.fitting)} of {len(self)} compiled layouts fit; best first:']
    for line, c in zip(lines[2:], self[:top] if top else self):
      out.append(line)
      out.append(f'    {c.reason}')
    out = [out[0], lines[0], lines[1], *out[1:]]
    if not self.fitting and self.closest is not None:
      c = self.closest
      short = (c.total_bytes or 0) - (self.hbm_bytes or 0)
      out.append(
        f'nothing fits; closest: {c.label}, {format_bytes(short)} over '
        f'{format_bytes(self.hbm_bytes or 0)}'
      )
    if self.rejected:
      out.append('')
      out.append(f'rejected without compiling ({len(self.rejected)}):')
      out += [f'  {c.label}: {c.rejected}' for c in self.rejected]
    if self.skipped:
      out.append(f'not compiled (beyond max_candidates): {len(self.skipped)}')
    return '\n'.join(out)

  def __str__(self) -> str:
    return self.format()
