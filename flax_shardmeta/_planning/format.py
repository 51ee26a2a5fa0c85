"""Text rendering of sharding plans: one table grouped by module, with totals.

Unrolled stacks (``Block_0`` ... ``Block_125``, or ``layers/0`` ...) whose
copies are laid out identically are shown once with their count, so a plan
stays readable however deep the model is.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from flax_shardmeta._specs import format_spec

if TYPE_CHECKING:
  from flax_shardmeta._planning.plan import Mismatch, PlanEntry, ShardingPlan

_INDEX = re.compile(r'(?<=_)\d+$|^\d+$')
_MIN_STACK = 3
"""Fewer identical copies than this are listed one by one."""


def format_bytes(n: int) -> str:
  """Bytes in binary units, e.g. ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
  if n < 1024:
    return f'{n} B'
  value = float(n)
  for unit in ('KiB', 'MiB', 'GiB'):
    value /= 1024
    if value < 1024:
      return f'{value:.2f} {unit}'
  return f'{value / 1024:.2f} TiB'


def format_count(n: int) -> str:
  """Element counts with a short suffix, e.g. ``70.55 B`` for 70,553,706,496."""
  for div, unit in ((10**12, 'T'), (10**9, 'B'), (10**6, 'M'), (10**3, 'K')):
    if n >= div:
      return f'{n / div:.2f} {unit}'
  return str(n)


def _split(path: str) -> tuple[str, str]:
  module, _, leaf = path.rpartition('/')
  return module, leaf


