"""Logical axis rules: the rule context and the one resolution engine.

Rules are priority-ordered pairs ``(logical_name, mesh_axes)``. Resolution walks
the rules in order; a rule gives its mesh axes to its name's dimension when that
dimension has no assignment yet and none of the mesh axes is already used by
another dimension of the same spec. Names left without a usable rule are
replicated. Linen boxes, NNX Variables, constraints and plans all go through
:func:`resolve`, so they share one semantics.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import threading
from collections.abc import Sequence
from typing import Any, overload

import jax
from flax.core import spmd as flax_core_spmd
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from flax_shardmeta import _unmapped as unmapped_lib
from flax_shardmeta._errors import (
  InvalidNamesError,
  InvalidRulesError,
  RuleConflictError,
  RuleContextError,
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
#
# flax_shardmeta's own rules live in a context variable: each thread and each
# asyncio task sees the rules it set, and a task's rules end with the task.
# Where none are set, flax's own ``nn.logical_axis_rules`` context is read, so
# code that already sets flax's rules gets the same layouts from both. The
# rules set here are also part of the cache key of ``jax.jit`` (through a jax
# user context), so a function traced under one rule set is traced again
# under another.

_own_rules: contextvars.ContextVar[tuple[tuple[str, Any], ...]] = (
  contextvars.ContextVar('flax_shardmeta_logical_axis_rules', default=())
)
_jit_key = jax.make_user_context(None)

SOURCE_FSM = 'fsm.logical_axis_rules'
SOURCE_FLAX = "flax's nn.logical_axis_rules"
SOURCE_PER_VARIABLE = 'per-variable rules'
SOURCE_NONE = 'no rules set'


def _key_of(rules: tuple[tuple[str, Any], ...]) -> Any:
  return rules or None


def _sync_jit_key(rules: tuple[tuple[str, Any], ...]) -> None:
  """Makes jax's thread-local cache key say ``rules``."""
  key = _key_of(rules)
  if _jit_key.value != key:
    _jit_key(key).__enter__()  # sets the value for this thread; never undone


def check_jit_key(tracing: bool) -> None:
  """Refuses to trace under rules jax's cache key does not name.

  Asyncio tasks of one thread share jax's (thread-local) cache key while each
  has its own rules. A task that entered its rules, awaited, and traces after
  another task entered other rules would store its trace under the other
  task's key; that is refused here. Outside a trace the key is just updated.
  """
  rules = _own_rules.get()
  if _jit_key.value == _key_of(rules):
    return
  if tracing:
    raise RuleContextError(
      'this code is traced under the logical axis rules '
      f'{format_rules(rules)} of its own asyncio task (or contextvars '
      "Context), but jax.jit's cache key names "
      f'{format_rules(_jit_key.value or ())}: another task of the same thread '
      'changed it since this one entered its rules, and the trace would be '
      'reused under the wrong rules. Trace with fsm.jit(fn, mesh=..., rules=...), '
      'which enters its rules right where it traces, or do not await inside '
      'a rules context that traces.'
    )
  _sync_jit_key(rules)


def format_rules(rules: Any) -> str:
  return repr(tuple(rules)) if rules else '(no rules)'


def set_logical_axis_rules(rules: LogicalRules | None) -> None:
  """Sets the logical axis rules of the current thread or asyncio task.

  ``None`` or ``()`` unsets them (flax's ``nn.logical_axis_rules``, if set,
  apply again).

  Example:
    >>> import flax_shardmeta as fsm
    >>> fsm.set_logical_axis_rules([('batch', 'data')])
    >>> fsm.get_logical_axis_rules()
    (('batch', 'data'),)
    >>> fsm.set_logical_axis_rules(())
  """
  rules_t = normalize_rules(rules)
  _own_rules.set(rules_t)
  _sync_jit_key(rules_t)


def get_logical_axis_rules() -> tuple[tuple[str, Any], ...]:
  """The logical axis rules in force here (``()`` if none).

  Those set by :func:`logical_axis_rules` / :func:`set_logical_axis_rules` in
  this thread or asyncio task; where none are, those of flax's
  ``nn.logical_axis_rules`` context.

  Example:
    >>> import flax.linen as nn, flax_shardmeta as fsm
    >>> with fsm.logical_axis_rules([('mlp', 'model')]):
    ...   print(fsm.get_logical_axis_rules())
    (('mlp', 'model'),)
    >>> with nn.logical_axis_rules([('embed', 'data')]):  # flax's own context
    ...   print(fsm.get_logical_axis_rules())
    (('embed', 'data'),)
    >>> fsm.get_logical_axis_rules()
    ()
  """
  return context_rules()[0]


