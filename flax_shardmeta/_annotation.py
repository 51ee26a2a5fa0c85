"""Reading sharding annotations off any leaf, and walking trees of them.

Front ends annotate differently: our boxes, flax's ``nn.Partitioned`` /
``nn.LogicallyPartitioned``, NNX Variables with metadata. Each registers a
reader here that turns its leaf into ``(value, Annotation)``; everything above
this module (shardings, abstract trees, plans) sees only :class:`Annotation`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from flax_shardmeta._errors import ShardingError, ShardingProblem
from flax_shardmeta._paths import (  # `X as X`: read from here by the modules above
  JoinedPrefix,
  KeyPaths as _KeyPaths,
  Prefix,
  key_str as key_str,
  path_str as path_str,
)
from flax_shardmeta._typing import AnyMesh, PyTree


@dataclasses.dataclass(frozen=True)
class Annotation:
  """A leaf's sharding annotation, front-end independent.

  Attributes:
    names: one entry per dimension, as written.
    logical: whether names go through logical axis rules.
    rules: per-variable rules (composed with the context/explicit rules).
    mesh: a mesh attached to the annotation, if any.
    keep_mesh_names: for flax NNX annotations, a name with no rule that is a
      mesh axis stays that axis (flax's renaming semantics).
    optimizer_state: the leaf belongs to optimizer state (lenient rank rule).
    reductions: the unreduced / reduced mesh axes of a PartitionSpec
      annotation, as a PartitionSpec with no dimensions (``P(reduced=
      {'data'})``), kept as they are in the resolved spec; None if none.

  Example:
    >>> import flax_shardmeta as fsm
    >>> ann = fsm.Annotation(('embed', 'mlp'), logical=True)
    >>> ann.names, ann.logical
    (('embed', 'mlp'), True)
  """

  names: tuple[Any, ...]
  logical: bool = False
  rules: tuple[tuple[str, Any], ...] | None = None
  mesh: AnyMesh | None = None
  keep_mesh_names: bool = False
  optimizer_state: bool = False
  reductions: Any = None
  _hash: int = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self) -> None:
    # Annotations key every layout cache lookup: hash the content once.
    object.__setattr__(
      self,
      '_hash',
      hash(
        (
          self.names,
          self.logical,
          self.rules,
          self.mesh,
          self.keep_mesh_names,
          self.optimizer_state,
          self.reductions,
        )
      ),
    )

  def __hash__(self) -> int:
    return self._hash


class Leaf:
  """One leaf met by a walk (``_annotation.walk``); its text path is made
  only when asked for."""

  __slots__ = ('_paths', '_index', 'leaf', 'value', 'annotation', '_prefix')

  def __init__(
    self,
    paths: Any,
    index: int,
    leaf: Any,
    value: Any,
    annotation: Annotation | None,
    prefix: Any = '',
  ):
    self._paths = paths
    self._index = index
    self.leaf = leaf
    self.value = value
    self.annotation = annotation
    self._prefix = prefix

  @property
  def keys(self) -> tuple[Any, ...]:
    """The jax key path (below the optimizer-state prefix, if any)."""
    return self._paths[self._index]

  @property
  def path(self) -> str:
    """'/'-joined key path, e.g. ``params/Dense_0/kernel``."""
    rest = self._paths.text(self._index)
    prefix = str(self._prefix) if self._prefix else ''
    if prefix:
      return f'{prefix}/{rest}' if rest else prefix
    return rest

  def __repr__(self) -> str:
    return f'Leaf({self.path!r}, annotation={self.annotation!r})'


def paths_of(leaves: list[Leaf]) -> list[str]:
  """Every leaf's text path, as :attr:`Leaf.path` gives it, made in one pass.

  For callers that need all paths of a walk made without ``every_path``.
  """
  seen: set[int] = set()
  for lf in leaves:
    if id(lf._paths) not in seen:
      seen.add(id(lf._paths))
      lf._paths.every_text()
  return [lf.path for lf in leaves]


@functools.lru_cache(maxsize=65536)
def interned(
  names: tuple[Any, ...],
  logical: bool = False,
  rules: tuple[tuple[str, Any], ...] | None = None,
  mesh: AnyMesh | None = None,
  keep_mesh_names: bool = False,
  optimizer_state: bool = False,
) -> Annotation:
  """One shared Annotation per distinct content, so caches keyed on it hit fast."""
  return Annotation(names, logical, rules, mesh, keep_mesh_names, optimizer_state)


Reader = Callable[[Any], tuple[Any, Annotation | None]]
"""Leaf -> (its array value, its annotation or None)."""
Rebuild = Callable[[Any, Any], Any]
"""(original leaf, computed result) -> what the output tree holds there."""


class _Entry(NamedTuple):
  kind: type
  read: Reader
  rebuild: Rebuild | None  # None: the result replaces the leaf


_registry: list[_Entry] = []
# Per concrete type: its registry entry, _OPTIMIZER for optax state nodes, or
# None. isinstance against ABCs is slow and trees hold few distinct types.
_by_type: dict[type, Any] = {}
_OPTIMIZER = object()


def register_annotation_type(
  kind: type, read: Reader, rebuild: Rebuild | None = None
) -> None:
  """Teaches flax_shardmeta a new annotated leaf type.

  Args:
    kind: the leaf class. Subclasses match too; a leaf takes the reader of
      the nearest class in its MRO, and registering a class again replaces
      its reader.
    read: returns ``(value, Annotation | None)`` for a leaf.
    rebuild: how results are placed in output trees; by default the result
      replaces the leaf.

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> class Tagged:  # a leaf type of one's own, holding a value and names
    ...   def __init__(self, value, names):
    ...     self.value, self.names = value, names
    >>> fsm.register_annotation_type(
    ...     Tagged, lambda t: (t.value, fsm.Annotation(tuple(t.names))))
    >>> mesh = jax.sharding.AbstractMesh((2,), ('model',))
    >>> tree = {'w': Tagged(jnp.zeros((4, 2)), ('model', None))}
    >>> fsm.get_sharding(tree, mesh)['w'].spec
    P('model', None)
  """
  # The front end's own readers first: a later registration of the same class
  # (yours) wins over them.
  _load_adapter(kind)
  _registry.append(_Entry(kind, read, rebuild))
  _by_type.clear()


def swap_reader(kind: type, read: Reader, rebuild: Rebuild | None = None) -> None:
  """Replaces the latest reader registered for exactly ``kind`` (or registers
  one): for an adapter switching how its leaves are read, without growing the
  registry each time."""
  for i in range(len(_registry) - 1, -1, -1):
    if _registry[i].kind is kind:
      _registry[i] = _Entry(kind, read, rebuild)
      break
  else:
    _registry.append(_Entry(kind, read, rebuild))
  _by_type.clear()


def _classify(t: type) -> Any:
  found = _by_type.get(t, _MISSING)
  if found is _MISSING:
    _load_adapter(t)
    found = _most_specific(t)
    if found is None and _is_optax_state_type(t):
      found = _OPTIMIZER
    _by_type[t] = found
  return found


_MISSING = object()

# Front-end adapters that register their readers when imported, by the module
# their leaf types come from: Linen's (our boxes, flax's, any AxisMetadata) and
# NNX's, the same way. ``import flax_shardmeta`` loads no adapter (Linen users
# should not pay for flax.nnx); the first leaf of such a type loads its
# adapter, and by then its front end is imported, so only the adapter's own code
# is loaded. Imported by name: the adapters sit above this layer.
_ADAPTERS = {
  'flax_shardmeta._boxes': 'flax_shardmeta._linen',
  'flax.core.meta': 'flax_shardmeta._linen',
  'flax.linen': 'flax_shardmeta._linen',
  'flax.nnx': 'flax_shardmeta.nnx',
}


def _load_adapter(t: type) -> None:
  # Once per new leaf type. import_module also waits for an adapter another
  # thread is importing, so its readers are registered before ``t`` is looked up.
  for front_end, adapter in _ADAPTERS.items():
    for klass in t.__mro__:
      module = getattr(klass, '__module__', None) or ''
      if module == front_end or module.startswith(front_end + '.'):
        importlib.import_module(adapter)
        break


def _most_specific(t: type) -> _Entry | None:
  """The entry for the nearest class in ``t``'s MRO (the latest registration of
  a class wins), so a catch-all for a base class never shadows a subclass's own."""
  by_kind = {e.kind: e for e in _registry}
  for klass in t.__mro__:
    if klass in by_kind:
      return by_kind[klass]
  # Virtual subclasses (ABC.register) are not in the MRO.
  return next((e for e in reversed(_registry) if issubclass(t, e.kind)), None)


