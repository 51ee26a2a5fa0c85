"""What a layout snapshot may hold, checked field by field, and spec text read
for what it means.

A golden file is JSON that people edit by hand and review in diffs: every
field is checked before anything is compared, and a field that is not what
:func:`flax_shardmeta.snapshot` writes is named (the file, the entry, the
field) with what it should be, never left to fail deep inside the diff.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable
from typing import Any

from flax_shardmeta._errors import FitError

VERSION = 2
"""The snapshot format; a snapshot of another version is re-recorded.

Version 2: files named from their import root; constraints grouped by scope
and layout with their lines as a list; collectives matched by scope, not
source lines.
"""


def outdated(version: Any) -> str:
  """What to say of a snapshot of another version: it must be recorded again,
  and how.

  Example:
    >>> print(outdated(1))  # doctest: +NORMALIZE_WHITESPACE
    is a layout snapshot of version 1, and this flax_shardmeta reads only
    version 2: it must be recorded again. Take the snapshot anew
    (fsm.snapshot, or flax-shardmeta snapshot --out FILE); for golden files
    of fsm.testing.assert_snapshot, run the tests once with
    FLAX_SHARDMETA_UPDATE_SNAPSHOTS=1.
  """
  return (
    f'is a layout snapshot of version {version!r}, and this flax_shardmeta '
    f'reads only version {VERSION}: it must be recorded again. Take the '
    'snapshot anew (fsm.snapshot, or flax-shardmeta snapshot --out FILE); '
    'for golden files of fsm.testing.assert_snapshot, run the tests once '
    'with FLAX_SHARDMETA_UPDATE_SNAPSHOTS=1.'
  )


_FIX = (
  'Correct it as fsm.snapshot writes it, or record the file again '
  '(fsm.snapshot; for golden files of fsm.testing.assert_snapshot, run the '
  'tests once with FLAX_SHARDMETA_UPDATE_SNAPSHOTS=1).'
)

SECTION_NAMES = ('parameters', 'optimizer_state', 'inputs')
_FIELDS = {'version', 'mesh', 'source', 'constraints', 'collectives', *SECTION_NAMES}
_MESH_FIELDS = {'axis_names', 'axis_sizes', 'axis_types', 'device_kind'}
_CONSTRAINT_FIELDS = {'scope', 'shape', 'spec', 'count', 'where'}
_COLLECTIVE_FIELDS = {
  'kind', 'axes', 'link', 'reason', 'parameters', 'scope', 'sources', 'bytes', 'count'
}  # fmt: skip


_JSON_KINDS = {
  list: 'a list',
  type(None): 'null',
  str: 'text',
  int: 'a number',
  float: 'a number',
  bool: 'true or false',
}


def _fail(which: str, where: str, got: Any, expected: str) -> FitError:
  place = f'{which}: {where}' if where else which
  return FitError(f'{place} is {got!r}; expected {expected}. {_FIX}')


def check_snapshot(snap: Any, which: str) -> None:
  """Raises ``FitError`` naming ``which`` (a file, or ``old`` / ``new``), the
  entry and the field of the first thing in ``snap`` that a snapshot of this
  format cannot hold.

  Example:
    >>> check_snapshot({'version': 2, 'parameters': {'w': 'P()'}}, 'a.json')
    >>> check_snapshot({'version': '2'}, 'a.json')
    Traceback (most recent call last):
    ...
    flax_shardmeta._errors.FitError: a.json: "version" is '2'; expected ...
  """
  if not isinstance(snap, dict) or 'version' not in snap:
    what = _JSON_KINDS.get(type(snap), type(snap).__name__)
    what = 'an object with no "version"' if isinstance(snap, dict) else what
    raise FitError(
      f'{which} is not a layout snapshot (a JSON object with a "version", '
      f'from fsm.snapshot); it holds {what}. {_FIX}'
    )
  version = snap['version']
  if type(version) is not int:  # 2.0, '2' and true are all refused alike
    raise _fail(which, '"version"', version, f'an integer, {VERSION}')
  if version != VERSION:
    raise FitError(f'{which} {outdated(version)}')
  unknown = sorted(set(snap) - _FIELDS)
  if unknown:
    raise _fail(which, 'a field', unknown[0], f'one of {sorted(_FIELDS)}')
  _optional_text(snap.get('source'), which, '"source"')
  _check_mesh(snap.get('mesh', {}), which)
  for section in SECTION_NAMES:
    entries = snap.get(section, {})
    if not isinstance(entries, dict):
      raise _fail(which, f'"{section}"', entries, 'an object of path -> spec text')
    for path, spec in entries.items():
      _spec(spec, which, f'{section}[{path!r}]')
  _rows(snap, which, 'constraints', _CONSTRAINT_FIELDS, _check_constraint)
  _rows(snap, which, 'collectives', _COLLECTIVE_FIELDS, _check_collective)


def _rows(
  snap: dict[str, Any],
  which: str,
  section: str,
  fields: set[str],
  check: Callable[[dict[str, Any], str, str], None],
) -> None:
  rows = snap.get(section, [])
  if not isinstance(rows, list):
    raise _fail(which, f'"{section}"', rows, 'a list of objects')
  for n, row in enumerate(rows):
    where = f'{section}[{n}]'
    if not isinstance(row, dict):
      raise _fail(which, where, row, 'an object')
    unknown = sorted(set(row) - fields)
    if unknown:
      raise _fail(which, f'{where}', unknown[0], f'fields among {sorted(fields)}')
    check(row, which, where)


def _check_mesh(mesh: Any, which: str) -> None:
  if not isinstance(mesh, dict):
    raise _fail(which, '"mesh"', mesh, 'an object (axis_names, axis_sizes, ...)')
  unknown = sorted(set(mesh) - _MESH_FIELDS)
  if unknown:
    raise _fail(which, 'mesh field', unknown[0], f'one of {sorted(_MESH_FIELDS)}')
  for field in ('axis_names', 'axis_types'):
    _texts(mesh.get(field, []), which, f'mesh["{field}"]')
  sizes = mesh.get('axis_sizes', [])
  if not isinstance(sizes, list):
    raise _fail(which, 'mesh["axis_sizes"]', sizes, 'a list of positive integers')
  for n, size in enumerate(sizes):
    _count(size, which, f'mesh["axis_sizes"][{n}]', least=1)
  _optional_text(mesh.get('device_kind'), which, 'mesh["device_kind"]')


def _check_constraint(row: dict[str, Any], which: str, where: str) -> None:
  if 'spec' not in row:
    raise _fail(which, f'{where}["spec"]', None, 'spec text such as "P(\'data\')"')
  _spec(row['spec'], which, f'{where}["spec"]')
  _optional_text(row.get('scope'), which, f'{where}["scope"]')
  shape = row.get('shape', [])
  if not isinstance(shape, list):
    raise _fail(which, f'{where}["shape"]', shape, 'a list of dimension sizes')
  for n, size in enumerate(shape):
    _count(size, which, f'{where}["shape"][{n}]')
  _count(row.get('count', 1), which, f'{where}["count"]')
  lines = row.get('where', [])
  if not isinstance(lines, str):
    _texts(lines, which, f'{where}["where"]')


def _check_collective(row: dict[str, Any], which: str, where: str) -> None:
  if not isinstance(row.get('kind'), str):
    raise _fail(which, f'{where}["kind"]', row.get('kind'), 'text such as "all-reduce"')
  axes = row.get('axes') or []
  if isinstance(axes, str):  # one axis name, never read letter by letter
    _axis_name(axes, which, f'{where}["axes"]')
  else:
    _texts(axes, which, f'{where}["axes"]')
  for field in ('parameters', 'sources'):
    _texts(row.get(field) or [], which, f'{where}["{field}"]')
  for field in ('link', 'reason', 'scope'):
    _optional_text(row.get(field), which, f'{where}["{field}"]')
  for field in ('bytes', 'count'):
    _count(row.get(field) or 0, which, f'{where}["{field}"]')


def _axis_name(name: str, which: str, where: str) -> None:
  if not name.isidentifier():
    raise _fail(which, where, name, 'a mesh axis name, or a list of them')


def _texts(values: Any, which: str, where: str) -> None:
  if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
    raise _fail(which, where, values, 'a list of text')


def _optional_text(value: Any, which: str, where: str) -> None:
  if value is not None and not isinstance(value, str):
    raise _fail(which, where, value, 'text')


def _count(value: Any, which: str, where: str, least: int = 0) -> None:
  """An integer of at least ``least``: never text ("1 KiB"), a fraction,
  NaN, infinity or a bool."""
  whole = isinstance(value, float) and math.isfinite(value) and value.is_integer()
  if (type(value) is not int and not whole) or value < least:
    raise _fail(which, where, value, f'a whole number, at least {least}')


def _spec(text: Any, which: str, where: str) -> None:
  if not isinstance(text, str):
    raise _fail(which, where, text, 'spec text such as "P(None, \'model\')"')


# Spec text, read for what it means
# ------------------------------------------------------------------------------


def spec_key(text: str) -> str:
  """Spec text as what it lays out: spaces, quotes, one-name tuples and the
  trailing ``None`` s that change nothing do not count. Text that is no
  ``P(...)`` (a sharding of another kind) is its own key.

  Example:
    >>> spec_key("P(None,'model', None)") == spec_key('P(None, "model")')
    True
  """
  parsed = _parse(text)
  if parsed is None:
    return text.strip()
  entries, extra = parsed
  while entries and entries[-1] == 'None':
    entries.pop()
  return f'P({", ".join([*entries, *extra])})'


def spec_text(text: str, rank: int | None = None) -> str:
  """Spec text written as ``fsm.snapshot`` writes it (``P(None, 'model')``),
  padded with ``None`` to ``rank`` entries where given.

  Example:
    >>> spec_text("P(None,'model')"), spec_text("P('data')", rank=2)
    ("P(None, 'model')", "P('data', None)")
  """
  parsed = _parse(text)
  if parsed is None:
    return text
  entries, extra = parsed
  if rank is not None and len(entries) < rank:
    entries += ['None'] * (rank - len(entries))
  return f'P({", ".join([*entries, *extra])})'


def _parse(text: str) -> tuple[list[str], list[str]] | None:
  """``P(...)`` text as its entries and keyword parts, each as written
  canonically; None when it is not such text."""
  try:
    node = ast.parse(text.strip(), mode='eval').body
  except SyntaxError:
    return None
  if not isinstance(node, ast.Call) or _name(node.func) not in ('P', 'PartitionSpec'):
    return None
  entries = [_entry(a) for a in node.args]
  extra = []
  for kw in sorted(node.keywords, key=lambda k: k.arg or ''):
    names = _names(kw.value)
    if kw.arg is None or names is None:
      return None
    if names:
      extra.append(f'{kw.arg}={{{", ".join(repr(n) for n in sorted(names))}}}')
  if any(e is None for e in entries):
    return None
  return [e for e in entries if e is not None], extra


def _name(node: ast.expr) -> str | None:
  if isinstance(node, ast.Name):
    return node.id
  return node.attr if isinstance(node, ast.Attribute) else None


def _entry(node: ast.expr) -> str | None:
  """One entry: ``'model'``, ``None``, ``UNCONSTRAINED`` or a tuple of names
  (one name alone, or none, reads as that name, or ``None``)."""
  if isinstance(node, ast.Constant) and (
    node.value is None or isinstance(node.value, str)
  ):
    return repr(node.value)
  if _name(node) == 'UNCONSTRAINED':
    return 'UNCONSTRAINED'
  names = _names(node) if isinstance(node, ast.Tuple) else None
  if names is None:
    return None
  if len(names) < 2:
    return repr(names[0]) if names else 'None'
  return f'({", ".join(repr(n) for n in names)})'


def _names(node: ast.expr) -> list[str] | None:
  if isinstance(node, ast.Call) and _name(node.func) in ('set', 'frozenset'):
    return [] if not node.args else None
  if not isinstance(node, (ast.Tuple, ast.List, ast.Set)):
    return None
  values = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
  return values if all(isinstance(v, str) for v in values) else None  # type: ignore[return-value]
