"""A layout ``fsm.suggest`` tried: ``Candidate``, and its verdict in words.

A candidate is a rule preset, a split of the chips over its mesh axes, a
remat policy and an offload preset, with the compiled report of the step
under it (or why it was rejected without compiling).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

from flax_shardmeta._capacity.report import FitReport
from flax_shardmeta._capacity.suggest import presets as presets_lib
from flax_shardmeta._capacity.suggest.offload_presets import (
  OFFLOAD_PRESETS,
  OffloadPreset,
)
from flax_shardmeta._capacity.suggest.presets import RulePreset
from flax_shardmeta._units import format_bytes, format_seconds


@dataclasses.dataclass
class Candidate:
  """One layout tried: a preset, a split of the chips over its axes, a
  remat policy, an offload preset.

  Attributes:
    preset: the rule preset.
    shape: mesh axis -> size.
    remat: the remat policy.
    report: the compiled :class:`FitReport` (None if not compiled).
    rejected: why it was rejected without compiling (None otherwise).
    lower_bound: parameters + optimizer state + gradients per chip, exact.
    estimate: the estimated total per chip (for ordering), if made.
    reason: one line on how it compares (set when ranked).
    estimate_verdict: the estimate's ``verdict_kind`` (``'fits'``,
      ``'too_close'``, ...), if made.
    offload: what the step keeps in host memory (``OFFLOAD_PRESETS['none']``:
      nothing).
    knobs: the model's own settings it was built with, ``(name, value)``
      pairs passed to the build as keyword arguments (``suggest(knobs=...)``).
    knob_notes: what the build says of those settings (e.g. the tokens a
      capacity factor drops), shown with the candidate's reason.

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
  estimate_verdict: str | None = None
  offload: OffloadPreset = OFFLOAD_PRESETS['none']
  knobs: tuple[tuple[str, Any], ...] = ()
  knob_notes: str = ''
  _topology: str | None = dataclasses.field(default=None, repr=False)
  _num_slices: int = dataclasses.field(default=1, repr=False)
  _tokens: int = dataclasses.field(default=0, repr=False)
  _gpu: bool = dataclasses.field(default=False, repr=False)

  @property
  def label(self) -> str:
    """``'fsdp+tp data=2 fsdp=16 model=4, remat none'``."""
    mesh = ' '.join(f'{k}={v}' for k, v in self.shape.items())
    offload = f', offload {self.offload.name}' if self.offload.offloads else ''
    knobs = ''.join(f', {k}={v}' for k, v in self.knobs)
    return f'{self.preset.name} {mesh}, remat {self.remat}{offload}{knobs}'

  @property
  def fits(self) -> bool | None:
    """Whether the compiled step fits (None if not compiled); on GPUs at the
    run's allocator fraction."""
    return None if self.report is None else self.report.fits

  @property
  def verdict(self) -> str | None:
    """The report's ``verdict_kind`` (``'fits'``, ``'fits_with_fraction'``,
    ``'does_not_fit'``, ...); None if not compiled."""
    return None if self.report is None else self.report.verdict_kind

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
  def rank_s(self) -> float | None:
    """The step time the ranking uses: the roofline's :attr:`step_s`; on GPUs
    the largest of its compute, collective and host transfer time, without
    its HBM term (a GPU program compiled without a GPU is not autotuned, its
    matmuls cuBLAS calls with their neighbours unfused, so its HBM bytes are
    inflated, and remat lowers them)."""
    if self.report is None or self.report.roofline is None:
      return None
    r = self.report.roofline
    if self._gpu:
      return max(r.compute_s, r.collective_s, r.transfer_s)
    return r.step_s

  @property
  def tokens_per_second_per_chip(self) -> float | None:
    """Tokens (or examples) per second per chip at the ranked step time
    (:attr:`rank_s`)."""
    step, chips = self.rank_s, math.prod(self.shape.values())
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
      if self.rank_s and other.rank_s:
        what = 'compute+collectives' if self._gpu else 'step time (estimate)'
        lines.append(
          f'  {what:24s} {format_seconds(self.rank_s):>11s} vs '
          f'{format_seconds(other.rank_s):>11s} ({other.rank_s / self.rank_s:.2f}x)'
        )
      mine, theirs = self.report.bytes_accessed, other.report.bytes_accessed
      if self._gpu and mine is not None and theirs is not None:
        lines.append(
          f'  {"HBM traffic (not ranked)":24s} {format_bytes(int(mine)):>11s} vs '
          f'{format_bytes(int(theirs)):>11s}'
        )
    lines += [
      '',
      'mesh and rules for the training script:',
      f'  mesh = {self.make_mesh_call()}',
      f'  rules = {presets_lib.rules_text(self.preset.rules)}',
    ]
    if self.remat != 'none':
      lines.append(f'  remat policy: {self.remat!r} on each layer')
    if self.offload.offloads:
      lines.append(f'  offload: {self.offload.text} in host memory')
      host = self.report.host if self.report is not None else None
      if host is not None:
        lines += [f'  {line}' for line in host.lines()[:2]]
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

  @property
  def _usable_bytes(self) -> int | None:
    """GPUs: the usable memory the compiled step was judged against."""
    r = self.report
    return r.hbm_bytes if r is not None and r.usable is not None else None

  @property
  def routing_bytes(self) -> int | None:
    """Bytes per chip per step of the collectives ``why()`` calls routing: a
    mixture-of-experts model's tokens moved to their experts and back (None
    if not compiled)."""
    if self.report is None:
      return None
    return int(sum(r.bytes for r in self.report.collectives if r.reason == 'routing'))

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form."""
    return {
      'preset': self.preset.name,
      'mesh': dict(self.shape),
      'remat': self.remat,
      'offload': self.offload.name,
      'knobs': dict(self.knobs),
      'knob_notes': self.knob_notes,
      'host_bytes': None if self.report is None else self.report.host_bytes,
      'fits': self.fits,
      'verdict': self.verdict,
      'needed_fraction': None if self.report is None else self.report.needed_fraction,
      'usable_bytes': self._usable_bytes,
      'total_bytes': self.total_bytes,
      'largest': None if self.report is None else self.report.largest_row.name,
      'headroom_bytes': None if self.report is None else self.report.headroom_bytes,
      'collective_bytes': None if self.report is None else self.report.collective_bytes,
      'routing_bytes': self.routing_bytes,
      'step_s': self.step_s,
      'rank_s': self.rank_s,
      'tokens_per_second_per_chip': self.tokens_per_second_per_chip,
      'reason': self.reason,
      'rejected': self.rejected,
      'lower_bound_bytes': self.lower_bound,
      'estimate_bytes': self.estimate,
      'estimate_verdict': self.estimate_verdict,
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
    r.verdict_words,
  ]
  if c.rank_s:
    parts.append(f'step ~{format_seconds(c.rank_s)}')
  return ', '.join(parts)


def offload_cost(c: Candidate) -> str:
  """What the candidate's offload costs: the bytes moved each step and
  their time at the host link (or why the time is unknown), and what each
  host holds against its RAM; empty when it offloads nothing."""
  if not c.offload.offloads or c.report is None:
    return ''
  host = c.report.host
  if host is None:
    return f'offload {c.offload.text}: nothing in host memory in the compiled program'
  moved = (
    f'{format_bytes(host.to_device_bytes)} in and '
    f'{format_bytes(host.to_host_bytes)} out per step'
  )
  if host.transfer_s is None:
    time = 'time not counted: no published host link bandwidth for these chips'
  else:
    overlap = (
      'overlap unknown'
      if host.overlapped is None
      else 'can overlap compute'
      if host.overlapped
      else 'adds to the step'
    )
    time = f'{format_seconds(host.transfer_s)} ({overlap})'
  held = f'{format_bytes(host.per_host_bytes)} per host'
  if host.capacity_bytes is not None:
    held += f' of {format_bytes(host.capacity_bytes)}'
  return f'offload {c.offload.text}: {moved}, {time}; {held}'
