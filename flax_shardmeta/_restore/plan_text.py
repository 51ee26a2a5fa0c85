"""A restore plan as text: a table of leaves, then hosts, totals, problems and
notes."""

from __future__ import annotations

from typing import Any

from flax_shardmeta._planning.format import groups
from flax_shardmeta._specs import format_spec
from flax_shardmeta._units import format_bytes, table


def plan_text(p: Any, verbose: bool = False) -> str:
  """A ``RestorePlan`` as a table, then hosts, totals and problems: one row
  per module (identical copies stacked, as ``plan`` shows them) with what it
  reads and needs and how many of its arrays change layout; ``verbose``: one
  row per array."""
  mesh = p.mesh
  where = (
    'no mesh'
    if mesh is None
    else ' x '.join(f'{n}={s}' for n, s in zip(mesh.axis_names, mesh.axis_sizes))
  )
  lines = [
    f'Restore plan: {_count(len(p.entries), "array")} onto {where}, '
    f'{_count(p.num_hosts, "host")}'
  ]
  lines += _leaf_rows(p.entries) if verbose else _module_rows(p.entries)
  most = max(p.read_per_host, default=0)
  lines.append(
    f'total: read {format_bytes(p.total_read)}, needed '
    f'{format_bytes(p.total_needed)}, over-read {format_bytes(p.over_read)}; '
    f'most read by one host {format_bytes(most)}'
  )
  lines.append(
    f'device: peak {format_bytes(max(p.device_peak_bytes, default=0))} during, '
    f'{format_bytes(max(p.device_after_bytes, default=0))} after'
  )
  staging = format_bytes(max(p.staging_peak_per_host, default=0))
  if p.host_budget is not None:
    verdict = 'fits' if p.fits_budget else 'cannot be met'
    lines.append(
      f'host budget {format_bytes(p.host_budget)}: {verdict} in '
      f'{_count(len(p.schedule), "group")}; staging peak {staging}; smallest '
      f'budget {format_bytes(p.min_budget_bytes)}'
    )
  else:
    lines.append(
      f'host staging: at most {staging} (no budget: every read at once); '
      f'smallest budget {format_bytes(p.min_budget_bytes)}'
    )
  if p.checkpoint is not None:  # what a restore checks of the values it reads
    lines.append(str(p.content_check))
  blocking = p.blocking
  lines.append('problems: ' + ('none' if not blocking else f'{len(blocking)}'))
  lines += [f'  {q}' for q in blocking]
  notes = [q for q in p.problems if q not in blocking]
  if notes:  # restored as the target asks
    lines.append(f'notes (restored as the target asks): {len(notes)}')
    lines += [f'  {q}' for q in notes]
  return '\n'.join(lines)


def _leaf_rows(entries: Any) -> list[str]:
  rows = [('array', 'shape', 'dtype', 'saved spec', 'target spec', 'read', 'needed')]
  for e in entries:
    rows.append(
      (
        e.path + (' *' if e.moves else ''),
        'x'.join(map(str, e.shape)) or 'scalar',
        str(e.dtype),
        format_spec(e.saved_spec),
        format_spec(e.spec),
        format_bytes(e.bytes_read),
        format_bytes(e.bytes_needed),
      )
    )
  return [*table(rows, {5, 6}), '(* the layout changes)']


def _module_rows(entries: Any) -> list[str]:
  """One row per module: its arrays, what they read and need in all, and how
  many change layout; a stack of identical modules is one row."""
  rows = [('module', 'arrays', 'read', 'needed', 'layout changes')]
  for label, copies, group in groups(entries):
    members: list[Any] = list(group)  # restore entries: reads and moves
    n = len(members) * copies
    moved = sum(e.moves for e in members) * copies
    name = f'{label or "(root)"}/' + (
      f' [{copies} identical copies]' if copies > 1 else ''
    )
    rows.append(
      (
        name,
        str(n),
        format_bytes(sum(e.bytes_read for e in members) * copies),
        format_bytes(sum(e.bytes_needed for e in members) * copies),
        f'{moved} of {n}' if moved else '-',
      )
    )
  return [
    *table(rows, {1, 2, 3}),
    '(per module; --verbose / verbose=True: every array)',
  ]


def _count(n: int, noun: str) -> str:
  return f'{n} {noun}' + ('' if n == 1 else 's')
