"""Applying a layout to a value: eagerly, inside ``jit`` and inside ``shard_map``.

Auto mesh axes take ``with_sharding_constraint``; Explicit ones take
``jax.sharding.reshard`` (a constraint would only assert there). Mesh axes that
are Manual (inside ``jax.shard_map``) are left alone.
"""

from __future__ import annotations

import enum
import functools
import math
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from flax_shardmeta.boxes import Partitioned
from flax_shardmeta.errors import NoMeshError, ShardingError, ShardingProblem
from flax_shardmeta.rules import (
    UNASSIGNED,
    composite_rules,
    get_logical_axis_rules,
    mesh_axes_of,
    normalize_rules,
    resolve,
)
from flax_shardmeta.typing import AnyMesh, LogicalNames, LogicalRules, PyTree
from flax_shardmeta.validate import check_spec, rank_issue


class RulesFallback(enum.Enum):
  """What :func:`with_logical_constraint` does with a name no rule maps."""

  AXIS_IS_UNSHARDED = 'axis_is_unsharded'
  """The dimension is replicated."""
  RAISE_ERROR = 'raise_error'
  """A ShardingError is raised."""
  NO_CONSTRAINT = 'no_constraint'
  """The value is returned as is, unconstrained."""


def context_mesh() -> AnyMesh | None:
  """The mesh set by ``jax.set_mesh`` (concrete if known), or None."""
  abstract = jax.sharding.get_abstract_mesh()
  if abstract.empty:
    return None
  if getattr(abstract, 'manual_axes', ()):
    return abstract  # inside shard_map only the abstract view knows Manual axes
  try:
    concrete = jax.sharding.get_mesh()
  except ValueError:  # inside jit only the abstract mesh is available
    return abstract
  return abstract if concrete.empty else concrete


def _manual_axes(mesh: AnyMesh) -> frozenset[str]:
  manual = set(getattr(mesh, 'manual_axes', ()) or ())
  abstract = jax.sharding.get_abstract_mesh()
  if not abstract.empty:
    manual |= set(getattr(abstract, 'manual_axes', ()) or ())
  return frozenset(manual)


def _drop_axes(entries: tuple[Any, ...], drop: frozenset[str]) -> tuple[Any, ...]:
  out = []
  for e in entries:
    axes = mesh_axes_of(e)
    if not axes or not drop.intersection(axes):
      out.append(e)
      continue
    kept = tuple(a for a in axes if a not in drop)
    out.append(kept[0] if len(kept) == 1 else (kept or None))
  return tuple(out)


def apply_spec(
    value: Any,
    entries: tuple[Any, ...],
    mesh: AnyMesh,
    *,
    path: str = '<value>',
    names: Any = None,
) -> Any:
  """Validates ``entries`` for ``value`` on ``mesh`` and applies them."""
  manual = _manual_axes(mesh)
  if manual:
    entries = _drop_axes(entries, manual)
  shape = tuple(getattr(value, 'shape', ()))
  spec = PartitionSpec(*entries)
  issues = check_spec(shape, entries, mesh)
  if issues:
    raise ShardingError(
        [ShardingProblem(path, shape, names, spec, r, h, d) for r, h, d in issues]
    )
  types = {
      n: t for n, t in zip(mesh.axis_names, mesh.axis_types) if n not in manual
  }
  if not types:
    return value
  kinds = set(types.values())
  if kinds == {AxisType.Explicit}:
    if manual or isinstance(mesh, jax.sharding.AbstractMesh):
      return jax.sharding.reshard(value, spec)
    return jax.sharding.reshard(value, NamedSharding(mesh, spec))
  if kinds == {AxisType.Auto}:
    if manual:
      return jax.lax.with_sharding_constraint(value, spec)
    return jax.lax.with_sharding_constraint(value, NamedSharding(mesh, spec))
  raise ValueError(
      f'Cannot shard {path}: the mesh mixes axis types '
      f'{ {n: str(t) for n, t in types.items()} }. flax_shardmeta applies a '
      'layout with with_sharding_constraint (all Auto) or reshard (all '
      'Explicit); make every axis the same type, e.g. '
      'jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * n).'
  )


def _require_mesh(mesh: AnyMesh | None, what: str) -> AnyMesh:
  mesh = mesh if mesh is not None else context_mesh()
  if mesh is None:
    raise NoMeshError(
        f'{what} needs a mesh: pass mesh=... or run inside '
        '`with jax.set_mesh(mesh):`.'
    )
  return mesh


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
  mesh = _require_mesh(mesh, 'shard_value')
  names = tuple(names)
  rules_t = normalize_rules(rules) if rules is not None else get_logical_axis_rules()
  if rules_t:
    entries = tuple(None if r is UNASSIGNED else r for r in resolve(names, rules_t))
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
  entries = tuple(None if r is UNASSIGNED else r for r in resolved)
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


def constrain_box(box: Partitioned[Any]) -> Any:
  """The box's value constrained to its layout when a mesh is known.

  Logical boxes with no rules at all are left unconstrained (there is nothing
  to say about their layout yet).
  """
  mesh = box.mesh if box.mesh is not None else context_mesh()
  value = box.value
  if mesh is None or not hasattr(value, 'shape'):
    return value
  if box.is_logical:
    rules = composite_rules(get_logical_axis_rules(), box.rules)
    if not rules:
      return value
    entries = tuple(
        None if r is UNASSIGNED else r for r in resolve(box.names, rules)
    )
  else:
    entries = box.names
  if len(entries) != len(value.shape):
    reason, hint, _ = rank_issue(len(entries), len(value.shape))
    raise ShardingError([ShardingProblem(
        '<unboxed parameter>', tuple(value.shape), box.names, None, reason,
        hint)], context=' (fsm.plan or fsm.get_sharding name the path)')
  return apply_spec(value, entries, mesh, names=box.names)