def read(x: Any) -> tuple[Any, Annotation | None]:
  """``(value, annotation)`` of any leaf; plain leaves have no annotation."""
  e = _classify(type(x))
  if e is None or e is _OPTIMIZER:
    return x, None
  return e.read(x)


def rebuild(x: Any, result: Any) -> Any:
  """Places ``result`` where leaf ``x`` was."""
  e = _classify(type(x))
  if e is None or e is _OPTIMIZER or e.rebuild is None:
    return result
  return e.rebuild(x, result)


# Holding a new value
# ------------------------------------------------------------------------------

Hold = Callable[[Any, Any], Any]
"""(original leaf, a new value) -> the leaf holding that value instead of its own."""

_holders: dict[type, Hold] = {}
_hold_by_type: dict[type, Hold | None] = {}


def register_holder(kind: type, hold_fn: Hold) -> None:
  """How a leaf of class ``kind`` (or a subclass) holds a new value in trees
  that keep their leaves, such as :func:`flax_shardmeta.as_abstract`'s (a box
  around a struct). Its results elsewhere still replace it (``rebuild``)."""
  _load_adapter(kind)
  _holders[kind] = hold_fn
  _hold_by_type.clear()


def hold(x: Any, value: Any) -> Any:
  """Leaf ``x`` holding ``value`` instead of its own, if its class says how
  (see :func:`register_holder`); else ``value`` itself."""
  t = type(x)
  if t in _hold_by_type:
    found = _hold_by_type[t]
  else:
    _load_adapter(t)  # its front end's holders are registered with its readers
    found = next((_holders[k] for k in t.__mro__ if k in _holders), None)
    if found is None:  # virtual subclasses (ABC.register) are not in the MRO
      found = next((h for k, h in _holders.items() if issubclass(t, k)), None)
    _hold_by_type[t] = found
  return value if found is None else found(x, value)


