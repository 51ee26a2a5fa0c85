"""Partition specs for models with no annotations, by regex over parameter paths."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from jax.sharding import PartitionSpec

from flax_shardmeta._annotation import Leaf, walk
from flax_shardmeta._errors import InvalidNamesError, InvalidRulesError, message
from flax_shardmeta._names import check_entries
from flax_shardmeta._specs import make_spec, reductions_of, spec_entries
from flax_shardmeta._typing import PyTree

PartitionRules = Sequence[tuple[str, Any]]
"""``(regex, spec)`` pairs; the first whose regex is found in a leaf's
'/'-joined path wins. A spec is a ``PartitionSpec``, or short for one: a mesh
axis ``'model'`` (``P('model')``), ``None`` (``P()``) or a tuple / list of
entries (``P(*t)``)."""


def match_partition_rules(
  rules: PartitionRules, tree: PyTree, min_size: int | None = None
) -> PyTree:
  """A PartitionSpec per array leaf, chosen by regex over its path.

  ``re.search`` runs over '/'-joined parameter paths and the first matching
  rule wins. A path is the parameter's own (``Dense_0/kernel``), also for
  Linen boxes (``nn.Partitioned``, fsm boxes) and NNX Variables: never the
  box's or Variable's inner ``value`` field, so ``'kernel$'`` matches on
  Linen variables, boxed trees and ``nnx.State`` alike. The result has the
  structure :func:`flax_shardmeta.get_sharding` gives the same tree (a spec
  where a box was; inside the Variable for NNX state).

  Scalars, and leaves with fewer than ``min_size`` elements, get ``P()``;
  ``min_size=None`` (the default) means no size threshold. Specs longer than
  the leaf's rank are trimmed. Leaves no rule matches are all reported in
  one InvalidRulesError, as are rules that are not ``(regex, spec)`` pairs.
  A spec may be written short: ``'model'`` for ``P('model')``, ``None`` for
  ``P()``, a tuple for ``P(*t)``. The result, a tree of ``PartitionSpec``
  (mesh axes), can go to :func:`flax_shardmeta.get_sharding` as it is.

  Example:
    >>> import jax.numpy as jnp, flax_shardmeta as fsm
    >>> from jax.sharding import PartitionSpec as P
    >>> params = {'dense': {'kernel': jnp.zeros((4, 8)), 'bias': jnp.zeros(8)}}
    >>> fsm.match_partition_rules(
    ...     [('kernel$', P(None, 'model')), ('.*', P())], params)
    {'dense': {'bias': P(), 'kernel': P(None, 'model')}}
    >>> fsm.match_partition_rules([('bias$', 'model'), ('.*', None)], params)
    {'dense': {'bias': P('model',), 'kernel': P()}}
  """
  compiled = _compile(rules)
  unmatched: list[str] = []

  def choose(lf: Leaf) -> Any:
    shape = getattr(lf.value, 'shape', None)
    if shape is None:
      return None
    if len(shape) == 0 or (min_size is not None and math.prod(shape) < min_size):
      return PartitionSpec()
    name = lf.path
    for regex, spec in compiled:
      if regex.search(name):
        entries = spec_entries(spec)
        if len(entries) <= len(shape):
          return spec
        return make_spec(entries[: len(shape)], reductions_of(spec))
    unmatched.append(f'{name} {tuple(shape)}')
    return None

  leaves, build = walk(tree, every_path=True)
  out = build([choose(lf) for lf in leaves])
  if unmatched:
    raise InvalidRulesError(
      f'No partition rule matches {len(unmatched)} leaf path(s):\n'
      + '\n'.join(f'  - {u}' for u in unmatched)
      + "\nAdd a rule for them, e.g. a final catch-all ('.*', P())."
    )
  return out


def _compile(rules: Any) -> list[tuple[re.Pattern[str], PartitionSpec]]:
  """Checked ``(compiled regex, PartitionSpec)`` pairs."""
  if isinstance(rules, (str, bytes, dict)) or not isinstance(rules, Sequence):
    kind = 'a dict' if isinstance(rules, dict) else type(rules).__name__
    raise InvalidRulesError(
      f'partition rules must be a sequence of (regex, spec) pairs in priority '
      f"order, got {kind}. Write e.g. [('kernel$', P(None, 'model')), "
      "('.*', P())]"
      + (' (a list keeps the order a dict only implies)' if kind == 'a dict' else '')
      + '.'
    )
  out = []
  for i, rule in enumerate(rules):
    if (
      not isinstance(rule, (tuple, list))
      or len(rule) != 2
      or not isinstance(rule[0], str)
    ):
      raise InvalidRulesError(
        f'partition rule #{i} is {rule!r}; expected a pair (regex: str, spec), '
        "e.g. ('kernel$', P(None, 'model'))."
      )
    pattern, spec = rule
    try:
      regex = re.compile(pattern)
    except re.error as e:
      raise InvalidRulesError(
        f'partition rule #{i} {rule!r}: {pattern!r} is not a regex ({e}).'
      ) from None
    out.append((regex, _as_spec(spec, i, rule)))
  return out


def _as_spec(spec: Any, i: int, rule: Any) -> PartitionSpec:
  reductions: Any = None
  if isinstance(spec, PartitionSpec):
    # Not tuple(spec): jax refuses to iterate a spec with unreduced / reduced
    # axes, and those must be kept.
    entries: tuple[Any, ...] = spec_entries(spec)
    reductions = reductions_of(spec)
  elif spec is None:
    entries = ()
  elif isinstance(spec, str):
    entries = (spec,)
  elif isinstance(spec, (tuple, list)):
    entries = tuple(tuple(e) if isinstance(e, list) else e for e in spec)
  else:
    raise InvalidRulesError(
      f'partition rule #{i} {rule!r}: the spec must be a PartitionSpec, a mesh '
      f'axis, None or a tuple of entries, not {type(spec).__name__}.'
    )
  try:
    check_entries(entries)
  except InvalidNamesError as e:
    raise InvalidRulesError(f'partition rule #{i} {rule!r}: {message(e)}') from None
  return make_spec(entries, reductions)