def _module_key(module: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
  """The module path with indices blanked out, and the indices."""
  parts, idx = [], []
  for part in module.split('/'):
    m = _INDEX.search(part)
    if m:
      idx.append(int(m.group()))
      part = part[: m.start()] + '#'
    parts.append(part)
  return tuple(parts), tuple(idx)


def _signature(entries: list[PlanEntry]) -> tuple[Any, ...]:
  return tuple((_split(e.path)[1], e.shape, str(e.dtype), e.spec) for e in entries)


def _stack_label(key: tuple[str, ...], indices: list[tuple[int, ...]]) -> str:
  """``Block_{0..125}`` when one index runs contiguously, else ``Block_*``."""
  varying = [i for i in range(len(indices[0])) if len({ix[i] for ix in indices}) > 1]
  out, k = [], 0
  for part in key:
    if part.endswith('#'):
      column = [ix[k] for ix in indices]
      if k in varying:
        lo, hi = min(column), max(column)
        contiguous = sorted(column) == list(range(lo, hi + 1))
        label = f'{{{lo}..{hi}}}' if contiguous else '*'
      else:
        label = str(column[0])
      out.append(part[:-1] + label)
      k += 1
    else:
      out.append(part)
  return '/'.join(out)


def _groups(entries: tuple[PlanEntry, ...]) -> list[tuple[str, int, list[PlanEntry]]]:
  """(label, copies, entries of one copy), in first-seen order."""
  by_module: dict[str, list[PlanEntry]] = {}
  for e in entries:
    by_module.setdefault(_split(e.path)[0], []).append(e)
  # Identical copies of one module pattern are merged into a stack.
  stacks: dict[tuple[Any, ...], list[str]] = {}
  for module, members in by_module.items():
    key, _ = _module_key(module)
    stacks.setdefault((key, _signature(members)), []).append(module)
  out: list[tuple[str, int, list[PlanEntry]]] = []
  done: set[str] = set()
  for module, members in by_module.items():
    if module in done:
      continue
    key, _ = _module_key(module)
    copies = stacks[(key, _signature(members))]
    if len(copies) >= _MIN_STACK:
      done.update(copies)
      label = _stack_label(key, [_module_key(m)[1] for m in copies])
      out.append((label, len(copies), members))
    else:
      done.add(module)
      out.append((module, 1, members))
  # Parents before children, Block_2 before Block_10.
  return sorted(out, key=lambda g: _natural_key(g[0]))


def _natural_key(label: str) -> tuple[tuple[int, str | int], ...]:
  return tuple(
    (1, int(t)) if t.isdigit() else (0, t)
    for part in label.split('/')
    for t in [*re.split(r'(\d+)', part), '/']
    if t
  )


def _stacked_layers(members: list[PlanEntry]) -> int | None:
  """The layer count when every array has a leading 'layers' dimension."""
  sizes = {e.shape[0] for e in members if e.names and e.names[0] == 'layers'}
  ok = all(e.names and e.names[0] == 'layers' for e in members)
  return sizes.pop() if ok and len(sizes) == 1 else None


def format_table(plan: ShardingPlan) -> str:
  """The plan as a table: one block per module, then totals and problems."""
  mesh = ' x '.join(
    f'{n}={s}' for n, s in zip(plan.mesh.axis_names, plan.mesh.axis_sizes)
  )
  lines = [
    f'Sharding plan: {len(plan.entries)} arrays on mesh {mesh} '
    f'({plan.num_devices} devices), {len(plan.rules)} rules'
  ]
  header = (
    'array',
    'shape',
    'dtype',
    'names',
    'spec',
    'per device shard',
    'bytes/device',
  )
  rows: list[tuple[str, ...] | str] = []
  for label, copies, members in _groups(plan.entries):
    per_copy = sum(e.bytes_per_device for e in members)
    layers = _stacked_layers(members)
    notes = []
    if copies > 1:
      notes.append(f'{copies} identical copies')
    if layers:
      notes.append(f'scanned, {layers} layers')
    total = format_bytes(per_copy * copies)
    title = f'{label or "(root)"}/' + (f'  [{", ".join(notes)}]' if notes else '')
    rows.append(f'{title}  {total}/device')
    for e in members:
      rows.append(
        (
          '  ' + _split(e.path)[1],
          'x'.join(map(str, e.shape)) or 'scalar',
          str(e.dtype),
          format_spec(e.names) if e.names is not None else '-',
          format_spec(e.spec),
          'x'.join(map(str, e.shard_shape)) or 'scalar',
          format_bytes(e.bytes_per_device),
        )
      )
  table = [header] + [r for r in rows if isinstance(r, tuple)]
  widths = [max(len(r[i]) for r in table) for i in range(len(header))]

  def line(r: tuple[str, ...]) -> str:
    cells = [c.ljust(w) for c, w in zip(r[:-1], widths)] + [r[-1].rjust(widths[-1])]
    return '  '.join(cells).rstrip()

  lines.append(line(header))
  lines.append('-' * len(line(header)))
  lines += [r if isinstance(r, str) else line(r) for r in rows]
  lines.append('-' * len(line(header)))
  lines.append(
    f'total: {format_count(plan.num_elements())} elements, '
    f'{format_bytes(plan.total_bytes)} unsharded, '
    f'{format_bytes(plan.bytes_per_device)} per device'
  )
  if plan.adjustments:
    lines.append(f'fit mode adjustments ({len(plan.adjustments)}):')
    lines += [f'  - {a}' for a in plan.adjustments]
  if plan.problems:
    lines.append(f'problems ({len(plan.problems)}):')
    lines += [f'  - {p}' for p in plan.problems]
  else:
    lines.append('problems: none')
  return '\n'.join(lines)


def _spec_text(sharding: Any) -> str:
  if sharding is None:
    return '-'
  spec = getattr(sharding, 'spec', None)
  return format_spec(spec) if spec is not None else type(sharding).__name__


def format_mismatches(mismatches: list[Mismatch], checked: int) -> str:
  """:func:`verify`'s result as a table: path, shape, planned and actual spec.

  ``-`` marks a sharding that is missing (an array the plan does not know,
  or a value without one).
  """
  if not mismatches:
    return f'all {checked} arrays match the plan'
  header = ('array', 'shape', 'planned', 'actual')
  rows = [header] + [
    (
      m.path,
      'x'.join(map(str, m.shape)) or 'scalar' if m.shape is not None else '?',
      _spec_text(m.expected),
      _spec_text(m.actual),
    )
    for m in mismatches
  ]
  widths = [max(len(r[i]) for r in rows) for i in range(len(header))]

  def line(r: tuple[str, ...]) -> str:
    return '  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip()

  lines = [
    f'{len(mismatches)} of {checked} arrays differ from the plan:',
    line(header),
    '-' * len(line(header)),
  ]
  lines += [line(r) for r in rows[1:]]
  return '\n'.join(lines)
