"""Spec entries: what one dimension maps to, and how entries are shown.

The vocabulary every other module shares: ``UNCONSTRAINED`` and ``UNASSIGNED``
markers, the mesh axes of an entry, and the one text rendering of specs used
by errors, explanations, plans and JSON.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from jax.sharding import PartitionSpec

UNCONSTRAINED = PartitionSpec.UNCONSTRAINED
"""Leave the dimension's layout to the compiler."""


class _Unassigned:
  def __repr__(self) -> str:
    return 'UNASSIGNED'


UNASSIGNED: Any = _Unassigned()
"""Marker for a logical dimension no rule could assign (see ``_resolution.resolve``)."""


def mesh_axes_of(entry: Any) -> tuple[str, ...]:
  """The mesh-axis names one spec entry uses.

  Example:
    >>> mesh_axes_of(('data', 'fsdp')), mesh_axes_of(None)
    (('data', 'fsdp'), ())
  """
  if isinstance(entry, str):
    return (entry,)
  if isinstance(entry, tuple):
    return tuple(a for a in entry if isinstance(a, str))
  return ()


def unassigned_to_none(resolved: Iterable[Any]) -> tuple[Any, ...]:
  """Resolved entries with every ``UNASSIGNED`` dimension replicated (None).

  Example:
    >>> unassigned_to_none(('model', UNASSIGNED))
    ('model', None)
  """
  return tuple(None if r is UNASSIGNED else r for r in resolved)


def format_entry(entry: Any) -> str:
  """One spec entry as it reads in a PartitionSpec.

  Example:
    >>> format_entry('model'), format_entry(('data', 'model'))
    ("'model'", "('data', 'model')")
    >>> format_entry(UNCONSTRAINED)
    'UNCONSTRAINED'
  """
  if isinstance(entry, str):
    return repr(entry)
  if isinstance(entry, tuple):
    return '(' + ', '.join(format_entry(e) for e in entry) + ')'
  if entry is None:
    return 'None'
  return 'UNCONSTRAINED' if entry is UNCONSTRAINED else repr(entry)


def spec_entries(spec: Any) -> tuple[Any, ...]:
  """The per-dimension entries of a PartitionSpec or names tuple.

  A PartitionSpec with unreduced or reduced axes refuses ``tuple(spec)``;
  its ``partitions`` are the entries.

  Example:
    >>> spec_entries(PartitionSpec('data', None)), spec_entries(('embed',))
    (('data', None), ('embed',))
  """
  partitions = getattr(spec, 'partitions', None)
  if isinstance(spec, PartitionSpec) and partitions is not None:
    return tuple(partitions)
  return tuple(spec)


def spec_sets(spec: Any) -> tuple[frozenset[str], frozenset[str]]:
  """A PartitionSpec's ``(unreduced, reduced)`` mesh axes (empty for names).

  Example:
    >>> spec_sets(PartitionSpec('data', reduced={'model'}))
    (frozenset(), frozenset({'model'}))
  """
  if not isinstance(spec, PartitionSpec):
    return frozenset(), frozenset()
  unreduced = getattr(spec, 'unreduced', None) or ()
  return frozenset(unreduced), frozenset(getattr(spec, 'reduced', None) or ())


def reductions_of(spec: Any) -> PartitionSpec | None:
  """A PartitionSpec's unreduced / reduced axes (and their kind, where jax has
  one) as a PartitionSpec with no dimensions; None when it has none.

  Example:
    >>> reductions_of(PartitionSpec('data', reduced={'model'}))
    P(reduced={'model'})
  """
  if not any(spec_sets(spec)):
    return None
  return spec.update(partitions=())


def make_spec(entries: Iterable[Any], reductions: Any = None) -> PartitionSpec:
  """``PartitionSpec(*entries)`` with the axes of :func:`reductions_of`, if any."""
  if reductions is None:
    return PartitionSpec(*entries)
  return reductions.update(partitions=tuple(entries))


def format_spec(spec: Any) -> str:
  """A PartitionSpec or names tuple as short, stable text.

  Example:
    >>> format_spec(PartitionSpec('data', None)), format_spec(('embed',))
    ("P('data', None)", "('embed',)")
    >>> format_spec(PartitionSpec('data', None, reduced={'model'}))
    "P('data', None, reduced={'model'})"
  """
  if spec is None:
    return 'None'
  dims = spec_entries(spec)
  entries = ', '.join(format_entry(e) for e in dims)
  # jax >= 0.9 names the class `P`, so the type is checked, not its name.
  if isinstance(spec, PartitionSpec):
    for kind, axes in zip(('unreduced', 'reduced'), spec_sets(spec)):
      if axes:
        listed = ', '.join(repr(a) for a in sorted(axes))
        entries += f'{", " if entries else ""}{kind}={{{listed}}}'
    return f'P({entries})'
  return f'({entries}{"," if len(dims) == 1 else ""})'


def json_entry(entry: Any) -> Any:
  """One spec entry as JSON: a name, a list of names, None or 'UNCONSTRAINED'."""
  if entry is None or isinstance(entry, str):
    return entry
  if isinstance(entry, tuple):
    return [json_entry(e) for e in entry]
  return format_entry(entry)
