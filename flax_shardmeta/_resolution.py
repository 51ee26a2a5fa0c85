"""Resolution: what the rules give each dimension, and why.

Resolution walks the rules in priority order; a rule gives its mesh axes to
its name's dimension when that dimension has no assignment yet and none of the
mesh axes is already used by another dimension of the same spec. Names left
without a usable rule are replicated. Linen boxes, NNX Variables, constraints
and plans all go through :func:`resolve`, so they share one semantics, and
:func:`explain_resolution` walks the same loop, so it always agrees with it.

"Explain" means one thing across the library: an :class:`Explanation`, one
line per dimension saying which rule gave its mesh axes and which were skipped
(``fsm.explain_resolution`` for names, ``PlanEntry.explain`` for a planned
array).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, overload

import jax
from jax.sharding import PartitionSpec

from flax_shardmeta import _unmapped as unmapped_lib
from flax_shardmeta._errors import ShardingError
from flax_shardmeta._names import as_names, check_names
from flax_shardmeta._rules import (
  SOURCE_NONE,
  SOURCE_PER_VARIABLE,
  composite_rules,
  context_rules,
  normalize_rules,
  rules_and_source,
)
from flax_shardmeta._specs import (
  UNASSIGNED,
  format_entry,
  mesh_axes_of,
  unassigned_to_none,
)
from flax_shardmeta._typing import LogicalNames, LogicalRules


class Explanation(tuple):
  """Per-dimension explanations: a tuple, printed one dimension per line.

  What every ``explain`` of the library returns: ``fsm.explain_resolution``
  (items :class:`DimExplanation`) and ``PlanEntry.explain`` (items
  ``ExplainedDim``, which also say what happened after the rules).

  Example:
    >>> print(Explanation(['dim 0: replicated', 'dim 1: model']))
    dim 0: replicated
    dim 1: model
  """

  __slots__ = ()

  def __str__(self) -> str:
    return '\n'.join(str(x) for x in self)


@dataclasses.dataclass(frozen=True)
class RuleStep:
  """What one rule did to one dimension during resolution."""

  rule_index: int
  rule: tuple[str, Any]
  applied: bool
  reason: str
  source: str = ''
  """Where the rule comes from: '' for rules passed as ``rules=``, else
  ``fsm.logical_axis_rules``, ``flax's nn.logical_axis_rules`` or
  ``per-variable rules``."""
  clash: tuple[str, int] | None = None
  """For a rule skipped because one of its mesh axes is taken: that axis and
  the dimension already using it (``reason`` says the same in words)."""

  def __str__(self) -> str:
    verb = 'gave' if self.applied else 'skipped'
    origin = f' of {self.source}' if self.source else ''
    return f'rule #{self.rule_index} {self.rule!r}{origin} {verb}: {self.reason}'


@dataclasses.dataclass(frozen=True)
class DimExplanation:
  """How one dimension got its mesh axes."""

  name: Any
  mesh_axes: Any
  steps: tuple[RuleStep, ...]
  no_rules: bool = False
  """No rules were given or set at all."""

  def __str__(self) -> str:
    if not isinstance(self.name, str):
      return f'{self.name!r} passed through as written'
    if self.no_rules:
      return (
        f"'{self.name}': no rules are set (rules=None, and neither "
        "fsm.logical_axis_rules nor flax's nn.logical_axis_rules is active), so "
        'replicated'
      )
    if not self.steps:
      return f"'{self.name}': no rule names it, so replicated"
    return f"'{self.name}': " + '; '.join(str(s) for s in self.steps)


def _assign(
  names: tuple[Any, ...],
  rules: tuple[tuple[str, Any], ...],
  steps: list[list[RuleStep]] | None,
) -> tuple[Any, ...]:
  """The resolution loop; records each rule's effect in ``steps`` when given.

  Rules are walked in priority order. A rule assigns its mesh axes to its
  name's dimension when that dimension has none yet and none of the axes is
  already used by another dimension of the spec.
  """
  check_names(names)
  result: list[Any] = [UNASSIGNED if isinstance(n, str) else n for n in names]
  if steps is None and UNASSIGNED not in result:
    return tuple(result)
  position = {n: i for i, n in enumerate(names) if isinstance(n, str)}
  # Which dimension owns each mesh axis so far (names written as mesh axes too).
  owner = {a: i for i, r in enumerate(result) for a in mesh_axes_of(r)}
  assigned_by: dict[int, int] = {}
  for k, (name, target) in enumerate(rules):
    pos = position.get(name)
    if pos is None:
      continue
    if result[pos] is not UNASSIGNED:
      if steps is not None:
        steps[pos].append(
          RuleStep(
            k,
            (name, target),
            False,
            f'dimension already assigned by rule #{assigned_by[pos]}',
          )
        )
      continue
    axes = mesh_axes_of(target)
    clash = next((a for a in axes if a in owner), None)
    if clash is not None:
      if steps is not None:
        j = owner[clash]
        steps[pos].append(
          RuleStep(
            k,
            (name, target),
            False,
            f"mesh axis '{clash}' already used by dimension {j} ({names[j]!r})",
            clash=(clash, j),
          )
        )
      continue
    result[pos] = target
    assigned_by[pos] = k
    owner.update((a, pos) for a in axes)
    if steps is not None:
      shown = 'replicated (None)' if target is None else format_entry(target)
      steps[pos].append(RuleStep(k, (name, target), True, shown))
  return tuple(result)


@functools.lru_cache(maxsize=65536)
def _resolve_cached(
  names: tuple[Any, ...], rules: tuple[tuple[str, Any], ...]
) -> tuple[Any, ...]:
  return _assign(names, rules, None)


def resolve(names: LogicalNames, rules: LogicalRules | None) -> tuple[Any, ...]:
  """Resolves logical names to per-dimension mesh axes (cached).

  Dimensions no rule could assign come back as :data:`UNASSIGNED` so callers
  can choose a fallback; :func:`logical_to_mesh_axes` replicates them.
  """
  rules_t = normalize_rules(rules)
  try:
    return _resolve_cached(tuple(names), rules_t)
  except TypeError:  # unhashable entries (lists of mesh axes), or no sequence
    return _resolve_cached(as_names(names), rules_t)


def explain_resolution(
  names: LogicalNames,
  rules: LogicalRules | None = None,
  *,
  local_rules: LogicalRules | None = None,
  source: str | None = None,
) -> Explanation:
  """Per-dimension account of which rule gave the mesh axes and which were skipped.

  The result is a tuple of :class:`DimExplanation`, printed one per line.

  The same loop as :func:`resolve`, recording each rule's effect, so the
  explanation always agrees with the resolution. With ``rules=None`` the
  context rules are explained, and each step says which context they come
  from (``fsm.logical_axis_rules`` or flax's ``nn.logical_axis_rules``).

  Args:
    names: one logical name (or None, mesh-axis tuple...) per dimension.
    rules: the rules; None uses the context rules.
    local_rules: per-variable rules, composed after ``rules``.
    source: where ``rules`` come from, shown with each step (found out when
      ``rules`` is None).

  Example:
    >>> import flax_shardmeta as fsm
    >>> for d in fsm.explain_resolution(('bar', 'foo'),
    ...                                 [('foo', 'model'), ('bar', 'model')]):
    ...   print(d)
    'bar': rule #1 ('bar', 'model') skipped: mesh axis 'model' already used by
           dimension 1 ('foo')
    'foo': rule #0 ('foo', 'model') gave: 'model'
    >>> import flax.linen as nn
    >>> with nn.logical_axis_rules([('foo', 'model')]):
    ...   print(fsm.explain_resolution(('foo',))[0])
    'foo': rule #0 ('foo', 'model') of flax's nn.logical_axis_rules gave: 'model'
  """
  names = as_names(names)
  if rules is None:
    global_rules, found = context_rules()
  else:
    global_rules, found = normalize_rules(rules), ''
  source = found if source is None else source
  all_rules = composite_rules(global_rules, local_rules)
  steps: list[list[RuleStep]] = [[] for _ in names]
  result = _assign(names, all_rules, steps)
  n_global = len(global_rules)
  sourced = [
    [
      dataclasses.replace(
        st, source=source if st.rule_index < n_global else SOURCE_PER_VARIABLE
      )
      for st in dim
    ]
    for dim in steps
  ]
  return Explanation(
    DimExplanation(n, m, tuple(st), no_rules=not all_rules and source == SOURCE_NONE)
    for n, m, st in zip(names, unassigned_to_none(result), sourced)
  )


@overload
def logical_to_mesh_axes(
  names: None, rules: LogicalRules | None = None, *, strict: bool = False
) -> None: ...
@overload
def logical_to_mesh_axes(
  names: LogicalNames, rules: LogicalRules | None = None, *, strict: bool = False
) -> PartitionSpec: ...
def logical_to_mesh_axes(
  names: LogicalNames | None,
  rules: LogicalRules | None = None,
  *,
  strict: bool = False,
) -> PartitionSpec | None:
  """Resolves logical dimension names to a PartitionSpec of mesh axes.

  Rules apply in order, so earlier rules have priority whatever the order of
  the dimensions; a name with no usable rule is replicated; ``None`` and
  ``PartitionSpec.UNCONSTRAINED`` entries pass through. ``rules=None`` uses
  the context rules. A replicated name that is an axis of the mesh set by
  ``jax.set_mesh`` gets an :class:`UnmappedMeshAxisNameWarning`.

  Args:
    names: one logical name (or None, a mesh-axis tuple, UNCONSTRAINED) per
      dimension.
    rules: logical axis rules; None uses the context rules.
    strict: raise a ShardingError for a name no usable rule maps instead of
      replicating it.

  Example:
    >>> import flax_shardmeta as fsm
    >>> fsm.logical_to_mesh_axes(('bar', 'foo'),
    ...                          [('foo', 'model'), ('bar', 'model')])
    P(None, 'model')
  """
  if names is None:
    return None
  # Model code calls this per activation, also where no rules are meant to be
  # set (planning, single device): no rules at all is not worth a warning here.
  rules_t = rules_and_source(rules)[0]
  names = as_names(names)
  resolved = resolve(names, rules_t)
  spec = PartitionSpec(*unassigned_to_none(resolved))
  missing = unmapped_lib.unmapped_names(names, resolved, UNASSIGNED)
  if missing:
    record = unmapped_lib.Unmapped('<names>', None, names, spec, missing, rules_t)
    problems = unmapped_lib.report([record], _context_mesh_axes(), strict, stacklevel=3)
    if problems:
      raise ShardingError(problems)
  return spec


def _context_mesh_axes() -> tuple[str, ...]:
  # Only the axis names are needed: the abstract mesh of jax.set_mesh has them.
  return tuple(jax.sharding.get_abstract_mesh().axis_names)
