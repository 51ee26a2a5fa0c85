"""Laying values out by names: ``shard_value`` and ``with_logical_constraint``.

Both resolve names through the rules and place the value with
``_placement.apply_spec``, eagerly, inside ``jit`` and inside ``shard_map``.
"""

from __future__ import annotations

import enum
from typing import Any

import jax
import jax.core
from jax.sharding import PartitionSpec

from flax_shardmeta._annotation import path_str
from flax_shardmeta._axis_typos import with_typo_hint
from flax_shardmeta._errors import (
  InvalidNamesError,
  ShardingError,
  ShardingProblem,
  message,
)
from flax_shardmeta._names import as_names
from flax_shardmeta._placement import (
  apply_spec,
  check_mesh,
  context_mesh,
  require_mesh,
)
from flax_shardmeta._resolution import resolve
from flax_shardmeta._rules import (
  check_jit_key,
  get_logical_axis_rules,
  normalize_rules,
)
from flax_shardmeta._specs import UNASSIGNED, unassigned_to_none
from flax_shardmeta._typing import AnyMesh, LogicalNames, LogicalRules, PyTree
from flax_shardmeta._unmapped import Unmapped, report as report_unmapped, unmapped_names
from flax_shardmeta._validate import (
  rank_issue,
  replicate_option,
  warn_replicated,
)


class RulesFallback(enum.Enum):
  """What :func:`with_logical_constraint` does with a name no rule maps.

  Example:
    >>> import jax.numpy as jnp
    >>> import flax_shardmeta as fsm
    >>> x = jnp.ones((8, 4))
    >>> y = fsm.with_logical_constraint(
    ...     x, ('batch', 'unmapped'), rules=[('batch', None)],
    ...     fallback=fsm.RulesFallback.NO_CONSTRAINT)
    >>> y is x
    True
  """

  AXIS_IS_UNSHARDED = 'axis_is_unsharded'
  """The dimension is replicated."""
  RAISE_ERROR = 'raise_error'
  """A ShardingError is raised."""
  NO_CONSTRAINT = 'no_constraint'
  """The value is returned as is, unconstrained."""


def shard_value(
  value: Any,
  names: LogicalNames | PartitionSpec | PyTree,
  rules: LogicalRules | None = None,
  mesh: AnyMesh | None = None,
  *,
  path: str = '<value>',
  logical: bool | None = None,
  replicate_indivisible: bool = False,
  strict: bool = False,
  fit: bool | None = None,
) -> Any:
  """Lays ``value`` out as ``names`` say, eagerly or inside ``jit``.

  What the names mean is set by ``logical``:

  * ``True``: logical names, resolved through ``rules`` (or the context
    rules); a name no rule maps is replicated.
  * ``False``: mesh-axis names, as in ``jax.device_put(x, P(...))``; rules
    are ignored.
  * ``None`` (default): logical when rules are given or set in the context,
    mesh axes otherwise. A ``PartitionSpec`` follows the same rule as a tuple.

  A logical name no rule maps that is also a mesh-axis name (``'data'``
  inside a rule context without a ``'data'`` rule) is replicated with an
  :class:`UnmappedMeshAxisNameWarning`: pass ``logical=False`` if mesh axes
  were meant. The mesh is ``mesh`` or the one set by ``jax.set_mesh`` (or by
  the deprecated ``with mesh:``).

  ``value`` is one array. For a pytree, give ``names`` as a tree of the same
  structure with one names tuple per array (or use :func:`get_sharding` and
  ``jax.device_put`` for annotated trees).

  Args:
    value: an array (or a pytree of them, see above).
    names: one entry per dimension (or a tree of such tuples).
    rules: logical axis rules; None uses the context rules.
    mesh: the mesh; None uses the context mesh.
    path: how the value is named in errors and warnings.
    logical: whether ``names`` are logical names (see above).
    replicate_indivisible: replicate dimensions the mesh cannot shard as
      asked (an axis the mesh lacks, an indivisible size) instead of failing;
      one :class:`IndivisibleDimensionWarning` lists the changes.
    strict: a logical name no usable rule maps raises instead of being
      replicated.
    fit: the former name of ``replicate_indivisible`` (deprecated).

  Raises:
    NoMeshError: no mesh given or set.
    ShardingError: the layout does not fit the value's shape or the mesh, or
      a pytree was given with one names tuple.

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> mesh = jax.make_mesh((1,), ('model',))
    >>> fsm.shard_value(jnp.ones((4, 2)), ('mlp', None), [('mlp', 'model')],
    ...                 mesh=mesh).sharding.spec
    P('model', None)
    >>> with fsm.logical_axis_rules([('mlp', 'model')]):  # mesh axes on purpose
    ...   fsm.shard_value(jnp.ones((4, 2)), ('model', None), mesh=mesh,
    ...                   logical=False).sharding.spec
    P('model', None)
  """
  replicate = replicate_option(replicate_indivisible, fit, 'shard_value')
  if names is None:
    return value
  rules_t = _value_rules(rules, logical)
  mesh = require_mesh(mesh, 'shard_value')
  call = _Call(mesh, replicate, strict, rules_t or ())

  def one(x: Any, n: Any, where: str) -> Any:
    return _shard_one(x, n, where, rules_t, rules is None, call)

  out = _map_names(one, names, value, path)
  call.finish('Pass logical=False if the names are mesh axes. ')
  return out


