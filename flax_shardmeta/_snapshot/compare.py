"""Reading two layout snapshots side by side: ``snapshot_diff``, and the
canonical form of a snapshot's collective rows both sides are read in.

What identifies a constraint or a collective is what it does (scope, layout,
kind, axes, reason, parameters), not its line: code that moves is no
difference; the lines are kept beside, to read.
"""

from __future__ import annotations

import collections
import os
import re
from collections.abc import Sequence
from typing import Any

from flax_shardmeta._capacity import vocabulary as vocab
from flax_shardmeta._frames import import_path
from flax_shardmeta._snapshot.schema import (
  VERSION as VERSION,
  check_snapshot,
  outdated as outdated,
  spec_key,
  spec_text,
)
from flax_shardmeta._units import format_bytes

# Snapshot section -> the report categories it holds, and how a diff names one.
SECTIONS = {
  'parameters': ((vocab.PARAMETERS,), 'parameter'),
  'optimizer_state': ((vocab.OPTIMIZER,), 'optimizer state'),
  'inputs': ((vocab.INPUTS, vocab.RNG), 'input'),
}

# What a collective row is matched by between two snapshots: what it does,
# never where its lines are (``sources`` is kept beside, to read). Reasons are
# compared as opaque text: a reason added later needs no change here.
_ROW_KEY = ('kind', 'axes', 'reason', 'parameters', 'scope')
_TUPLE_FIELDS = ('axes', 'parameters')

# A line number after a file name, should a name stack ever hold one (a scope
# named after its place): scopes identify constraints, lines must not.
_LINE_IN_NAME = re.compile(r'(\.py):\d+')

# Byte changes smaller than this share of the old figure are not differences.
_BYTES_TOLERANCE = 0.01


def scope_text(name_stack: Any) -> str:
  """jax's name stack (or a collective's scope) as text, e.g.
  ``transpose(jvp(Model))/attn``, without a line number even where a scope
  was named with one."""
  return _LINE_IN_NAME.sub(r'\1', str(name_stack))


def line_order(where: str) -> tuple[str, int, str]:
  """``file:line`` by file, then line as a number (``m.py:9`` before
  ``m.py:10``)."""
  file, _, line = where.rpartition(':')
  return (file, int(line), where) if line.isdigit() else (where, -1, where)


def _source(text: str) -> str:
  """A collective's ``file:line`` with an absolute file named from its import
  root (rows of older reports, or written elsewhere, may hold one)."""
  file, colon, line = text.rpartition(':')
  if not colon or not line.isdigit():
    file, colon, line = text, '', ''
  if not os.path.isabs(file):
    return text
  return f'{import_path(file)}{colon}{line}'


