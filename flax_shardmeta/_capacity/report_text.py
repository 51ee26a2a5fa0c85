"""How a :class:`FitReport` reads: its verdict line, its table and its
treescope view."""

from __future__ import annotations

import textwrap
from typing import Any

from flax_shardmeta._capacity.estimate.unplaced import report_lines
from flax_shardmeta._capacity.fit.usable import (
  FRACTION_VARIABLES,
  UsableMemory,
  fraction_text,
)
from flax_shardmeta._capacity.hlo.roofline import by_link
from flax_shardmeta._units import format_seconds, signed_bytes, table

# A report is read by its attributes alone (it is a FitReport): this module
# sits below the record, which renders itself with it.
FitReport = Any

# Reading a report: its verdict, table and treescope view
# ------------------------------------------------------------------------------


def verdict(report: FitReport) -> str:
  """One line: FITS / FITS ONLY WITH / DOES NOT FIT / TOO CLOSE TO CALL, with
  the headroom or the shortfall; for an estimate of a step outside the
  models its error was measured on, saying so."""
  line = _verdict(report)
  if report.unmeasured and report.hbm_bytes is not None:
    line += (
      "; the estimate's measured error does not cover this step "
      f'({", ".join(report.unmeasured)}): compile it for a verdict that holds'
    )
  return line


def _verdict(report: FitReport) -> str:
  if report.refusal is not None:
    r = report.refusal
    return (
      f'DOES NOT FIT: the compiler needs {signed_bytes(r.required_bytes)} per chip, '
      f'{signed_bytes(r.available_bytes)} available '
      f'({signed_bytes(r.required_bytes - r.available_bytes)} short)'
    )
  if report.too_close_to_call:
    below, above = report.error_band or (0.0, 0.0)
    return (
      f'TOO CLOSE TO CALL without compiling: the estimate '
      f'{signed_bytes(report.total_bytes)} is within its measured error (-{below:.0%}'
      f'..+{above:.0%}) of the {signed_bytes(report.hbm_bytes)} limit; compile it '
      'on a topology mesh (fsm.make_mesh(..., topology=...)) for a verdict'
    )
  if report.fits_device is not False and report.host and report.host.fits is False:
    over = report.host.per_host_bytes - (report.host.capacity_bytes or 0)
    return (
      f"DOES NOT FIT: the hosts lack memory: {signed_bytes(over)} over each host's "
      f'{signed_bytes(report.host.capacity_bytes)} ({report.host.capacity_source})'
      + ('; the chips have room' if report.fits_device else '')
    )
  if report.fits is None:
    return 'no verdict: the device memory is unknown (pass hbm=..., e.g. "95GiB")'
  room, share = report.headroom_bytes, report.headroom
  of = 'of usable memory' if report.usable else 'of HBM'
  at = _at_fraction(report.usable)
  if report.fits:
    return f'FITS{at}, headroom {signed_bytes(room)} ({share:.1%} {of})'
  over = f'{signed_bytes(-(room or 0))} over ({-(share or 0):.1%} {of})'
  if report.usable is not None and not report.hbm_bytes:  # no share of nothing
    over = f'{signed_bytes(-(room or 0))} over (the reserve leaves no usable memory)'
  if report.needed_fraction is not None:
    current, old = FRACTION_VARIABLES
    usable = report.usable
    now = (
      f' at {fraction_text(usable.fraction)} ({usable.fraction_from})' if usable else ''
    )
    return (
      f'FITS ONLY WITH {current}={report.needed_fraction:.2f} ({old} in older '
      f'jax): {signed_bytes(-(room or 0))} over the usable memory{now}'
    )
  return f'DOES NOT FIT: {over}{at}'


def _at_fraction(usable: UsableMemory | None) -> str:
  if usable is None:
    return ''
  at = fraction_text(usable.fraction)
  return f' at {FRACTION_VARIABLES[0]}={at} ({usable.fraction_from})'