def _value_rules(
  rules: LogicalRules | None, logical: bool | None
) -> tuple[tuple[str, Any], ...] | None:
  """The rules ``shard_value`` resolves with; None when names are mesh axes."""
  # A mesh passed where the rules go is refused here, by name.
  rules_n = normalize_rules(rules) if rules is not None else None
  if logical is False:
    return None
  rules_t = rules_n if rules_n is not None else get_logical_axis_rules()
  return None if not rules_t and logical is None else rules_t


class _Call:
  """What one call collects while it lays a value (or a tree of them) out."""

  def __init__(
    self,
    mesh: AnyMesh,
    replicate: bool,
    strict: bool,
    rules: tuple[tuple[str, Any], ...] = (),
  ):
    self.mesh, self.replicate, self.strict = mesh, replicate, strict
    self.rules = rules  # for the "did you mean" of a misspelt mesh axis
    self.changes: list[tuple[str, tuple[str, ...]]] = []
    self.unmapped: list[Unmapped] = []

  def place(self, x: Any, entries: tuple[Any, ...], where: str, names: Any) -> Any:
    """Lays ``x`` out as ``entries`` say (see ``_placement.apply_spec``)."""
    replicated: list[str] | None = [] if self.replicate else None
    try:
      out = apply_spec(
        x, entries, self.mesh, path=where, names=names, replicated=replicated
      )
    except ShardingError as e:
      hinted = with_typo_hint(e.problems, self.mesh.axis_names, self.rules)
      if tuple(hinted) == e.problems:
        raise
      raise ShardingError(hinted) from None
    if replicated:
      self.changes.append((where, tuple(replicated)))
    return out

  def finish(self, also: str = '') -> None:
    """Warns about unmapped names (or raises them all when strict) and about
    replicated dimensions.

    In strict mode the leaves concerned were left unplaced, so every unmapped
    name of the call is raised together.
    """
    # warn <- report_unmapped <- finish <- shard_value / constraint <- user.
    problems = report_unmapped(
      self.unmapped, self.mesh.axis_names, self.strict, stacklevel=4, also=also
    )
    if problems:
      raise ShardingError(problems)
    if self.changes:
      warn_replicated(self.changes, stacklevel=4)


def _shard_one(
  x: Any,
  names: Any,
  where: str,
  rules: tuple[tuple[str, Any], ...] | None,
  check_context: bool,
  call: _Call,
) -> Any:
  """One array of ``shard_value``: its names resolved (if logical), then placed."""
  names = _checked_names(x, names, where)
  if rules is None:
    return call.place(x, names, where, names)
  entries, unmapped = _resolved(x, names, where, rules, check_context)
  if unmapped is not None:
    call.unmapped.append(unmapped)
    if call.strict:
      return x  # reported with every other leaf's by finish
  return call.place(x, entries, where, names)


def _resolved(
  x: Any,
  names: tuple[Any, ...],
  where: str,
  rules: tuple[tuple[str, Any], ...],
  check_context: bool,
) -> tuple[tuple[Any, ...], Unmapped | None]:
  """``names`` resolved by ``rules`` to spec entries, and the names no rule
  maps (None when every one is mapped)."""
  if check_context:
    check_jit_key(isinstance(x, jax.core.Tracer))
  resolved = resolve(names, rules)
  entries = unassigned_to_none(resolved)
  missing = unmapped_names(names, resolved, UNASSIGNED)
  if not missing:
    return entries, None
  spec = PartitionSpec(*entries)
  return entries, Unmapped(where, _shape(x), names, spec, missing, rules)


