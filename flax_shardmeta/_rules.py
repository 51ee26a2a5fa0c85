"""Logical axis rules: their form, and the context that holds them.

Rules are priority-ordered pairs ``(logical_name, mesh_axes)``. This module
checks their form (:func:`normalize_rules`), merges per-variable rules into
global ones (:func:`composite_rules`) and keeps the rules in force per thread
and asyncio task, with flax's ``nn.logical_axis_rules`` as the fallback. What
the rules do to names is :mod:`flax_shardmeta._resolution`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import threading
from collections.abc import Sequence
from typing import Any

from flax.core import spmd as flax_core_spmd
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from flax_shardmeta._errors import (
  InvalidRulesError,
  RuleConflictError,
  RuleContextError,
  message,
)
from flax_shardmeta._jit_key import require_key_honoured, set_thread_key, thread_key
from flax_shardmeta._specs import UNCONSTRAINED
from flax_shardmeta._typing import LogicalRules

# Rule context
# ------------------------------------------------------------------------------
#
# flax_shardmeta's own rules live in a context variable: each thread and each
# asyncio task sees the rules it set, and a task's rules end with the task.
# Where none are set, flax's own ``nn.logical_axis_rules`` context is read, so
# code that already sets flax's rules gets the same layouts from both. The
# rules set here are also part of the cache key of ``jax.jit`` (through a jax
# user context, see flax_shardmeta._jit_key), so a function traced under one
# rule set is traced again under another.

_own_rules: contextvars.ContextVar[tuple[tuple[str, Any], ...]] = (
  contextvars.ContextVar('flax_shardmeta_logical_axis_rules', default=())
)

SOURCE_FSM = 'fsm.logical_axis_rules'
SOURCE_FLAX = "flax's nn.logical_axis_rules"
SOURCE_PER_VARIABLE = 'per-variable rules'
SOURCE_NONE = 'no rules set'


def _key_of(rules: tuple[tuple[str, Any], ...]) -> Any:
  return rules or None


def _sync_jit_key(rules: tuple[tuple[str, Any], ...]) -> None:
  """Makes jax's thread-local cache key say ``rules``."""
  set_thread_key(_key_of(rules))


def check_jit_key(tracing: bool) -> None:
  """Refuses to trace under rules jax's cache key does not name.

  Asyncio tasks of one thread share jax's (thread-local) cache key while each
  has its own rules. A task that entered its rules, awaited, and traces after
  another task entered other rules would store its trace under the other
  task's key; that is refused here. Outside a trace the key is just updated.
  """
  rules = _own_rules.get()
  if thread_key() == _key_of(rules):
    if tracing and rules:
      require_key_honoured(format_rules(rules))
    return
  if tracing:
    raise RuleContextError(
      'this code is traced under the logical axis rules '
      f'{format_rules(rules)} of its own asyncio task (or contextvars '
      "Context), but jax.jit's cache key names "
      f'{format_rules(thread_key() or ())}: another task of the same thread '
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


def rules_from_lists(data: Any, where: str) -> tuple[tuple[str, Any], ...]:
  """Rules read from JSON or TOML: a list of ``[name, target]`` lists, where
  an empty list target means replicated (TOML has no null; JSON may say
  either). ``where`` names the text in the error.

  The one reading of a rules file, for ``--rules`` and presets files alike.

  Example:
    >>> rules_from_lists([['batch', 'data'], ['embed', []]], 'rules.toml')
    (('batch', 'data'), ('embed', None))
  """
  if not isinstance(data, list):
    raise InvalidRulesError(
      f'{where} must hold a list of [name, target] pairs '
      '(TOML: rules = [[name, target], ...])'
    )
  pairs: Any = [
    (r[0], None if r[1] == [] else r[1]) if isinstance(r, list) and len(r) == 2 else r
    for r in data
  ]
  try:
    return normalize_rules(pairs)
  except InvalidRulesError as e:
    raise InvalidRulesError(f'{where}: {message(e)}') from None


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
