"""Logical axis rules: the thread-local rule context and the one resolution engine.

Rules are priority-ordered pairs ``(logical_name, mesh_axes)``. Resolution walks
the rules in order; a rule gives its mesh axes to its name's dimension when that
dimension has no assignment yet and none of the mesh axes is already used by
another dimension of the same spec. Names left without a usable rule are
replicated. Linen boxes, NNX Variables, constraints and plans all go through
:func:`resolve`, so they share one semantics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Iterator, Sequence
from typing import Any, overload

import jax
from jax.sharding import PartitionSpec

from flax_shardmeta import _unmapped as unmapped_lib
from flax_shardmeta._errors import (
  InvalidNamesError,
  InvalidRulesError,
  RuleConflictError,
  ShardingError,
)
from flax_shardmeta._specs import (
  UNASSIGNED,
  UNCONSTRAINED,
  format_entry,
  format_spec,
  mesh_axes_of,
  unassigned_to_none,
)
from flax_shardmeta._typing import LogicalNames, LogicalRules, MeshAxes

# Rule context
# ------------------------------------------------------------------------------


class _RuleContext(threading.local):
  """Per-thread stack top of logical axis rules."""

  rules: tuple[tuple[str, Any], ...] = ()


_context = _RuleContext()


def set_logical_axis_rules(rules: LogicalRules) -> None:
  """Sets the logical axis rules of the current thread.

  Example:
    >>> import flax_shardmeta as fsm
    >>> fsm.set_logical_axis_rules([('batch', 'data')])
    >>> fsm.get_logical_axis_rules()
    (('batch', 'data'),)
    >>> fsm.set_logical_axis_rules(())
  """
  _context.rules = normalize_rules(rules)


def get_logical_axis_rules() -> tuple[tuple[str, Any], ...]:
  """Returns the logical axis rules of the current thread (``()`` if none).

  Example:
    >>> import flax_shardmeta as fsm
    >>> with fsm.logical_axis_rules([('mlp', 'model')]):
    ...   print(fsm.get_logical_axis_rules())
    (('mlp', 'model'),)
    >>> fsm.get_logical_axis_rules()
    ()
  """
  return _context.rules


@contextlib.contextmanager
def logical_axis_rules(rules: LogicalRules) -> Iterator[None]:
  """Context manager binding logical axis rules for the current thread.

  Nestable; the previous rules come back on exit, also when an exception
  escapes. Other threads never see these rules.

  Example:
    >>> import flax_shardmeta as fsm
    >>> with fsm.logical_axis_rules([('mlp', 'model')]):
    ...   fsm.logical_to_mesh_axes(('embed', 'mlp'))
    P(None, 'model')
  """
  previous = _context.rules
  _context.rules = normalize_rules(rules)
  try:
    yield
  finally:
    _context.rules = previous


def normalize_rules(rules: LogicalRules | None) -> tuple[tuple[str, Any], ...]:
  """Rules as a hashable tuple of ``(name, mesh_axes)`` pairs, checked for form."""
  if rules is None:
    return ()
  if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
    raise InvalidRulesError(
      f'Logical axis rules must be a sequence of (logical_name, mesh_axes) '
      f'pairs, got {type(rules).__name__}: {rules!r}.'
    )
  out = []
  for i, rule in enumerate(rules):
    if (
      not isinstance(rule, Sequence)
      or isinstance(rule, str)
      or len(rule) != 2
      or not isinstance(rule[0], str)
    ):
      raise InvalidRulesError(
        f'Logical axis rule #{i} is {rule!r}; expected a pair '
        "(logical_name: str, mesh_axes), e.g. ('mlp', 'model')."
      )
    name, target = rule
    if isinstance(target, list):
      target = tuple(target)
    if isinstance(target, PartitionSpec):
      raise InvalidRulesError(
        f'Logical axis rule {rule!r}: the target must be a mesh axis, a '
        'tuple of mesh axes, None or PartitionSpec.UNCONSTRAINED, not a '
        'PartitionSpec.'
      )
    if isinstance(target, tuple) and not all(isinstance(a, str) for a in target):
      raise InvalidRulesError(
        f'Logical axis rule {rule!r}: a tuple target must hold mesh-axis '
        'names (str) only.'
      )
    if isinstance(target, tuple) and len(set(target)) != len(target):
      raise InvalidRulesError(
        f'Logical axis rule {rule!r}: a tuple target names a mesh axis more '
        'than once; list each mesh axis once.'
      )
    if not (
      target is None or target is UNCONSTRAINED or isinstance(target, (str, tuple))
    ):
      raise InvalidRulesError(
        f'Logical axis rule {rule!r}: unsupported target {target!r}; use a '
        'mesh-axis name, a tuple of them, None or PartitionSpec.UNCONSTRAINED.'
      )
    out.append((name, target))
  return tuple(out)


def composite_rules(
  global_rules: LogicalRules | None, local_rules: LogicalRules | None
) -> tuple[tuple[str, Any], ...]:
  """Combines context (global) rules with per-variable (local) rules.

  Priority order is kept: the global rules first, in their order, then the
  local rules not already present. Several candidates per name survive, so
  T5X-style fallbacks such as ``('embed', 'model'), ('embed', 'data')`` still
  work after composition. A name whose first choice differs between the two
  lists raises :class:`RuleConflictError` naming both.

  Example:
    >>> import flax_shardmeta as fsm
    >>> fsm.composite_rules([('embed', 'model'), ('embed', 'data')],
    ...                     [('kv', None)])
    (('embed', 'model'), ('embed', 'data'), ('kv', None))
  """
  g = normalize_rules(global_rules)
  loc = normalize_rules(local_rules)
  if not loc:
    return g
  if not g:
    return loc
  return _composite(g, loc)


@functools.lru_cache(maxsize=4096)
def _composite(g, loc):
  first_global: dict[str, Any] = {}
  for name, target in g:
    first_global.setdefault(name, target)
  first_local: dict[str, Any] = {}
  for name, target in loc:
    first_local.setdefault(name, target)
  for name, target in first_local.items():
    if name in first_global and first_global[name] != target:
      raise RuleConflictError(
        f"Logical axis '{name}' has conflicting first choices: global rule "
        f'{(name, first_global[name])!r} vs per-variable rule '
        f'{(name, target)!r}. Make the per-variable rules agree with the '
        'global ones, or drop one of them.'
      )
  seen = set(g)
  return g + tuple(r for r in loc if r not in seen)


# Resolution
# ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RuleStep:
  """What one rule did to one dimension during resolution."""

  rule_index: int
  rule: tuple[str, Any]
  applied: bool
  reason: str

  def __str__(self) -> str:
    verb = 'gave' if self.applied else 'skipped'
    return f'rule #{self.rule_index} {self.rule!r} {verb}: {self.reason}'


@dataclasses.dataclass(frozen=True)
class DimExplanation:
  """How one dimension got its mesh axes."""

  name: Any
  mesh_axes: Any
  steps: tuple[RuleStep, ...]

  def __str__(self) -> str:
    if not isinstance(self.name, str):
      return f'{self.name!r} passed through as written'
    if not self.steps:
      return f"'{self.name}': no rule names it, so replicated"
    return f"'{self.name}': " + '; '.join(str(s) for s in self.steps)


def _check_names(names: tuple[Any, ...]) -> None:
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
  _check_names(names)
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
  return _resolve_cached(tuple(names), normalize_rules(rules))


def explain(
  names: LogicalNames, rules: LogicalRules | None
) -> tuple[DimExplanation, ...]:
  """Per-dimension account of which rule gave the mesh axes and which were skipped.

  The same loop as :func:`resolve`, recording each rule's effect, so the
  explanation always agrees with the resolution.

  Example:
    >>> import flax_shardmeta as fsm
    >>> for d in fsm.explain_resolution(('bar', 'foo'),
    ...                                 [('foo', 'model'), ('bar', 'model')]):
    ...   print(d)
    'bar': rule #1 ('bar', 'model') skipped: mesh axis 'model' already used by
           dimension 1 ('foo')
    'foo': rule #0 ('foo', 'model') gave: 'model'
  """
  names = tuple(names)
  steps: list[list[RuleStep]] = [[] for _ in names]
  result = _assign(names, normalize_rules(rules), steps)
  return tuple(
    DimExplanation(n, m, tuple(st))
    for n, m, st in zip(names, unassigned_to_none(result), steps)
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
  if rules is None:
    rules = get_logical_axis_rules()
  names = tuple(names)
  resolved = resolve(names, rules)
  spec = PartitionSpec(*unassigned_to_none(resolved))
  missing = unmapped_lib.unmapped_names(names, resolved, UNASSIGNED)
  if missing:
    record = unmapped_lib.Unmapped('<names>', None, names, spec, missing)
    problems = unmapped_lib.report([record], _context_mesh_axes(), strict, stacklevel=3)
    if problems:
      raise ShardingError(problems)
  return spec


def _context_mesh_axes() -> tuple[str, ...]:
  # Only the axis names are needed: the abstract mesh of jax.set_mesh has them.
  return tuple(jax.sharding.get_abstract_mesh().axis_names)


# Standard rules
# ------------------------------------------------------------------------------

_T5X_REPLICATED = (
  ('relpos_buckets', None),
  ('abspos_buckets', None),
  ('length', None),
  ('layers', None),
  ('stack', None),
  ('mlp_activations', None),
)


def standard_logical_axis_rules(
  activation_partitioning_dims: int = 1,
  parameter_partitioning_dims: int = 1,
  additional_rules: LogicalRules | None = None,
) -> tuple[tuple[str, MeshAxes], ...]:
  """The T5X default rules over a ``('data', 'model')`` mesh.

  Args:
    activation_partitioning_dims: 1, or 2 to also shard activations' embed
      dimension over 'model'.
    parameter_partitioning_dims: 1, or 2 to also shard parameters' embed
      dimension over 'data' (2-D parameter sharding).
    additional_rules: appended after the standard rules (lower priority).

  Returns:
    The priority-ordered rules.

  Example:
    >>> import flax_shardmeta as fsm
    >>> rules = fsm.standard_logical_axis_rules(1, 2)
    >>> fsm.logical_to_mesh_axes(('embed', 'mlp'), rules)
    P('data', 'model')
  """
  base = (
    ('batch', 'data'),
    ('vocab', 'model'),
    ('mlp', 'model'),
    ('heads', 'model'),
    ('kv', None),
    ('joined_kv', 'model'),
  )
  dims = (activation_partitioning_dims, parameter_partitioning_dims)
  if dims == (1, 1):
    embed = (('embed', None),)
  elif dims == (2, 1):
    embed = (('embed', 'model'),)
  elif dims == (1, 2):
    embed = (('embed', 'data'),)
  elif dims == (2, 2):
    embed = (('embed', 'model'), ('embed', 'data'))
  else:
    raise InvalidRulesError(
      f'activation_partitioning_dims={activation_partitioning_dims}, '
      f'parameter_partitioning_dims={parameter_partitioning_dims} is not '
      'supported; each must be 1 or 2.'
    )
  rules = base + embed + _T5X_REPLICATED
  return rules + normalize_rules(additional_rules)
