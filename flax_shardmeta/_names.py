"""Names: one entry per dimension, checked for form.

An entry is a name (a logical name or a mesh axis), None, ``UNCONSTRAINED`` or a
tuple of mesh-axis names. Every way in (boxes, NNX metadata, ``shard_value``,
``logical_to_mesh_axes``, resolution) goes through :func:`as_names`, so names
are refused for the same faults with the same words everywhere.
"""

from __future__ import annotations

from typing import Any

from jax.sharding import PartitionSpec

from flax_shardmeta._errors import InvalidNamesError
from flax_shardmeta._specs import UNCONSTRAINED, format_spec, spec_sets


def as_names(names: Any) -> tuple[Any, ...]:
  """Names as a checked tuple, one entry per dimension.

  Lists become tuples (a list of mesh axes inside too). Refused with an
  :class:`InvalidNamesError`: a bare string, anything but a sequence, an
  entry that is no name (an integer, a nested tuple), and a PartitionSpec's
  unreduced / reduced axes, which one entry per dimension cannot hold.

  Example:
    >>> as_names(['embed', ['data', 'model']])
    ('embed', ('data', 'model'))
  """
  if isinstance(names, (str, bytes)):
    raise InvalidNamesError(
      f'names must be a sequence with one entry per dimension, got the '
      f'string {names!r}; write ({names!r},) for a rank-1 value.'
    )
  if not isinstance(names, (tuple, list, PartitionSpec)):
    raise InvalidNamesError(
      f'names must be a tuple (or list) with one entry per dimension, got '
      f'{_describe(names)}.'
    )
  if any(spec_sets(names)):
    raise InvalidNamesError(
      f'names {format_spec(names)} have unreduced / reduced axes, which names '
      'of one entry per dimension cannot hold; give them in an NNX '
      "Variable's out_sharding or in match_partition_rules specs."
    )
  out = tuple(tuple(n) if isinstance(n, list) else n for n in names)
  check_entries(out)
  return out


def _describe(x: Any) -> str:
  """A value's type and, for small values only, its text (never array contents)."""
  if x is None or isinstance(x, (str, int, float, bool)):
    return f'{type(x).__name__} {x!r}'
  if hasattr(x, 'shape') and hasattr(x, 'dtype'):
    return f'an array of shape {tuple(x.shape)}'
  return f'a {type(x).__name__}'


_OK = object()


def _entry_issue(entry: Any) -> str | None:
  if entry is None or entry is UNCONSTRAINED or isinstance(entry, str):
    return None
  if isinstance(entry, tuple):
    inner = next((a for a in entry if not isinstance(a, str)), _OK)
    if inner is _OK:
      return None
    if isinstance(inner, (tuple, list)):
      return (
        f'a tuple of mesh axes holds mesh-axis names only, not another tuple '
        f'({inner!r}); flatten it, e.g. '
        f'{tuple(a for e in entry for a in (e if isinstance(e, tuple) else (e,)))!r}'
      )
    return (
      f'a tuple of mesh axes holds mesh-axis names (strings), not {_describe(inner)}'
    )
  return (
    f'{_describe(entry)} is no name: an entry is a name (str), None, '
    'PartitionSpec.UNCONSTRAINED or a tuple of mesh-axis names'
  )


def check_entries(names: tuple[Any, ...]) -> None:
  """Refuses malformed entries: integers, nested tuples, anything not a name."""
  for i, n in enumerate(names):
    issue = _entry_issue(n)
    if issue is not None:
      raise InvalidNamesError(f'dimension {i} of names {format_spec(names)}: {issue}.')


def check_names(names: tuple[Any, ...]) -> None:
  """:func:`check_entries`, and a logical name may name one dimension only."""
  check_entries(names)
  seen = set()
  for n in names:
    if isinstance(n, str):
      if n in seen:
        raise InvalidNamesError(
          f"Logical name '{n}' appears more than once in "
          f'{format_spec(names)}; each logical name may name one dimension '
          'only. Rename one of them.'
        )
      seen.add(n)


def annotation_names(names: Any) -> tuple[Any, ...]:
  """:func:`as_names` for an annotation (a box's, an NNX Variable's): one
  name per dimension, so unreduced / reduced axes are refused too.

  Example:
    >>> annotation_names(['embed', None])
    ('embed', None)
  """
  if not isinstance(names, str) and any(spec_sets(names)):
    raise InvalidNamesError(
      f'names {format_spec(names)} have unreduced / reduced axes, which an '
      'annotation of one name per dimension cannot hold; give them in an NNX '
      "Variable's out_sharding or in match_partition_rules specs."
    )
  return as_names(names)