# Optimizer state
# ------------------------------------------------------------------------------


def _is_optax_state_type(t: type) -> bool:
  return (
    issubclass(t, tuple)
    and hasattr(t, '_fields')
    and t.__module__.split('.', 1)[0] == 'optax'
  )


# Traversal
# ------------------------------------------------------------------------------


def _stop(x: Any) -> bool:
  return _classify(type(x)) is not None


def walk(
  tree: PyTree, every_path: bool = False
) -> tuple[list[Leaf], Callable[[list[Any]], PyTree]]:
  """Flattens ``tree`` down to annotated leaves and plain leaves.

  Returns the leaves, and a function building a tree of the same structure
  from one result per leaf (each placed by its type's ``rebuild``). Leaves
  under an optax state node are marked as optimizer state.

  Args:
    tree: any pytree.
    every_path: the caller will read every leaf's path, so key paths are
      made in the same pass (otherwise only those read are made).
  """
  if every_path:
    flat_kp, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_stop)
    flat = [x for _, x in flat_kp]
    paths = _KeyPaths(None, keys=[k for k, _ in flat_kp], is_leaf=_stop)
  else:
    flat, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_stop)
    paths = _KeyPaths(tree, treedef, is_leaf=_stop)
  leaves: list[Leaf] = []
  # Only leaves needing more than "result replaces leaf" get a fix-up entry.
  fixups: list[tuple[int, Any]] = []
  for i, x in enumerate(flat):
    c = _classify(type(x))
    if c is None:
      leaves.append(Leaf(paths, i, x, x, None))
    elif c is _OPTIMIZER:
      sub_leaves, sub_build = _walk_optimizer(x, paths, i, every_path)
      fixups.append((len(leaves), (len(sub_leaves), sub_build)))
      leaves.extend(sub_leaves)
    else:
      value, ann = c.read(x)
      if not _is_leaf_value(value):
        sub_leaves, sub_build = _walk_value(value, ann, c, x, paths, i, every_path)
        fixups.append((len(leaves), (len(sub_leaves), sub_build)))
        leaves.extend(sub_leaves)
        continue
      if c.rebuild is not None:
        fixups.append((len(leaves), (c.rebuild, x)))
      leaves.append(Leaf(paths, i, x, value, ann))

  if not fixups:
    return leaves, lambda results: jax.tree_util.tree_unflatten(treedef, results)

  def build(results: list[Any]) -> PyTree:
    out: list[Any] = []
    pos = 0
    for start, fix in fixups:
      out.extend(results[pos:start])
      if isinstance(fix[0], int):
        n, sub_build = fix
        out.append(sub_build(results[start : start + n]))
        pos = start + n
      else:
        fn, leaf = fix
        out.append(fn(leaf, results[start]))
        pos = start + 1
    out.extend(results[pos:])
    return jax.tree_util.tree_unflatten(treedef, out)

  return leaves, build


