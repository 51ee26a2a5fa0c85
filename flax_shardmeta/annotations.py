"""Reading sharding annotations off any leaf, and walking trees of them.

Front ends annotate differently: our boxes, flax's ``nn.Partitioned`` /
``nn.LogicallyPartitioned``, NNX Variables with metadata. Each registers a
reader here that turns its leaf into ``(value, Annotation)``; everything above
this module (sharding, plan, checkpoint) sees only :class:`Annotation`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
from flax.core import meta as flax_meta
from flax.linen import spmd as flax_linen_spmd

from flax_shardmeta.boxes import Partitioned
from flax_shardmeta.typing import AnyMesh, PyTree


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
  """

  names: tuple[Any, ...]
  logical: bool = False
  rules: tuple[tuple[str, Any], ...] | None = None
  mesh: AnyMesh | None = None
  keep_mesh_names: bool = False
  optimizer_state: bool = False


Reader = Callable[[Any], tuple[Any, Annotation | None]]
"""Leaf -> (its array value, its annotation or None)."""
Rebuild = Callable[[Any, Any], Any]
"""(original leaf, computed result) -> what the output tree holds there."""


class _Entry(NamedTuple):
  kind: type
  read: Reader
  rebuild: Rebuild


_registry: list[_Entry] = []
_leaf_types: tuple[type, ...] = ()


def register_annotation_type(
    kind: type, read: Reader, rebuild: Rebuild | None = None
) -> None:
  """Teaches flax_shardmeta a new annotated leaf type.

  Args:
    kind: the leaf class (subclasses match too; first registration wins).
    read: returns ``(value, Annotation | None)`` for a leaf.
    rebuild: how results are placed in output trees; by default the result
      replaces the leaf.
  """
  global _leaf_types
  _registry.append(_Entry(kind, read, rebuild or (lambda _leaf, r: r)))
  _leaf_types = tuple(e.kind for e in _registry)


def _entry(x: Any) -> _Entry | None:
  for e in _registry:
    if isinstance(x, e.kind):
      return e
  return None


def is_annotated_leaf(x: Any) -> bool:
  """Whether ``x`` is a leaf type some reader understands."""
  return isinstance(x, _leaf_types)


def read(x: Any) -> tuple[Any, Annotation | None]:
  """``(value, annotation)`` of any leaf; plain leaves have no annotation."""
  e = _entry(x)
  if e is None:
    return x, None
  return e.read(x)


def rebuild(x: Any, result: Any) -> Any:
  """Places ``result`` where leaf ``x`` was."""
  e = _entry(x)
  return result if e is None else e.rebuild(x, result)


# Optimizer state
# ------------------------------------------------------------------------------


def is_optimizer_state(x: Any) -> bool:
  """Whether ``x`` is an optax state node (a NamedTuple defined by optax)."""
  cls = type(x)
  return (
      isinstance(x, tuple)
      and hasattr(cls, '_fields')
      and cls.__module__.split('.', 1)[0] == 'optax'
  )


# Traversal
# ------------------------------------------------------------------------------


def key_str(key: Any) -> str:
  """One path component as text."""
  for attr in ('key', 'name', 'idx'):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def path_str(path: tuple[Any, ...]) -> str:
  """A key path as '/'-joined text, e.g. ``params/Dense_0/kernel``."""
  return '/'.join(key_str(k) for k in path)


class Leaf(NamedTuple):
  """One leaf met by :func:`walk`."""

  path: str
  leaf: Any
  value: Any
  annotation: Annotation | None


def walk(tree: PyTree) -> tuple[list[Leaf], Callable[[list[Any]], PyTree]]:
  """Flattens ``tree`` down to annotated leaves and plain leaves.

  Returns the leaves, and a function building a tree of the same structure
  from one result per leaf (each placed by its type's ``rebuild``). Leaves
  under an optax state node are marked as optimizer state.
  """
  leaves: list[Leaf] = []
  builders: list[Callable[[Iterator[Any]], Any]] = []

  def is_stop(x: Any) -> bool:
    return is_annotated_leaf(x) or is_optimizer_state(x)

  flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_stop)
  for path, x in flat:
    if is_optimizer_state(x):
      sub_leaves, sub_build = _walk_optimizer(x, path_str(path))
      leaves.extend(sub_leaves)
      n = len(sub_leaves)
      builders.append(
          lambda it, n=n, b=sub_build: b([next(it) for _ in range(n)])
      )
    else:
      value, ann = read(x)
      leaves.append(Leaf(path_str(path), x, value, ann))
      builders.append(lambda it, x=x: rebuild(x, next(it)))

  def build(results: list[Any]) -> PyTree:
    it = iter(results)
    return jax.tree_util.tree_unflatten(treedef, [b(it) for b in builders])

  return leaves, build


def _walk_optimizer(node: Any, prefix: str):
  sub_leaves, sub_build = walk(tuple(node))
  out = []
  for lf in sub_leaves:
    ann = lf.annotation
    if ann is not None:
      ann = dataclasses.replace(ann, optimizer_state=True)
    path = f'{prefix}/{lf.path}' if prefix else lf.path
    out.append(Leaf(path, lf.leaf, lf.value, ann))

  def build(results: list[Any]) -> Any:
    return type(node)(*sub_build(results))

  return out, build


# Readers for Linen boxes
# ------------------------------------------------------------------------------


def _read_fsm_box(box: Partitioned[Any]) -> tuple[Any, Annotation]:
  return box.value, Annotation(box.names, box.is_logical, box.rules, box.mesh)


def _read_flax_box(box: Any) -> tuple[Any, Annotation]:
  logical = isinstance(box, flax_linen_spmd.LogicallyPartitioned)
  rules = getattr(box, 'rules', None) if logical else None
  return box.value, Annotation(tuple(box.names), logical, rules, box.mesh)


def _read_other_box(box: Any) -> tuple[Any, Annotation | None]:
  # Some other AxisMetadata (e.g. a user's): unwrap it and read what it holds.
  inner = box.unbox() if not hasattr(box, 'value') else box.value
  return read(inner)


register_annotation_type(Partitioned, _read_fsm_box)
register_annotation_type(flax_meta.Partitioned, _read_flax_box)
register_annotation_type(flax_meta.AxisMetadata, _read_other_box)
