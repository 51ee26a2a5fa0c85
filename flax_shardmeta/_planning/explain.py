"""Why each dimension of a plan entry has its mesh axes.

Explanations are made on demand (``PlanEntry.explain``) and cached per
distinct (shape, annotation, rules, mesh, spec), so plans stay cheap to build.
Like ``fsm.explain_resolution``, an entry's explanation is an
:class:`~flax_shardmeta._resolution.Explanation`: one line per dimension.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from jax.sharding import PartitionSpec

from flax_shardmeta import _annotation as ann_lib
from flax_shardmeta._errors import FlaxShardmetaError, message
from flax_shardmeta._resolution import Explanation, RuleStep, explain_resolution
from flax_shardmeta._specs import spec_entries


@dataclasses.dataclass(frozen=True)
class ExplainedDim:
  """How one dimension of a plan entry got its mesh axes.

  Attributes:
    dim: the dimension's index.
    name: the annotation entry as written (None when not annotated).
    mesh_axes: the mesh axes the plan gives it (None: replicated).
    steps: every rule that names it, in priority order, and what it did.
    note: the outcome in words when no rule step says it all.
  """

  dim: int
  name: Any
  mesh_axes: Any
  steps: tuple[RuleStep, ...] = ()
  note: str = ''

  def __str__(self) -> str:
    parts = [str(s) for s in self.steps]
    if self.note:
      parts.append(self.note)
    return f'dim {self.dim} {self.name!r} -> {self.mesh_axes!r}: ' + '; '.join(parts)


@functools.lru_cache(maxsize=4096)
def explain_entry(
  shape: tuple[int, ...],
  ann: ann_lib.Annotation | None,
  rules: tuple[tuple[str, Any], ...],
  mesh_axis_names: tuple[str, ...],
  spec: PartitionSpec | None,
  source: str = '',
) -> Explanation:
  """Per dimension of one entry: the rule steps and the outcome in words
  (a tuple of :class:`ExplainedDim`, printed one per line).

  ``spec`` is the final (possibly replicated) spec, so a dimension the rules
  gave mesh axes to but that ended up replicated says why. ``source`` says
  where ``rules`` come from (``''`` for rules passed explicitly).
  """
  given = spec_entries(spec) if spec is not None else ()
  final = given + (None,) * (len(shape) - len(given))
  if ann is None or len(ann.names) != len(shape) or not ann.logical:
    return _without_rules(shape, ann, final)
  try:
    dims = explain_resolution(ann.names, rules, local_rules=ann.rules, source=source)
  except FlaxShardmetaError as e:
    return Explanation(
      ExplainedDim(d, n, final[d], (), f'not resolved: {message(e)}')
      for d, n in enumerate(ann.names)
    )
  out = []
  for d, x in enumerate(dims):
    resolved = x.mesh_axes
    if not isinstance(x.name, str):
      note = 'passed through as written'
    elif resolved is None and ann.keep_mesh_names and x.name in mesh_axis_names:
      note = 'no rule gave it mesh axes; kept as the mesh axis of that name'
      resolved = x.name
    elif x.no_rules:
      note = 'no rules are given or set, so replicated'
    elif not x.steps:
      note = 'no rule names it, so replicated'
    elif not any(s.applied for s in x.steps):
      note = 'every rule was skipped, so replicated'
    else:
      note = ''
    out.append(
      ExplainedDim(
        d,
        x.name,
        final[d],
        x.steps,
        _replicated(note, resolved, final[d], ann.optimizer_state),
      )
    )
  return Explanation(out)


def _without_rules(
  shape: tuple[int, ...], ann: ann_lib.Annotation | None, final: tuple[Any, ...]
) -> Explanation:
  """An entry no rule takes part in: not annotated, another rank, mesh axes."""
  if ann is None:
    return Explanation(
      ExplainedDim(d, None, None, (), 'not annotated, so replicated')
      for d in range(len(shape))
    )
  if len(ann.names) != len(shape):
    note = (
      f'optimizer state under a rank-{len(ann.names)} annotation '
      f'{ann.names!r}: replicated'
      if ann.optimizer_state
      else f'{len(ann.names)} names for a rank-{len(shape)} array: not planned'
    )
    return Explanation(
      ExplainedDim(d, None, final[d], (), note) for d in range(len(shape))
    )
  return Explanation(
    ExplainedDim(
      d,
      n,
      final[d],
      (),
      _replicated(
        'mesh axes as written' if n is not None else 'replicated as written',
        n,
        final[d],
        ann.optimizer_state,
      ),
    )
    for d, n in enumerate(ann.names)
  )


def _replicated(note: str, resolved: Any, final: Any, optimizer_state: bool) -> str:
  """Says why the final axes differ from what the rules gave, if they do."""
  if resolved is None or final is not None:
    return note
  if optimizer_state:
    # The core replicates optimizer leaves their parameter's layout does not
    # fit (e.g. adafactor's (1,)-shaped factors); problems show on the parameter.
    change = f'optimizer state that {resolved!r} cannot shard, so replicated'
  else:
    change = f'replicated instead of {resolved!r} (replicate_indivisible=True)'
  return f'{note}; {change}' if note else change
