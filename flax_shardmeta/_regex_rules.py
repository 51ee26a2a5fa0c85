"""Partition specs for models with no annotations, by regex over parameter paths."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from jax.sharding import PartitionSpec

from flax_shardmeta._annotation import Leaf, walk
from flax_shardmeta._errors import InvalidRulesError
from flax_shardmeta._specs import make_spec, reductions_of, spec_entries
from flax_shardmeta._typing import PyTree

PartitionRules = Sequence[tuple[str, PartitionSpec]]
"""``(regex, PartitionSpec)`` pairs; the first whose regex is found in a leaf's
'/'-joined path wins."""


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
  one InvalidRulesError.

  Example:
    >>> import jax.numpy as jnp, flax_shardmeta as fsm
    >>> from jax.sharding import PartitionSpec as P
    >>> params = {'dense': {'kernel': jnp.zeros((4, 8)), 'bias': jnp.zeros(8)}}
    >>> fsm.match_partition_rules(
    ...     [('kernel$', P(None, 'model')), ('.*', P())], params)
    {'dense': {'bias': P(), 'kernel': P(None, 'model')}}
  """
  compiled = [(re.compile(pattern), spec) for pattern, spec in rules]
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
