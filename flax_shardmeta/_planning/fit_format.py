"""The text table and the treescope view of a ``FitReport``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flax_shardmeta._planning.format import format_bytes

if TYPE_CHECKING:
  from flax_shardmeta._planning.report import FitReport


def _bytes(n: float | int | None) -> str:
  if n is None:
    return '?'
  sign = '-' if n < 0 else ''
  return sign + format_bytes(int(abs(n)))


def format_seconds(s: float | None) -> str:
  """``0.0123`` -> ``'12.3 ms'`` (``'-'`` for None)."""
  if s is None:
    return '-'
  if s >= 1:
    return f'{s:.2f} s'
  if s >= 1e-3:
    return f'{s * 1e3:.1f} ms'
  return f'{s * 1e6:.0f} us'


def _table(rows: list[tuple[str, ...]], right: set[int]) -> list[str]:
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

  def line(r: tuple[str, ...]) -> str:
    cells = [
      c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(r)
    ]
    return '  '.join(cells).rstrip()

  return [line(r) for r in rows]


def verdict(report: FitReport) -> str:
  """One line: FITS / DOES NOT FIT, with the headroom or the shortfall."""
  if report.refusal is not None:
    r = report.refusal
    return (
      f'DOES NOT FIT: the compiler needs {_bytes(r.required_bytes)} per chip, '
      f'{_bytes(r.available_bytes)} available '
      f'({_bytes(r.required_bytes - r.available_bytes)} short)'
    )
  if report.fits is None:
    return 'no verdict: the device memory is unknown (pass hbm=..., e.g. "95GiB")'
  room, share = report.headroom_bytes, report.headroom
  if report.fits:
    return f'FITS, headroom {_bytes(room)} ({share:.1%} of HBM)'
  return f'DOES NOT FIT: {_bytes(-(room or 0))} over ({-(share or 0):.1%} of HBM)'


def format_report(report: FitReport) -> str:
  """The report as a table: one line per category, then the collectives."""
  mesh = ', '.join(f'{k}={v}' for k, v in report.mesh.items())
  head = f'Will it fit: {report.source} for {report.devices}; mesh {mesh}'
  lines = [head, f'method: {report.method}', '']
  total = max(report.total_bytes, 1)
  rows = [('per chip', 'bytes', 'share', 'from')]
  for r in report.rows:
    rows.append((f'  {r.name}', _bytes(r.bytes), f'{r.bytes / total:.1%}', r.note))
  total_note = (
    'the compiler, refusing'
    if report.refusal
    else 'argument + output - alias + temporaries + code'
  )
  rows.append(('  total', _bytes(report.total_bytes), '', total_note))
  if report.hbm_bytes is not None:
    where = f'{report.chip.name} HBM' if report.chip else 'hbm='
    rows.append(('  HBM', _bytes(report.hbm_bytes), '', where))
  lines += _table(rows, {1, 2})
  lines.append(f'verdict: {verdict(report)}')
  if report.collectives:
    lines.append('')
    crows = [('collectives per step', 'count', 'bytes/chip', 'over', 'time')]
    for c in report.collectives:
      over = c.over + (' (DCN)' if c.crosses_slices else '')
      crows.append(
        (
          f'  {c.kind}',
          f'{c.count:,}',
          _bytes(c.bytes),
          over,
          format_seconds(c.seconds),
        )
      )
    lines += _table(crows, {1, 2, 4})
  elif report.source == 'compiled' and report.refusal is None:
    lines += ['', 'collectives per step: none']
  if report.flops is not None:
    lines.append('')
    xla = report.cost_analysis or {}
    text_flops = xla.get('flops')
    once = (
      f' (XLA counts {text_flops:.3g} with each loop body once)'
      if text_flops is not None and abs(text_flops - report.flops) > 0.01 * report.flops
      else ''
    )
    lines.append(f'flops per step and chip: {report.flops:.3g}{once}')
    if report.bytes_accessed is not None:
      lines.append(f'HBM traffic per step and chip: {_bytes(report.bytes_accessed)}')
  if report.roofline is not None:
    r = report.roofline
    lines.append(
      f'roofline estimate ({r.chip.name}): step {format_seconds(r.step_s)} '
      f'({r.bound}-bound; {format_seconds(r.serial_s)} with no overlap): '
      f'compute {format_seconds(r.compute_s)}, HBM {format_seconds(r.memory_s)}, '
      f'collectives {format_seconds(r.collective_s)}'
    )
  for note in report.notes:
    lines.append(f'note: {note}')
  return '\n'.join(lines)


def treescope_view(report: FitReport) -> dict[str, Any]:
  """What treescope shows: the verdict, the breakdown and the collectives."""
  return {
    'verdict': verdict(report),
    'source': report.source,
    'method': report.method,
    'mesh': dict(report.mesh),
    'devices': report.devices,
    'per_chip': {r.name: _bytes(r.bytes) for r in report.rows},
    'total': _bytes(report.total_bytes),
    'hbm': _bytes(report.hbm_bytes),
    'collectives': {
      f'{c.kind} over {c.over}': f'{c.count:,} x, {_bytes(c.bytes)}'
      for c in report.collectives
    },
    'roofline': report.roofline.to_dict() if report.roofline else None,
    'memory_analysis': report.memory_analysis,
    'notes': list(report.notes),
  }