def _shape(x: Any) -> tuple[int, ...]:
  return tuple(getattr(x, 'shape', ()))


def _checked_names(x: Any, names: Any, where: str) -> tuple[Any, ...]:
  """One value's names as a tuple, one entry per dimension, or a named error."""
  try:
    out = as_names(names)
  except InvalidNamesError as e:
    raise InvalidNamesError(f'{where}: {message(e)}') from None
  if not hasattr(x, 'shape') and not isinstance(x, (int, float, complex)):
    # A str has no shape either: it would be read as a rank-0 array.
    raise ShardingError(
      [
        ShardingProblem(
          where,
          None,
          out,
          None,
          f'the value is a {type(x).__name__} ({x!r:.40}), not an array',
          'pass a jax or numpy array (or a number)',
        )
      ]
    )
  shape = _shape(x)
  if isinstance(names, PartitionSpec) and len(out) < len(shape):
    # jax's own form: trailing dimensions left out are replicated.
    out += (None,) * (len(shape) - len(out))
  if len(out) != len(shape):
    reason, _, _ = rank_issue(len(out), len(shape))
    raise ShardingError(
      [
        ShardingProblem(
          where,
          shape,
          out,
          None,
          reason,
          'give exactly one name per dimension (None for a replicated one)',
        )
      ]
    )
  return out


def _is_single(value: Any) -> bool:
  """Whether ``value`` is one array-like leaf, not a container of them."""
  return hasattr(value, 'shape') or jax.tree_util.treedef_is_leaf(
    jax.tree_util.tree_structure(value)
  )


def _tree_given(value: Any, names: Any, path: str) -> ShardingProblem:
  n = len(jax.tree_util.tree_leaves(value))
  return ShardingProblem(
    path,
    None,
    tuple(names),
    None,
    f'a pytree ({type(value).__name__} with {n} leaves) was given where one '
    'array is expected',
    'give one names tuple per array as a tree of the same structure, e.g. '
    "shard_value({'a': x, 'b': y}, {'a': ('data', None), 'b': (None,)}), "
    'map over the tree (jax.tree.map(lambda v: fsm.shard_value(v, names), '
    'tree)), or lay out an annotated tree with fsm.get_sharding and '
    'jax.device_put',
  )


def _map_names(one: Any, names: Any, value: Any, path: str) -> Any:
  """Applies ``one(array, names, path)`` per array of ``value``.

  ``names`` is one names tuple (or list, or PartitionSpec) for one array, or
  a tree of the value's structure holding one per array; None leaves a value
  (or a whole subtree) as it is. Lists are names where the value is an array.
  """
  if names is None:
    return value
  if _is_single(value):
    return one(value, names, path)
  if _is_names(names):
    raise ShardingError([_tree_given(value, names, path)])
  v_flat, v_def = _one_level(value)
  n_flat, n_def = _one_level(names)
  if v_def != n_def:
    raise ShardingError(
      [
        ShardingProblem(
          path,
          None,
          None,
          None,
          f'the names tree does not match the value tree here: the value is '
          f'{_node(value)}, the names {_node(names)}',
          'give one names tuple (or None) per array, in a tree of the same '
          'structure as the value',
        )
      ]
    )
  out = [
    _map_names(one, n, v, _join(path, path_str(k)))
    for (k, v), (_, n) in zip(v_flat, n_flat)
  ]
  return jax.tree_util.tree_unflatten(v_def, out)


def _one_level(tree: Any) -> tuple[list[tuple[Any, Any]], Any]:
  """The immediate children of ``tree`` with their keys, and that level's def."""
  return jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)


def _node(x: Any) -> str:
  """A tree node described by its type and keys, never by array contents."""
  if isinstance(x, dict):
    return f'a {type(x).__name__} with keys {sorted(map(str, x))}'
  if isinstance(x, (list, tuple)):
    return f'a {type(x).__name__} of {len(x)}'
  if hasattr(x, 'shape'):
    return f'an array of shape {tuple(x.shape)}'
  return f'a {type(x).__name__}'