def context_rules() -> tuple[tuple[tuple[str, Any], ...], str]:
  """``(rules, where they come from)``: fsm's own context, else flax's."""
  own = _own_rules.get()
  if own:
    return own, SOURCE_FSM
  theirs = flax_core_spmd.get_logical_axis_rules()
  if not theirs:
    return (), SOURCE_NONE
  return _normalize_foreign(theirs), SOURCE_FLAX


def _normalize_foreign(rules: Any) -> tuple[tuple[str, Any], ...]:
  try:
    return _normalize_cached(tuple(tuple(r) for r in rules))
  except TypeError:  # unhashable targets (lists): normalized, not cached
    return normalize_rules(rules)


@functools.lru_cache(maxsize=64)
def _normalize_cached(rules: tuple[Any, ...]) -> tuple[tuple[str, Any], ...]:
  return normalize_rules(rules)


def rules_and_source(
  rules: LogicalRules | None,
) -> tuple[tuple[tuple[str, Any], ...], str]:
  """Explicit rules (source ``''``), else the context's and where they come from."""
  if rules is not None:
    return normalize_rules(rules), ''
  return context_rules()


class _RulesContext(contextlib.AbstractContextManager, contextlib.ContextDecorator):
  """``with fsm.logical_axis_rules(rules):`` (see :func:`logical_axis_rules`)."""

  def __init__(self, rules: tuple[tuple[str, Any], ...]):
    self._rules = rules
    # One (token, where entered) per active entry: the object may be re-entered.
    self._entered: list[tuple[contextvars.Token[Any], str]] = []

  def __enter__(self) -> None:
    token = _own_rules.set(self._rules)
    _sync_jit_key(self._rules)
    self._entered.append((token, _where()))

  def __exit__(self, *exc: Any) -> bool:
    if not self._entered:
      raise RuleContextError(
        f'fsm.logical_axis_rules({format_rules(self._rules)}) was exited but '
        'never entered.'
      )
    token, entered = self._entered[-1]
    try:
      _own_rules.reset(token)
    except ValueError:
      raise RuleContextError(
        f'fsm.logical_axis_rules({format_rules(self._rules)}) was entered in '
        f'{entered} and exited in {_where()}. A rules context belongs to the '
        'thread (and asyncio task) that entered it; exit it there. The rules of '
        'both are unchanged.'
      ) from None
    self._entered.pop()
    _sync_jit_key(_own_rules.get())
    return False


def _where() -> str:
  thread = threading.current_thread()
  try:
    task = asyncio.current_task()
  except RuntimeError:  # no running event loop
    task = None
  where = f'thread {thread.name!r}'
  return f'{where}, asyncio task {task.get_name()!r}' if task is not None else where


def logical_axis_rules(rules: LogicalRules) -> contextlib.AbstractContextManager[None]:
  """Context manager binding logical axis rules for the current thread or task.

  Nestable; the previous rules come back on exit, also when an exception
  escapes. Other threads and other asyncio tasks never see these rules, and
  they end with the ``asyncio.run`` (or task) that set them. Exiting it in
  another thread or task than the one that entered it raises
  :class:`RuleContextError` and changes nothing. Usable as a decorator too.

  While it is active it replaces flax's ``nn.logical_axis_rules`` for
  flax_shardmeta, and its rules are part of ``jax.jit``'s cache key.

  Example:
    >>> import flax_shardmeta as fsm
    >>> with fsm.logical_axis_rules([('mlp', 'model')]):
    ...   fsm.logical_to_mesh_axes(('embed', 'mlp'))
    P(None, 'model')
  """
  return _RulesContext(normalize_rules(rules))


def normalize_rules(rules: LogicalRules | None) -> tuple[tuple[str, Any], ...]:
  """Rules as a hashable tuple of ``(name, mesh_axes)`` pairs, checked for form."""
  if rules is None:
    return ()
  if isinstance(rules, (Mesh, AbstractMesh)):
    raise InvalidRulesError(
      f'a {type(rules).__name__} was passed as rules (axes '
      f'{dict(zip(rules.axis_names, rules.axis_sizes))}); pass it as mesh=... '
      '(the rules come before the mesh in the positional arguments).'
    )
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


class Explanation(tuple):
  """Per-dimension explanations: a tuple, printed one dimension per line.

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


def as_names(names: Any) -> tuple[Any, ...]:
  """Names as a checked tuple: lists become tuples (also a list of mesh axes
  inside), and anything else than one name entry per dimension is refused.

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


_OK = object()


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


def explain(
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