_leaf_value_types: dict[type, bool] = {}
"""Per value class: whether an annotated leaf holding it is one array (or a
scalar, None...) rather than a tree of values (a dict, another Variable)."""


def _is_leaf_value(value: Any) -> bool:
  t = type(value)
  known = _leaf_value_types.get(t)
  if known is None:
    known = _classify(t) is None and (
      (hasattr(value, 'shape') and hasattr(value, 'dtype'))
      or jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(value))
    )
    if t is not type(None):
      _leaf_value_types[t] = known
  return known


def _walk_value(
  value: Any,
  ann: Annotation | None,
  entry: _Entry,
  leaf: Any,
  paths: _KeyPaths,
  index: int,
  every_path: bool,
):
  """An annotated leaf whose value is a tree (an NNX Variable holding a dict
  or another Variable): each array in it takes the leaf's annotation unless it
  carries its own, and the results go back into the leaf as a tree."""
  sub_leaves, sub_build = walk(value, every_path)
  outer = Prefix(paths, index)
  for lf in sub_leaves:
    if lf.annotation is None:
      lf.annotation = ann
    lf._prefix = JoinedPrefix(outer, lf._prefix) if lf._prefix else outer
  if entry.rebuild is None:
    return sub_leaves, sub_build
  rebuild_leaf = entry.rebuild
  return sub_leaves, lambda results: rebuild_leaf(leaf, sub_build(results))


def _walk_optimizer(node: Any, paths: _KeyPaths, index: int, every_path: bool):
  fields = dict(zip(node._fields, node))
  sub_leaves, sub_build = walk(fields, every_path)
  outer = Prefix(paths, index)
  for lf in sub_leaves:
    if lf.annotation is not None:
      lf.annotation = _as_optimizer(lf.annotation)
    lf._prefix = JoinedPrefix(outer, lf._prefix) if lf._prefix else outer
  return sub_leaves, lambda results: type(node)(**sub_build(results))


@functools.lru_cache(maxsize=16384)
def _as_optimizer(ann: Annotation) -> Annotation:
  return dataclasses.replace(ann, optimizer_state=True)


def check_not_function(tree: Any) -> None:
  """A function given where its output belongs (``model.init``, a factory)
  would be one non-array leaf: an empty plan, said to have no problems."""
  jitted = callable(tree) and hasattr(tree, 'lower') and hasattr(tree, 'trace')
  if not (inspect.isroutine(tree) or isinstance(tree, functools.partial) or jitted):
    return
  name = getattr(tree, '__qualname__', None) or type(tree).__name__
  raise ShardingError(
    [
      ShardingProblem(
        '(root)',
        None,
        None,
        None,
        f'the tree is the function {name}, not the tree it makes; a function '
        'holds no arrays to lay out',
        'pass its abstract output, e.g. jax.eval_shape(model.init, key, x) '
        '(Linen) or nnx.eval_shape(lambda: Model(rngs=nnx.Rngs(0))) (NNX)',
      )
    ]
  )
