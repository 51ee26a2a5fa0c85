"""Applying a layout to a value by names: ``shard_value`` and ``with_logical_constraint``.

Both resolve names through the rules and place the value with
``_placement.apply_spec``, eagerly, inside ``jit`` and inside ``shard_map``.
"""

from __future__ import annotations

import enum
from typing import Any

import jax
from jax.sharding import PartitionSpec

from flax_shardmeta._errors import ShardingError, ShardingProblem
from flax_shardmeta._placement import apply_spec, context_mesh, require_mesh
from flax_shardmeta._rules import (
    get_logical_axis_rules,
    normalize_rules,
    resolve,
)
from flax_shardmeta._specs import UNASSIGNED, unassigned_to_none
from flax_shardmeta._typing import AnyMesh, LogicalNames, LogicalRules, PyTree


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
    names: LogicalNames | PartitionSpec,
    rules: LogicalRules | None = None,
    mesh: AnyMesh | None = None,
    *,
    path: str = '<value>',
) -> Any:
  """Lays ``value`` out as ``names`` say, eagerly or inside ``jit``.

  With rules (given or from the context) the names are logical and resolve
  through them; without any, they are mesh axes. The mesh is ``mesh`` or the
  one set by ``jax.set_mesh``.

  Raises:
    NoMeshError: no mesh given or set.
    ShardingError: the layout does not fit the value's shape or the mesh.

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> mesh = jax.make_mesh((1,), ('model',))
    >>> fsm.shard_value(jnp.ones((4, 2)), ('mlp', None), [('mlp', 'model')],
    ...                 mesh=mesh).sharding.spec
    P('model', None)
  """
  if names is None:
    return value
  mesh = require_mesh(mesh, 'shard_value')
  names = tuple(names)
  rules_t = normalize_rules(rules) if rules is not None else get_logical_axis_rules()
  if rules_t:
    entries = unassigned_to_none(resolve(names, rules_t))
  else:
    entries = names
  return apply_spec(value, entries, mesh, path=path, names=names)


def _constrain_one(
    x: Any,
    names: Any,
    rules: tuple[tuple[str, Any], ...],
    mesh: AnyMesh,
    fallback: RulesFallback,
) -> Any:
  if names is None:
    return x
  names = tuple(names)
  resolved = resolve(names, rules)
  if any(r is UNASSIGNED for r in resolved):
    if fallback is RulesFallback.NO_CONSTRAINT:
      return x
    if fallback is RulesFallback.RAISE_ERROR:
      missing = [n for n, r in zip(names, resolved) if r is UNASSIGNED]
      raise ShardingError([ShardingProblem(
          '<constraint>', tuple(getattr(x, 'shape', ())), names, None,
          f'no rule maps logical name(s) {missing}',
          'add a rule for them, or use fallback=RulesFallback.AXIS_IS_UNSHARDED',
      )])
  entries = unassigned_to_none(resolved)
  return apply_spec(x, entries, mesh, path='<constraint>', names=names)


def _is_names(x: Any) -> bool:
  return x is None or isinstance(x, PartitionSpec) or (
      isinstance(x, tuple)
      and all(
          e is None or isinstance(e, str) or e is PartitionSpec.UNCONSTRAINED
          for e in x
      )
  )


def with_logical_constraint(
    x: PyTree,
    names: Any,
    rules: LogicalRules | None = None,
    mesh: AnyMesh | None = None,
    fallback: RulesFallback = RulesFallback.AXIS_IS_UNSHARDED,
) -> PyTree:
  """Constrains an activation (or a pytree of them) by logical names.

  With no rules (given or in context) or no mesh (given or set) it returns
  ``x`` itself. Works under Auto and Explicit meshes, eagerly and in ``jit``;
  inside ``shard_map`` the manual axes are left alone.

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> x = jnp.ones((4, 2))
    >>> fsm.with_logical_constraint(x, ('batch', None)) is x  # no rules, no mesh
    True
  """
  rules_t = normalize_rules(rules) if rules is not None else get_logical_axis_rules()
  mesh = mesh if mesh is not None else context_mesh()
  if not rules_t or mesh is None or names is None:
    return x
  if _is_names(names):
    return _constrain_one(x, names, rules_t, mesh, fallback)
  return jax.tree_util.tree_map(
      lambda n, v: _constrain_one(v, n, rules_t, mesh, fallback),
      names, x, is_leaf=_is_names,
  )


