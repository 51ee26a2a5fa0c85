"""Text rendering of sharding plans: one table grouped by module, with totals.

Unrolled stacks (``Block_0`` ... ``Block_125``, or ``layers/0`` ...) whose
copies are laid out identically are shown once with their count, so a plan
stays readable however deep the model is.

Imports point one way: the plan and its entries import this module, which
knows them only by what it reads of them (:class:`PlanView`, :class:`EntryView`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Protocol

from flax_shardmeta._specs import format_spec
from flax_shardmeta._units import format_bytes, format_count


class EntryView(Protocol):
  """What the table reads of a plan entry (a ``PlanEntry``)."""

  @property
  def path(self) -> str: ...
  @property
  def shape(self) -> tuple[int, ...]: ...
  @property
  def dtype(self) -> Any: ...
  @property
  def names(self) -> tuple[Any, ...] | None: ...
  @property
  def spec(self) -> Any: ...
  @property
  def shard_shape(self) -> tuple[int, ...]: ...
  @property
  def bytes_per_device(self) -> int: ...


class PlanView(Protocol):
  """What the table reads of a plan (a ``ShardingPlan``)."""

  @property
  def entries(self) -> Sequence[EntryView]: ...
  @property
  def mesh(self) -> Any: ...
  @property
  def rules(self) -> Sequence[Any]: ...
  @property
  def num_devices(self) -> int: ...
  @property
  def bytes_per_device(self) -> int: ...
  @property
  def total_bytes(self) -> int: ...
  @property
  def adjustments(self) -> Sequence[str]: ...
  @property
  def problems(self) -> Sequence[Any]: ...
  def num_elements(self, prefix: str = '') -> int: ...


_INDEX = re.compile(r'(?<=_)\d+$|^\d+$')
_MIN_STACK = 3
"""Fewer identical copies than this are listed one by one."""


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


def _signature(entries: list[EntryView]) -> tuple[Any, ...]:
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


def groups(
  entries: Sequence[EntryView],
) -> list[tuple[str, int, list[EntryView]]]:
  """(label, copies, entries of one copy), in first-seen order."""
  by_module: dict[str, list[EntryView]] = {}
  for e in entries:
    by_module.setdefault(_split(e.path)[0], []).append(e)
  # Identical copies of one module pattern are merged into a stack.
  stacks: dict[tuple[Any, ...], list[str]] = {}
  for module, members in by_module.items():
    key, _ = _module_key(module)
    stacks.setdefault((key, _signature(members)), []).append(module)
  out: list[tuple[str, int, list[EntryView]]] = []
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


def _stacked_layers(members: list[EntryView]) -> int | None:
  """The layer count when every array has a leading 'layers' dimension."""
  sizes = {e.shape[0] for e in members if e.names and e.names[0] == 'layers'}
  ok = all(e.names and e.names[0] == 'layers' for e in members)
  return sizes.pop() if ok and len(sizes) == 1 else None


def format_table(plan: PlanView) -> str:
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
  for label, copies, members in groups(plan.entries):
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
    lines.append(f'replicated by replicate_indivisible=True ({len(plan.adjustments)}):')
    lines += [f'  - {a}' for a in plan.adjustments]
  if plan.problems:
    lines.append(f'problems ({len(plan.problems)}):')
    lines += [f'  - {p}' for p in plan.problems]
  else:
    lines.append('problems: none')
  return '\n'.join(lines)