def format_report(report: FitReport) -> str:
  """The report as a table: one line per category, then the collectives."""
  mesh = ', '.join(f'{k}={v}' for k, v in report.mesh.items())
  head = f'Will it fit: {report.source} for {report.devices}; mesh {mesh}'
  lines = [head, f'method: {report.method}', '']
  total = max(report.total_bytes, 1)
  rows = [('per chip', 'bytes', 'share', 'from')]
  for r in report.rows:
    rows.append(
      (f'  {r.name}', signed_bytes(r.bytes), f'{r.bytes / total:.1%}', r.note)
    )
  total_note = (
    'the compiler, refusing'
    if report.refusal
    else 'argument + output - alias + temporaries + code'
  )
  rows.append(('  total', signed_bytes(report.total_bytes), '', total_note))
  if report.usable is not None:
    for name, size, where in report.usable.rows():
      rows.append((f'  {name}', signed_bytes(size), '', where))
  elif report.hbm_bytes is not None:
    where = f'{report.chip.name} HBM' if report.chip else 'hbm='
    rows.append(('  HBM', signed_bytes(report.hbm_bytes), '', where))
  lines += table(rows, {1, 2})
  lines.append(f'verdict: {verdict(report)}')
  if report.host is not None:
    lines += report.host.lines()
  if report.fits is False and report.peak_memory is not None:
    lines += report.peak_memory.advice()
  lines += report_lines(report.unplaced, report.total_bytes)
  if report.collectives:
    lines.append('')
    crows = [('collectives per step', 'count', 'bytes/chip', 'over', 'link', 'time')]
    for c in by_link(report.collectives):
      crows.append(
        (
          f'  {c.kind}',
          f'{c.count:,}',
          signed_bytes(c.bytes),
          c.over,
          c.link or '-',
          format_seconds(c.seconds),
        )
      )
    lines += table(crows, {1, 2, 5})
    if any(c.reason for c in report.collectives):
      lines.append('  (report.why() / --why: which parameter or line each comes from)')
  elif report.source == 'compiled' and report.refusal is None:
    lines += ['', 'collectives per step: none']
  if report.flops is not None:
    lines.append('')
    xla = report.cost_analysis or {}
    text_flops = xla.get('flops')
    library = report.plan is not None and report.plan.cublas_matmuls
    left_out = 'each loop body once' + (', no cuBLAS call' if library else '')
    once = (
      f' (XLA counts {text_flops:.3g}: {left_out})'
      if text_flops is not None and abs(text_flops - report.flops) > 0.01 * report.flops
      else ''
    )
    lines.append(f'flops per step and chip: {report.flops:.3g}{once}')
    if report.bytes_accessed is not None:
      lines.append(
        f'HBM traffic per step and chip: {signed_bytes(report.bytes_accessed)}'
      )
  if report.roofline is not None:
    r = report.roofline
    lines.append(
      f'roofline estimate ({r.chip.name}): step {format_seconds(r.step_s)} '
      f'({r.bound}-bound; {format_seconds(r.serial_s)} with no overlap): '
      f'compute {format_seconds(r.compute_s)}, HBM {format_seconds(r.memory_s)}, '
      f'collectives {format_seconds(r.collective_s)}'
      + (f', host transfers {format_seconds(r.transfer_s)}' if r.transfer_s else '')
    )
  for note in report.notes:
    lines += textwrap.wrap(
      f'note: {note}', 100, subsequent_indent='      ', break_on_hyphens=False
    )
  return '\n'.join(lines)


def treescope_view(report: FitReport) -> dict[str, Any]:
  """What treescope shows: the verdict, the breakdown and the collectives."""
  return {
    'verdict': verdict(report),
    'source': report.source,
    'method': report.method,
    'mesh': dict(report.mesh),
    'devices': report.devices,
    'per_chip': {str(r.name): signed_bytes(r.bytes) for r in report.rows},
    'total': signed_bytes(report.total_bytes),
    'hbm': signed_bytes(report.hbm_bytes),
    'collectives': {
      f'{c.kind} over {c.over}': f'{c.count:,} x, {signed_bytes(c.bytes)}'
      for c in report.collectives
    },
    'roofline': report.roofline.to_dict() if report.roofline else None,
    'memory_analysis': report.memory_analysis,
    'usable_memory': report.usable.to_dict() if report.usable else None,
    'compiler_plan': report.plan.to_dict() if report.plan else None,
    'host': report.host.to_dict() if report.host else None,
    'notes': list(report.notes),
  }