def merge_collectives(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """``fit``'s rows, merged by what a diff matches them by, in a canonical order.

  The attribution fields (reason, parameters, scope, sources) are read with
  defaults: reports that do not attribute collectives have none. The sources
  of merged rows are merged, to read: a diff does not compare them.
  """
  merged: dict[tuple[Any, ...], dict[str, Any]] = {}
  for row in rows:
    out = {
      'kind': str(row['kind']),
      'axes': _axes(row.get('axes')),
      'reason': str(row['reason']) if row.get('reason') else None,
      'parameters': sorted(str(p) for p in row.get('parameters') or ()),
      'scope': scope_text(row.get('scope') or ''),
      'sources': sorted({_source(str(s)) for s in row.get('sources') or ()}),
      'link': row.get('link'),
      'bytes': int(row.get('bytes') or 0),
      'count': int(row.get('count') or 0),
    }
    key = _row_key(out)
    if key not in merged:
      merged[key] = out
      continue
    into = merged[key]
    into['bytes'] += out['bytes']
    into['count'] += out['count']
    links = {*(into['link'] or '').split('+'), out['link'] or ''} - {''}
    into['link'] = '+'.join(sorted(links)) or None
    into['sources'] = sorted({*into['sources'], *out['sources']})
  return [merged[k] for k in sorted(merged, key=_sort_key)]


def _axes(axes: Any) -> list[str]:
  """A row's mesh axes: a list of names, or one name written alone (never
  read letter by letter)."""
  return [axes] if isinstance(axes, str) else [str(a) for a in axes or ()]


def _row_key(row: dict[str, Any]) -> tuple[Any, ...]:
  return tuple(
    tuple(row.get(k) or ()) if k in _TUPLE_FIELDS else row.get(k) or None
    for k in _ROW_KEY
  )


def _sort_key(key: tuple[Any, ...]) -> tuple[Any, ...]:
  # No reason (None) sorts first, as ''; the other fields are str or tuples.
  return tuple('' if v is None else v for v in key)


# Comparing two snapshots
# ------------------------------------------------------------------------------


def snapshot_diff(
  old: dict[str, Any], new: dict[str, Any], names: tuple[str, str] = ('old', 'new')
) -> list[str]:
  """What changed from snapshot ``old`` to ``new``, one readable line each.

  Specs are compared by plan path, constraints by scope and layout (shape
  and spec), collective rows by kind, mesh axes, reason, parameters and
  scope: never by source line, so code that only moved (a comment added at
  the top of the model's file) is no difference; the lines are shown, to
  read. A change in bytes of less than 1% is not a difference (XLA's buffer
  sizes move a little between versions), a change in count is.

  Args:
    old: a snapshot (:func:`snapshot`, or one read back from JSON).
    new: another.
    names: what to call ``old`` and ``new`` when one is not a snapshot (their
      files, say).

  Returns:
    The lines, in a fixed order (mesh, specs, constraints, collectives);
    empty when the snapshots are equal.

  Raises:
    FitError: ``old`` or ``new`` is not a snapshot of this format (one of an
      older version must be recorded again).

  Example:
    >>> import flax_shardmeta as fsm
    >>> old = {'version': 2, 'parameters': {'params/w': "P(None, 'model')"}}
    >>> new = {'version': 2, 'parameters': {'params/w': "P('model', None)",
    ...                                     'params/b': "P('model',)"}}
    >>> for line in fsm.snapshot_diff(old, new):
    ...   print(line)
    new parameter params/b: P('model',)
    params/w: P(None, 'model') -> P('model', None)
    >>> fsm.snapshot_diff(new, new)
    []
  """
  check_snapshot(old, names[0])
  check_snapshot(new, names[1])
  lines = _mesh_lines(old, new)
  for section, (_, label) in SECTIONS.items():
    lines += _spec_lines(old.get(section) or {}, new.get(section) or {}, label)
  lines += _constraint_lines(old.get('constraints') or [], new.get('constraints') or [])
  lines += _collective_lines(old.get('collectives') or [], new.get('collectives') or [])
  return lines


def _mesh_lines(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
  lines = []
  if (old.get('mesh') or {}) != (new.get('mesh') or {}):
    lines.append(f'mesh: {_mesh_text(old)} -> {_mesh_text(new)}')
  if old.get('source') != new.get('source'):
    lines.append(f'collectives from: {old.get("source")} -> {new.get("source")}')
  return lines


def _mesh_text(snap: dict[str, Any]) -> str:
  """``data=2, model=4 (Auto, cpu)``."""
  mesh = snap.get('mesh') or {}
  axes = ', '.join(
    f'{n}={s}' for n, s in zip(mesh.get('axis_names', ()), mesh.get('axis_sizes', ()))
  )
  types = '/'.join(sorted(set(mesh.get('axis_types') or ()))) or '?'
  return f'{axes or "no axes"} ({types}, {mesh.get("device_kind") or "abstract"})'


def _spec_lines(old: dict[str, str], new: dict[str, str], label: str) -> list[str]:
  lines = []
  for path in sorted(old.keys() | new.keys()):
    before, after = old.get(path), new.get(path)
    if before is None:
      lines.append(f'new {label} {path}: {after}')
    elif after is None:
      lines.append(f'removed {label} {path}: {before}')
    elif spec_key(before) != spec_key(after):  # not by spaces or quotes
      lines.append(f'{path}: {spec_text(before)} -> {spec_text(after)}')
  return lines


def _constraint_lines(
  old: list[dict[str, Any]], new: list[dict[str, Any]]
) -> list[str]:
  """Constraints matched by scope, then by spec and shape (a scope may ask for
  several layouts); never by line: the lines only label what changed."""
  before, after = _byscope_text(old), _byscope_text(new)
  lines = []
  for scope in sorted(before.keys() | after.keys()):
    was, now = before.get(scope, {}), after.get(scope, {})
    for key in sorted(was.keys() & now.keys()):
      if was[key][0] != now[key][0]:
        times = f'{was[key][0]} -> {now[key][0]} times'
        lines.append(f'{_place(now[key][1], scope)}: {_layout(key)}: {times}')
    gone = sorted(was.keys() - now.keys())
    came = sorted(now.keys() - was.keys())
    if len(gone) == 1 and len(came) == 1:
      (a,), (b,) = gone, came
      where = _place(now[b][1], scope)
      if a[1] == b[1]:  # the same shape: only the spec changed
        lines.append(f'{where}: {a[0]} -> {b[0]}')
      else:
        lines.append(f'{where}: {_layout(a)} -> {_layout(b)}')
      continue
    lines += [f'removed {_place(was[k][1], scope)}: {_layout(k)}' for k in gone]
    lines += [f'new {_place(now[k][1], scope)}: {_layout(k)}' for k in came]
  return lines


def _byscope_text(
  rows: list[dict[str, Any]],
) -> dict[str, dict[tuple[str, tuple[int, ...]], tuple[int, list[str]]]]:
  """``scope -> {(spec, shape): (count, lines)}``; a ``where`` may be one
  line (written by hand) or a list."""
  out: dict[str, dict[Any, tuple[int, list[str]]]] = collections.defaultdict(dict)
  for row in rows:
    scope = str(row.get('scope', ''))
    shape = tuple(int(d) for d in row.get('shape') or ())
    key = (spec_text(str(row.get('spec')), rank=len(shape)), shape)
    where = row.get('where') or []
    where = [str(w) for w in ([where] if isinstance(where, str) else where)]
    count, known = out[scope].get(key, (0, []))
    merged = sorted({*known, *where}, key=line_order)
    out[scope][key] = (count + int(row.get('count', 1)), merged)
  return out


def _place(where: list[str], scope: str) -> str:
  """``constraint at model.py:40 (Model/attn)``: the first lines, the scope."""
  more = f' and {len(where) - 2} more' if len(where) > 2 else ''
  text = f'constraint at {", ".join(where[:2])}{more}' if where else 'constraint'
  return text + (f' ({scope})' if scope else '')


def _layout(key: tuple[str, tuple[int, ...]]) -> str:
  spec, shape = key
  return f'{spec} on {list(shape)}'


def _collective_lines(
  old: list[dict[str, Any]], new: list[dict[str, Any]]
) -> list[str]:
  before = {_row_key(r): r for r in merge_collectives(old)}
  after = {_row_key(r): r for r in merge_collectives(new)}
  lines = []
  for key in sorted(before.keys() | after.keys(), key=_sort_key):
    was, now = before.get(key), after.get(key)
    if was is None:
      lines.append(f'new {_described(after[key])}')
      continue
    if now is None:
      lines.append(f'removed {_described(was)}')
      continue
    label = _label(now)
    if _bytes_changed(was['bytes'], now['bytes']):
      b, a = format_bytes(was['bytes']), format_bytes(now['bytes'])
      lines.append(f'{label}: {b} -> {a} per step')
    if was['count'] != now['count']:
      lines.append(f'{label}: {was["count"]} -> {now["count"]} times per step')
    if was.get('link') != now.get('link'):
      lines.append(f'{label}: link {was.get("link")} -> {now.get("link")}')
  return lines


def _bytes_changed(before: int, after: int) -> bool:
  return abs(after - before) >= _BYTES_TOLERANCE * max(abs(before), 1)


def _over(row: dict[str, Any]) -> str:
  return f'{row["kind"]} over {"+".join(row["axes"]) or "?"}'


def _label(row: dict[str, Any]) -> str:
  """``all-reduce over model (gradient, params/w, in Model, model.py:40)``."""
  told = _told(row)
  return f'{_over(row)} ({", ".join(told)})' if told else _over(row)


def _described(row: dict[str, Any]) -> str:
  """``all-gather over data, 1.20 GiB/step, reason activation, model.py:88``."""
  told = _told(row)
  if row.get('reason'):
    told[0] = f'reason {told[0]}'
  return ', '.join([_over(row), f'{format_bytes(row["bytes"])}/step', *told])


def _told(row: dict[str, Any]) -> list[str]:
  """A row's attribution: its reason, parameters (the first few), scope (two
  rows may differ by it alone) and sources."""
  params = list(row.get('parameters') or ())
  if len(params) > 3:
    params = [*params[:3], f'{len(params) - 3} more']
  reason = [row['reason']] if row.get('reason') else []
  scope = [f'in {row["scope"]}'] if row.get('scope') else []
  return [*reason, *params, *scope, *(row.get('sources') or ())]
