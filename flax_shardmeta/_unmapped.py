"""Logical names no rule maps: ``strict=`` errors and the warnings.

A logical name without a usable rule is replicated. That is the documented
fallback, but some cases deserve a word: with ``strict=True`` every such name
is a problem; in any mode a name that is also a mesh-axis name gets one
:class:`UnmappedMeshAxisNameWarning` per call (mesh axes were most likely
meant), a name close to a rule's name ('mpl' for 'mlp') one
:class:`UnmappedNameWarning`, and a call that has no rules at all (none given,
none set) one :class:`UnmappedNameWarning` for everything it replicated.
Callers collect one :class:`Unmapped` record per leaf concerned (paths are
made only if something is reported) and hand them to :func:`report`.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from flax_shardmeta._errors import (
  ShardingProblem,
  UnmappedMeshAxisNameWarning,
  UnmappedNameWarning,
  unmapped_hint,
)
from flax_shardmeta._specs import mesh_axes_of

MAX_PATHS = 10
"""Paths listed per warning; the rest are counted."""


@dataclasses.dataclass
class Unmapped:
  """A leaf whose logical names include some that no rule maps.

  Attributes:
    path: the leaf's path, or a function making it (called only if needed).
    shape: the leaf's shape, if known.
    names: the annotation as written.
    spec: the resolved spec (those names replicated).
    unmapped: the logical names no rule maps, in dimension order.
    rules: the rules the names were resolved with (or a function giving them).
  """

  path: str | Callable[[], str]
  shape: tuple[int, ...] | None
  names: tuple[Any, ...]
  spec: Any
  unmapped: tuple[str, ...]
  rules: Sequence[tuple[str, Any]] | Callable[[], Sequence[tuple[str, Any]]] = ()

  def path_text(self) -> str:
    path = self.path() if callable(self.path) else self.path
    return path or '<value>'

  def rule_list(self) -> Sequence[tuple[str, Any]]:
    return self.rules() if callable(self.rules) else self.rules


def unmapped_names(
  names: Sequence[Any], resolved: Sequence[Any], unassigned: Any
) -> tuple[str, ...]:
  """The string names whose resolution is ``unassigned``."""
  return tuple(
    n for n, r in zip(names, resolved) if r is unassigned and isinstance(n, str)
  )


def skipped_rules(record: Unmapped, name: str) -> list[str]:
  """Why each rule of ``name`` was skipped (an unmapped name's rules all were).

  A rule is skipped only when one of its mesh axes is already used by another
  dimension, and the spec only ever gains axes, so the final spec shows it.
  """
  entries = tuple(record.spec) if record.spec is not None else ()
  owner = {a: d for d, e in enumerate(entries) for a in mesh_axes_of(e)}
  out = []
  for k, (rule_name, target) in enumerate(record.rule_list()):
    if rule_name != name:
      continue
    clash = next((a for a in mesh_axes_of(target) if a in owner), None)
    if clash is None:
      continue
    d = owner[clash]
    held = record.names[d] if d < len(record.names) else None
    out.append(
      f'rule #{k} {(rule_name, target)!r}: mesh axis {clash!r} is already used '
      f'by dimension {d} ({held!r})'
    )
  return out


def close_rule_name(
  record: Unmapped, name: str, *, strict_match: bool = False
) -> str | None:
  """The rule name ``name`` is most likely a misspelling of, if any.

  ``strict_match``: only near-certain cases (one typing slip apart), for
  warnings outside strict mode.
  """
  candidates = sorted({r for r, _ in record.rule_list() if r != name})
  found = difflib.get_close_matches(name, candidates, n=1)
  if not found:
    return None
  if strict_match and not _one_slip(name, found[0]):
    return None
  return found[0]


def _one_slip(a: str, b: str) -> bool:
  """One typing slip apart: two neighbours swapped, one letter more or less, or
  (in names of 5 letters or more, where it is rarely a different word) one
  letter changed."""
  if len(a) == len(b):
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if len(diff) == 2 and diff[1] == diff[0] + 1:
      return a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]]
    return len(diff) == 1 and len(a) >= 5
  short, long_ = sorted((a, b), key=len)
  if len(long_) - len(short) != 1 or len(short) < 3:
    return False
  return any(long_[:i] + long_[i + 1 :] == short for i in range(len(long_)))


def _rule_of(record: Unmapped, name: str) -> tuple[str, Any] | None:
  return next((r for r in record.rule_list() if r[0] == name), None)


def _problem(r: Unmapped, n: str, axes: frozenset[str], no_rules: bool):
  dims = tuple(i for i, m in enumerate(r.names) if m == n)
  skipped = skipped_rules(r, n)
  if no_rules:
    reason = (
      f"logical name '{n}' was not resolved: no logical axis rules are given "
      'or set (strict=True)'
    )
    hint = (
      "set rules with fsm.logical_axis_rules([...]) (or flax's "
      'nn.logical_axis_rules), or pass rules=...'
    )
  elif skipped:
    reason = (
      f"every rule for logical name '{n}' was skipped (strict=True): "
      + '; '.join(skipped)
    )
    hint = (
      'give that dimension another mesh axis, put the rule first, add a '
      f"fallback rule ('{n}', <another mesh axis>), or ('{n}', None) to "
      'replicate it on purpose'
    )
  else:
    reason = (
      f"no usable rule maps logical name '{n}' (strict=True); "
      'fsm.explain_resolution shows which rules were tried'
    )
    close = close_rule_name(r, n)
    if close is not None:
      hint = (
        f"did you mean '{close}' (rule {_rule_of(r, close)!r})? Otherwise add "
        f"a rule such as ('{n}', 'model'), or ('{n}', None) to replicate it "
        'on purpose'
      )
    elif n in axes:
      hint = unmapped_hint(n)
    else:
      hint = (
        f"add a rule such as ('{n}', 'model'), or ('{n}', None) to replicate "
        'it on purpose'
      )
  return ShardingProblem(r.path_text(), r.shape, r.names, r.spec, reason, hint, dims)


def _listed(where: list[Unmapped]) -> str:
  shown = [r.path_text() for r in where[:MAX_PATHS]]
  more = len(where) - len(shown)
  return ', '.join(shown) + (f' and {more} more' if more else '')


def report(
  records: Iterable[Unmapped],
  mesh_axis_names: Iterable[str],
  strict: bool,
  *,
  stacklevel: int = 3,
  also: str = '',
  no_rules: bool = False,
) -> list[ShardingProblem]:
  """Warns (non-strict) and returns the strict problems.

  Args:
    records: the leaves with unmapped names, in tree order.
    mesh_axis_names: the axes of the mesh in use (empty if none is known).
    strict: whether every unmapped name is a problem.
    stacklevel: passed to ``warnings.warn`` (2 + the caller's depth below the
      user's call).
    also: one more way out the caller offers, appended to the warning.
    no_rules: no rules were given or set at all for this call.

  Returns:
    With ``strict``, one problem per unmapped name and leaf; else ``[]``.
  """
  records = list(records)
  if not records:
    return []
  axes = frozenset(mesh_axis_names)
  if strict:
    return [_problem(r, n, axes, no_rules) for r in records for n in r.unmapped]
  if no_rules:
    # Leaves with per-variable rules of their own are reported as usual.
    own = [r for r in records if r.rule_list()]
    _warn_per_name(own, axes, stacklevel + 1, also)
    records = [r for r in records if not r.rule_list()]
    if records:
      _warn_no_rules(records, axes, stacklevel + 1, also)
    return []
  _warn_per_name(records, axes, stacklevel + 1, also)
  return []


def _warn_no_rules(
  records: list[Unmapped], axes: frozenset[str], stacklevel: int, also: str
) -> None:
  """One :class:`UnmappedNameWarning` for all a call replicated with no rules."""
  names = sorted({n for r in records for n in r.unmapped})
  as_axes = [n for n in names if n in axes]
  shown = ', '.join(repr(n) for n in names[:MAX_PATHS])
  meant = (
    f' ({", ".join(map(repr, as_axes))} '
    + ('is also a mesh-axis name' if len(as_axes) == 1 else 'are also mesh-axis names')
    + ': annotate with `with_partitioning`, or pass logical=False to '
    'shard_value, if mesh axes were meant)'
    if as_axes
    else ''
  )
  warnings.warn(
    f'{len(records)} array(s) have logical names ({shown}) but no logical '
    'axis rules are given or set (rules=None, and neither '
    "fsm.logical_axis_rules nor flax's nn.logical_axis_rules is active), so "
    f'they were replicated{meant}. Set rules with '
    'fsm.logical_axis_rules([...]) or pass rules=...; strict=True makes this '
    f'an error, rules=() replicates on purpose. {also}Concerned: '
    f'{_listed(records)}.',
    UnmappedNameWarning,
    stacklevel=stacklevel,
  )


def _warn_per_name(
  records: list[Unmapped], axes: frozenset[str], stacklevel: int, also: str
) -> None:
  """One warning per unmapped name that is a mesh axis or a near miss."""
  by_name: dict[str, list[Unmapped]] = {}
  close: dict[str, str] = {}
  for r in records:
    for n in r.unmapped:
      if n in axes:
        by_name.setdefault(n, []).append(r)
        continue
      match = close.get(n) or close_rule_name(r, n, strict_match=True)
      if match is not None and _rule_of(r, n) is None:
        close[n] = match
        by_name.setdefault(n, []).append(r)
  for name, where in by_name.items():
    skipped = skipped_rules(where[0], name)
    if skipped:
      head = (
        f"Logical name '{name}' was replicated: every rule for it was skipped "
        f'({"; ".join(skipped)}). '
      )
    else:
      head = f"Logical name '{name}' is not mapped by any rule, so it was replicated"
    if name in axes:
      tail = (
        'It is also a mesh-axis name: if mesh axes were meant, annotate with '
        '`with_partitioning`. '
        if skipped
        else f', but it is also a mesh-axis name: {unmapped_hint(name)} '
      )
      category: type[UserWarning] = UnmappedMeshAxisNameWarning
    else:
      rule = _rule_of(where[0], close[name])
      tail = f"; did you mean '{close[name]}' (rule {rule!r})? "
      category = UnmappedNameWarning
    warnings.warn(
      f'{head}{tail}{also}Concerned: {_listed(where)}.',
      category,
      stacklevel=stacklevel,
    )
