"""Boxed partition metadata for Linen: ``Partitioned`` and ``LogicalPartitioned``.

A box wraps one variable value together with its per-dimension names. Boxes are
``flax.core.meta.AxisMetadata`` subclasses and pytrees whose only child is the
value (names, mesh and rules are static), so they survive ``init``, lifted
transforms such as ``nn.scan``, ``jax.eval_shape`` and optax's tree maps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import jax
import jax.core
import numpy as np
from flax.core import meta
from flax.linen import spmd as flax_linen_spmd
from jax.sharding import PartitionSpec

from flax_shardmeta._errors import (
  InvalidNamesError,
  ShardingError,
  ShardingProblem,
)
from flax_shardmeta._flax_adapter import FsmRules, local_rules_of
from flax_shardmeta._generate.generate import generate
from flax_shardmeta._names import annotation_names as as_names
from flax_shardmeta._placement import apply_spec, context_mesh
from flax_shardmeta._resolution import resolve
from flax_shardmeta._rules import (
  composite_rules,
  get_logical_axis_rules,
  normalize_rules,
)
from flax_shardmeta._specs import format_spec, unassigned_to_none
from flax_shardmeta._typing import (
  AnyMesh,
  BoxingInitializer,
  LogicalNames,
  LogicalRules,
  PyTree,
)
from flax_shardmeta._validate import rank_issue

A = TypeVar('A')
B = TypeVar('B', bound='Partitioned[Any]')

PARTITION_NAME = 'partition_name'
"""Key of ``metadata_params`` (``nn.scan``/``nn.vmap``) holding the name of the
axis the transform adds: ``metadata_params={fsm.PARTITION_NAME: 'layers'}``."""


class Partitioned(meta.AxisMetadata[A], Generic[A]):
  """A value annotated with mesh-axis names, one per dimension.

  Example:
    >>> import jax.numpy as jnp, flax_shardmeta as fsm
    >>> box = fsm.Partitioned(jnp.zeros((4, 8)), (None, 'model'))
    >>> box.get_partition_spec()
    P(None, 'model')
    >>> box.add_axis(0, {fsm.PARTITION_NAME: 'layers'}).names
    ('layers', None, 'model')
  """

  # `_reshaping` is set only on a box an initializer made around a value of
  # another rank than its names (see `reshaping`); unset everywhere else.
  __slots__ = ('value', 'names', 'mesh', '_reshaping')

  def __init__(self, value: A, names: LogicalNames, mesh: AnyMesh | None = None):
    self.value = value
    self.names = as_names(names)
    self.mesh = mesh

  # -- AxisMetadata -----------------------------------------------------------

  def unbox(self, apply_constraint: bool = True) -> A:
    """Returns the value; with a mesh (own or context) it is constrained to the
    annotated layout first.

    A box fresh from an initializer whose value has another rank than its
    names (``nn.DenseGeneral`` asks for the kernel flattened to 2-D, then
    reshapes it and puts it back with ``replace_boxed``) is unboxed as it is
    until then: its names describe the final shape, whose rank is checked
    wherever it is laid out.
    """
    if not apply_constraint or getattr(self, '_reshaping', False):
      return self.value
    return constrain_box(self)

  def replace_boxed(self, val: Any) -> Partitioned[Any]:
    """A box with the same metadata around ``val``."""
    if getattr(self, '_reshaping', False):
      object.__setattr__(self, '_reshaping', False)  # the reshape is done
    return self._with(value=val)

  def add_axis(self, index: int, params: dict[Any, Any]) -> Partitioned[A]:
    """Inserts the transform's axis name (``params[PARTITION_NAME]``, default
    None: an unsharded axis) at ``index``.

    ``add_axis`` and ``remove_axis`` are inverses:
    ``x.add_axis(i, p).remove_axis(i, p) == x``.
    """
    name = (params or {}).get(PARTITION_NAME, None)
    names = list(self.names)
    while len(names) < index:
      names.append(None)
    names.insert(index, name)
    return self._with(names=tuple(names))

  def remove_axis(self, index: int, params: dict[Any, Any]) -> Partitioned[A]:
    """Removes the axis a transform added at ``index``; its name must match."""
    name = (params or {}).get(PARTITION_NAME, None)
    names = list(self.names)
    if not -len(names) <= index < len(names):
      raise InvalidNamesError(
        f'Cannot remove axis {index} from names {format_spec(self.names)}: '
        f'there are only {len(names)} names.'
      )
    if names[index] != name:
      raise InvalidNamesError(
        f'Cannot remove axis {index} named {name!r} from names '
        f'{format_spec(self.names)}: that position holds {names[index]!r}. '
        'Pass the same metadata_params to the transform that added it.'
      )
    del names[index]
    return self._with(names=tuple(names))

  # -- annotations ------------------------------------------------------------

  def get_partition_spec(self) -> PartitionSpec:
    """The annotation as written, as a PartitionSpec."""
    return PartitionSpec(*self.names)

  @property
  def is_logical(self) -> bool:
    """Whether ``names`` are logical names to resolve through rules."""
    return False

  @property
  def rules(self) -> tuple[tuple[str, Any], ...] | None:
    return None

  def to_nnx_metadata(self) -> dict[str, Any]:
    """Metadata for an ``nnx.Variable`` (used by ``nnx.bridge``)."""
    # nnx.bridge builds the Variable from this dict alone, value included.
    return {
      'value': self.value,
      'out_sharding': self.names,
      'mesh': self.mesh,
      'fsm_logical': False,
      'eager_sharding': False,
    }

  @classmethod
  def from_nnx_metadata(cls, metadata: dict[str, Any]) -> Partitioned[Any]:
    """Inverse of :meth:`to_nnx_metadata` (used by ``nnx.bridge``)."""
    value: Any = metadata.get('value')
    return cls(value, metadata['out_sharding'], mesh=metadata.get('mesh'))

  # -- plumbing ---------------------------------------------------------------

  def _static(self) -> tuple[Any, ...]:
    return (self.names, self.mesh)

  def _with(self, **changes: Any) -> Partitioned[Any]:
    new = object.__new__(type(self))
    for slot in _all_slots(type(self)):
      object.__setattr__(new, slot, changes.get(slot, getattr(self, slot)))
    return new

  def __eq__(self, other: object) -> bool:
    # As flax's boxes (dataclasses): equal type, metadata and value. So
    # `jax.tree.map(jnp.shape, boxed) == {... expected boxes ...}` works.
    if type(other) is not type(self):
      return NotImplemented
    return self._static() == other._static() and values_equal(self.value, other.value)

  __hash__ = None  # type: ignore[assignment]

  def __repr__(self) -> str:
    value: Any = self.value
    if hasattr(value, 'shape') and hasattr(value, 'dtype'):
      shown = f'{type(value).__name__}({value.dtype}{list(value.shape)})'
    else:
      shown = repr(value)
    extra = ''.join(
      f', {k}={v!r}'
      for k, v in zip(('mesh', 'rules'), self._static()[1:])
      if v is not None
    )
    return f'{type(self).__name__}({shown}, names={format_spec(self.names)}{extra})'


class LogicalPartitioned(Partitioned[A]):
  """A value annotated with logical names, resolved through logical axis rules.

  ``rules`` are per-variable rules composed with the context rules (see
  :func:`flax_shardmeta.composite_rules`).

  Example:
    >>> import jax.numpy as jnp, flax_shardmeta as fsm
    >>> box = fsm.LogicalPartitioned(jnp.zeros((4, 8)), ('embed', 'mlp'))
    >>> box.get_partition_spec()  # as written: still logical
    P('embed', 'mlp')
  """

  __slots__ = ('_rules',)

  def __init__(
    self,
    value: A,
    names: LogicalNames,
    mesh: AnyMesh | None = None,
    rules: LogicalRules | None = None,
  ):
    super().__init__(value, names, mesh)
    self._rules = normalize_rules(rules) if rules is not None else None

  @property
  def is_logical(self) -> bool:
    return True

  @property
  def rules(self) -> tuple[tuple[str, Any], ...] | None:
    return self._rules

  def to_nnx_metadata(self) -> dict[str, Any]:
    return {
      **super().to_nnx_metadata(),
      'fsm_logical': True,
      'sharding_rules': FsmRules(self.names, rules=self._rules),
    }

  @classmethod
  def from_nnx_metadata(cls, metadata: dict[str, Any]) -> LogicalPartitioned[Any]:
    value: Any = metadata.get('value')
    return cls(
      value,
      metadata['out_sharding'],
      mesh=metadata.get('mesh'),
      rules=local_rules_of(metadata.get('sharding_rules')),
    )

  def _static(self) -> tuple[Any, ...]:
    return (self.names, self.mesh, self._rules)


def values_equal(a: Any, b: Any) -> bool:
  """Whether two boxed values are equal: by ``==`` for plain values (shapes,
  ``ShapeDtypeStruct``s), element by element for concrete arrays; a traced
  value equals only itself (its elements are not known)."""
  if a is b:
    return True
  if isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer):
    return False
  if (
    hasattr(a, 'shape')
    and hasattr(a, 'dtype')
    and not isinstance(a, jax.ShapeDtypeStruct)
  ):
    if not (hasattr(b, 'shape') and hasattr(b, 'dtype')):
      return False
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
      return False
    try:
      return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    except (TypeError, RuntimeError):  # e.g. not fully addressable here
      return False
  try:
    return bool(a == b)
  except (TypeError, ValueError):  # no truth value: compare structure instead
    return False


@functools.cache
def _all_slots(cls: type) -> tuple[str, ...]:
  """The fields a copy of a box carries over (not the one-shot reshape mark)."""
  slots: list[str] = []
  for klass in reversed(cls.__mro__):
    slots.extend(s for s in getattr(klass, '__slots__', ()) if s != '_reshaping')
  return tuple(dict.fromkeys(slots))


def reshaping(box: B) -> B:
  """Marks a box just made by an initializer, if its value's rank differs
  from its names.

  flax's layers that reshape kernels (``nn.DenseGeneral``,
  ``nn.MultiHeadDotProductAttention``) call the initializer with a flattened
  shape, unbox the result, reshape it and ``replace_boxed`` it. Until that
  ``replace_boxed``, the marked box unboxes unconstrained; the box it makes
  (and any copy, e.g. through a jax transform) is an ordinary box again.
  """
  shape = getattr(box.value, 'shape', None)
  if shape is not None and len(shape) != len(box.names):
    object.__setattr__(box, '_reshaping', True)
  return box


def _flatten_with_keys(box: Partitioned[Any]):
  return ((jax.tree_util.GetAttrKey('value'), box.value),), (type(box), box._static())


def _flatten(box: Partitioned[Any]):
  return (box.value,), (type(box), box._static())


def _unflatten(aux: tuple[type, tuple[Any, ...]], children: Any):
  cls, static = aux
  new = object.__new__(cls)
  new.value = children[0]
  new.names, new.mesh = static[0], static[1]
  if len(static) > 2:
    new._rules = static[2]
  return new


for _cls in (Partitioned, LogicalPartitioned):
  jax.tree_util.register_pytree_with_keys(
    _cls, _flatten_with_keys, _unflatten, _flatten
  )

LogicallyPartitioned = LogicalPartitioned
"""flax's spelling (``nn.LogicallyPartitioned``) of :class:`LogicalPartitioned`:
code ported from flax keeps its name."""

# flax's own code recognises its boxes by class: Module.tabulate shows a
# Partitioned value with its names, and would otherwise meet an fsm box it
# cannot print. fsm's boxes have the same fields (value, names, mesh) and
# methods, so they are registered as virtual subclasses of flax's.
meta.Partitioned.register(Partitioned)
flax_linen_spmd.LogicallyPartitioned.register(LogicalPartitioned)


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
    entries = unassigned_to_none(resolve(box.names, rules))
  else:
    entries = box.names
  if len(entries) != len(value.shape):
    reason, hint, _ = rank_issue(len(entries), len(value.shape))
    raise ShardingError(
      [
        ShardingProblem(
          '<unboxed parameter>', tuple(value.shape), box.names, None, reason, hint
        )
      ],
      context=' (fsm.plan or fsm.get_sharding name the path)',
    )
  return apply_spec(value, entries, mesh, names=box.names)


def with_partitioning(
  init_fn: Callable[..., Any],
  names: LogicalNames,
  *,
  mesh: AnyMesh | None = None,
) -> BoxingInitializer:
  """Wraps an initializer so its result is boxed with mesh-axis ``names``.

  Example:
    >>> import flax.linen as nn, flax_shardmeta as fsm
    >>> dense = nn.Dense(8, kernel_init=fsm.with_partitioning(
    ...     nn.initializers.lecun_normal(), (None, 'model')))
  """

  names = as_names(names)  # malformed names are refused here, not at init

  @functools.wraps(init_fn)
  def wrapper(*args: Any, **kwargs: Any) -> Partitioned[Any]:
    value = generate(init_fn, args, kwargs, names, mesh)
    return reshaping(Partitioned(value, names, mesh=mesh))

  return wrapper


def with_logical_partitioning(
  init_fn: Callable[..., Any],
  names: LogicalNames,
  *,
  mesh: AnyMesh | None = None,
  rules: LogicalRules | None = None,
) -> BoxingInitializer:
  """Wraps an initializer so its result is boxed with logical ``names``.

  Example:
    >>> import flax.linen as nn, flax_shardmeta as fsm
    >>> dense = nn.Dense(8, kernel_init=fsm.with_logical_partitioning(
    ...     nn.initializers.lecun_normal(), ('embed', 'mlp')))
  """
  names = as_names(names)

  @functools.wraps(init_fn)
  def wrapper(*args: Any, **kwargs: Any) -> LogicalPartitioned[Any]:
    value = generate(init_fn, args, kwargs, names, mesh, logical=True, rules=rules)
    return reshaping(LogicalPartitioned(value, names, mesh=mesh, rules=rules))

  return wrapper


def is_box(x: Any) -> bool:
  """Whether ``x`` is an AxisMetadata box (ours or flax's)."""
  return isinstance(x, meta.AxisMetadata)


def unbox(tree: PyTree) -> PyTree:
  """Strips every box, returning the raw values (no constraint applied).

  Example:
    >>> import jax.numpy as jnp
    >>> import flax_shardmeta as fsm
    >>> fsm.unbox({'w': fsm.Partitioned(jnp.zeros(2), ('model',))})
    {'w': Array([0., 0.], dtype=float32)}
  """
  return jax.tree_util.tree_map(
    lambda x: unbox(_raw(x)) if is_box(x) else x, tree, is_leaf=is_box
  )


def _raw(box: Any) -> Any:
  # flax's own boxes also keep their payload in `.value`; going through it
  # avoids their unbox() applying a sharding constraint as a side effect.
  return box.value if hasattr(box, 'value') else box.unbox()


def replace_boxed(tree: PyTree, updates: PyTree) -> PyTree:
  """Puts ``updates`` (a tree of raw values) back into ``tree``'s boxes.

  Example:
    >>> import jax.numpy as jnp
    >>> import flax_shardmeta as fsm
    >>> boxed = {'w': fsm.Partitioned(jnp.zeros(2), ('model',))}
    >>> new = fsm.replace_boxed(boxed, {'w': jnp.ones(2)})
    >>> new['w'].names, new['w'].value
    (('model',), Array([1., 1.], dtype=float32))
  """

  def update(box: Any, new: Any) -> Any:
    if is_box(box):
      return box.replace_boxed(replace_boxed(_raw(box), new))
    return new

  return jax.tree_util.tree_map(update, tree, updates, is_leaf=is_box)