def generate(
    init_fn: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    names: Any,
    mesh: AnyMesh | None,
    *,
    logical: bool = False,
    rules: LogicalRules | None = None,
) -> Any:
  """Calls an initializer so that each device generates only its own shard.

  Why: under Explicit axes a random initializer's output is replicated (its
  key is), so constraining it afterwards means every device first holds the
  whole parameter, 8x its size on 8 devices plus temporaries; and eagerly, on
  any mesh, the initializer would build the whole parameter on one device
  before it is split. Here the initializer runs under ``jit`` (when eager)
  and ``auto_axes`` (when Explicit) with the target sharding, so jax's
  partitionable RNG generates each shard where it lives. Values are the same.
  Inside a trace on an Auto mesh nothing is needed: the box's constraint
  propagates back into the initializer.
  """
  mesh = mesh if mesh is not None else context_mesh()
  if mesh is None or _manual_axes(mesh):
    return init_fn(*args, **kwargs)
  kinds = set(mesh.axis_types)
  call, arrays = ArrayCall.split(init_fn, args, kwargs)
  tracing = any(isinstance(x, jax.core.Tracer) for x in arrays)
  explicit = kinds == {AxisType.Explicit}
  if (tracing and not explicit) or len(kinds) != 1:
    return init_fn(*args, **kwargs)
  names = tuple(names)
  if logical:
    all_rules = composite_rules(get_logical_axis_rules(), rules)
    if not all_rules:
      return init_fn(*args, **kwargs)
    entries = tuple(None if r is UNASSIGNED else r for r in resolve(names, all_rules))
  else:
    entries = names
  try:
    out = jax.eval_shape(lambda: init_fn(*args, **kwargs))
  except TypeError:  # returns something that is not arrays: nothing to place
    return init_fn(*args, **kwargs)
  shape = getattr(out, 'shape', None)
  if (
      shape is None
      or len(shape) != len(entries)
      or check_spec(tuple(shape), entries, mesh)
  ):
    # Invalid layouts are reported, with the parameter path, by
    # get_sharding / plan; here the value is just created as usual.
    return init_fn(*args, **kwargs)
  spec = PartitionSpec(*entries)
  if tracing:
    # Arrays (the key) enter auto_axes as arguments so their types become
    # Auto; shapes and dtypes stay static.
    return jax.sharding.auto_axes(call, out_sharding=spec)(*arrays)
  avals = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays)
  try:
    generator = _eager_generator(call, avals, mesh, spec, explicit)
  except TypeError:  # unhashable static arguments: no cached program
    return apply_spec(init_fn(*args, **kwargs), entries, mesh, names=names)
  return generator(*arrays)


class ArrayCall:
  """``init_fn`` with its non-array arguments fixed, called on the arrays.

  jax transformations take arrays; initializers also take shapes and dtypes.
  """

  @classmethod
  def split(cls, init_fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> tuple[ArrayCall, list[Any]]:
    """The call with the non-arrays fixed, and the arrays to call it on."""
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    is_array = tuple(isinstance(x, jax.Array) for x in leaves)
    static = tuple(x for x, a in zip(leaves, is_array) if not a)
    return (cls(init_fn, treedef, static, is_array),
            [x for x, a in zip(leaves, is_array) if a])

  def __init__(self, init_fn: Any, treedef: Any, static: tuple[Any, ...],
               is_array: tuple[bool, ...]):
    self.init_fn, self.treedef = init_fn, treedef
    self.static, self.is_array = static, is_array

  def _key(self) -> tuple[Any, ...]:
    return (self.init_fn, self.treedef, self.static, self.is_array)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, ArrayCall) and self._key() == other._key()

  def __hash__(self) -> int:  # TypeError for unhashable static arguments
    return hash(self._key())

  def __call__(self, *arrays: Any) -> Any:
    arr, st = iter(arrays), iter(self.static)
    full = [next(arr) if a else next(st) for a in self.is_array]
    args, kwargs = jax.tree_util.tree_unflatten(self.treedef, full)
    return self.init_fn(*args, **kwargs)


@functools.lru_cache(maxsize=1024)
def _eager_generator(call, avals, mesh, spec, explicit):
  from flax_shardmeta import windowed  # windowed sits above this module

  sharding = NamedSharding(mesh, spec)
  closed = jax.make_jaxpr(lambda *a: [call(*a)])(*avals)
  out = closed.out_avals[0]
  local = math.prod(sharding.shard_shape(out.shape)) * out.dtype.itemsize
  w = windowed.analyse(closed, None, 0) if local > windowed.CHUNK_BYTES else None
  if w is not None:
    # Large parameter: each device fills its shard chunk by chunk.
    return jax.jit(
        lambda *a: windowed.generate_sharded(w, list(a), sharding, out.dtype),
        out_shardings=sharding)
  if explicit:
    call = jax.sharding.auto_axes(call, out_sharding=spec)
  return jax.jit(call, out_shardings=sharding)