def _join(root: str, sub: str) -> str:
  return f'{root}/{sub}' if sub else root


def _constrain_one(
  x: Any,
  names: Any,
  where: str,
  rules: tuple[tuple[str, Any], ...],
  fallback: RulesFallback,
  check_context: bool,
  call: _Call,
) -> Any:
  """One array of ``with_logical_constraint``: resolved, then constrained."""
  if names is None:
    return x
  names = _checked_names(x, names, where)
  entries, unmapped = _resolved(x, names, where, rules, check_context)
  if unmapped is not None:
    if call.strict:
      call.unmapped.append(unmapped)
      return x  # reported with every other leaf's by finish
    if fallback is RulesFallback.NO_CONSTRAINT:
      return x
    if fallback is RulesFallback.RAISE_ERROR:
      raise ShardingError(
        [
          ShardingProblem(
            where,
            _shape(x),
            names,
            None,
            f'no rule maps logical name(s) {list(unmapped.unmapped)}',
            'add a rule for them, or use fallback=RulesFallback.AXIS_IS_UNSHARDED',
          )
        ]
      )
    call.unmapped.append(unmapped)
  return call.place(x, entries, where, names)


def _is_names(x: Any) -> bool:
  """Whether ``x`` reads as one names tuple (not a tree of them)."""
  return isinstance(x, PartitionSpec) or (
    isinstance(x, (tuple, list))
    and all(
      e is None or isinstance(e, str) or e is PartitionSpec.UNCONSTRAINED for e in x
    )
  )


def with_logical_constraint(
  x: PyTree,
  names: Any,
  rules: LogicalRules | None = None,
  mesh: AnyMesh | None = None,
  fallback: RulesFallback = RulesFallback.AXIS_IS_UNSHARDED,
  *,
  replicate_indivisible: bool = False,
  strict: bool = False,
  fit: bool | None = None,
) -> PyTree:
  """Constrains an activation (or a pytree of them) by logical names.

  With no rules (given, set by :func:`logical_axis_rules` or by flax's
  ``nn.logical_axis_rules``) or no mesh (given, set by ``jax.set_mesh`` or by
  the deprecated ``with mesh:``) it returns ``x`` itself. Works under Auto,
  Explicit and mixed meshes, eagerly and in ``jit``; inside ``shard_map`` the
  manual axes are left alone. A replicated name that is also a mesh-axis
  name gets an :class:`UnmappedMeshAxisNameWarning`.

  Inside ``jit`` the rules in force while the function is traced apply.
  fsm's own rules are part of ``jax.jit``'s cache key, so a function is traced
  again under other rules; flax's ``nn.logical_axis_rules`` are not (as in
  flax). :func:`flax_shardmeta.jit`, which enters its mesh and rules wherever
  it traces, is the recommended way to compile such functions.

  Args:
    x: an array, or a pytree of arrays with ``names`` a tree of names tuples.
    names: one logical name (or None) per dimension, or a tree of them.
    rules: logical axis rules; None uses the context rules.
    mesh: the mesh; None uses the context mesh.
    fallback: what a name no rule maps does (see :class:`RulesFallback`).
    replicate_indivisible: replicate dimensions the mesh cannot shard as
      asked instead of failing; one :class:`IndivisibleDimensionWarning` lists
      the changes.
    strict: a logical name no usable rule maps raises a ShardingError naming
      it (whatever ``fallback`` says).
    fit: the former name of ``replicate_indivisible`` (deprecated).

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> x = jnp.ones((4, 2))
    >>> fsm.with_logical_constraint(x, ('batch', None)) is x  # no rules, no mesh
    True
  """
  replicate = replicate_option(replicate_indivisible, fit, 'with_logical_constraint')
  rules_t = normalize_rules(rules) if rules is not None else get_logical_axis_rules()
  mesh = mesh if mesh is not None else context_mesh()
  if not rules_t or mesh is None or names is None:
    return x
  call = _Call(check_mesh(mesh, 'with_logical_constraint'), replicate, strict, rules_t)

  def one(v: Any, n: Any, where: str) -> Any:
    return _constrain_one(v, n, where, rules_t, fallback, rules is None, call)

  out = _map_names(one, names, x, '<constraint>')
  call.finish()
  return out
