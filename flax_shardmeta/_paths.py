"""Leaf paths of walked trees, as text made only when read.

A walk (``_annotation.walk``) meets every leaf of a tree; most callers never
read a path, errors and plans read a few or all. :class:`KeyPaths` makes them
on demand; ``_annotation.Leaf`` is one leaf met with its path.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax

from flax_shardmeta._typing import PyTree


def key_str(key: Any) -> str:
  """One path component as text."""
  attr = _KEY_ATTRS.get(type(key))
  if attr is not None:
    return str(getattr(key, attr))
  for attr in ('key', 'name', 'idx'):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


# jax's own key types, whose text is one known attribute: plans of large trees
# make a path string per leaf, and probing attributes one by one is most of it.
_KEY_ATTRS: dict[type, str] = {
  jax.tree_util.DictKey: 'key',
  jax.tree_util.GetAttrKey: 'name',
  jax.tree_util.SequenceKey: 'idx',
  jax.tree_util.FlattenedIndexKey: 'key',
}


def path_str(path: tuple[Any, ...]) -> str:
  """A key path as '/'-joined text, e.g. ``params/Dense_0/kernel``."""
  return '/'.join(map(key_str, path))


class KeyPaths:
  """Key paths of a flattened tree, computed on first use (errors and plans
  need them; the common get_sharding path does not).

  A few paths are found by walking down from the root, one tree level at a
  time, which costs far less than flattening a large tree with paths; past
  :attr:`DESCENTS` requests every path is computed at once. ``is_leaf`` is
  the flattening's: the walk stops at annotated leaves.
  """

  __slots__ = (
    '_tree',
    '_treedef',
    '_keys',
    '_texts',
    '_kids',
    '_descents',
    '_is_leaf',
  )
  DESCENTS = 64

  def __init__(
    self,
    tree: PyTree,
    treedef: Any = None,
    keys: list[tuple[Any, ...]] | None = None,
    is_leaf: Callable[[Any], bool] | None = None,
  ):
    self._is_leaf = is_leaf
    self._tree = tree
    self._treedef = treedef
    self._keys = keys
    self._texts: list[str] | None = None
    self._kids: dict[int, list[tuple[Any, Any, Any, int]]] = {}
    self._descents = 0

  def __getitem__(self, i: int) -> tuple[Any, ...]:
    if (
      self._keys is None
      and self._treedef is not None
      and (self._descents < self.DESCENTS)
    ):
      self._descents += 1
      return self._descend(i)
    return self.every_key()[i]

  def every_key(self) -> list[tuple[Any, ...]]:
    """Every leaf's key path, computed in one pass (then kept)."""
    if self._keys is None:
      flat, _ = jax.tree_util.tree_flatten_with_path(self._tree, is_leaf=self._is_leaf)
      self._keys = [k for k, _ in flat]
      self._tree = None
      self._kids = {}  # the full list replaces the partial descents
    return self._keys

  def text(self, i: int) -> str:
    """Leaf ``i``'s key path as text (see :func:`path_str`)."""
    if self._texts is not None:
      return self._texts[i]
    return path_str(self[i])

  def every_text(self) -> list[str]:
    """Every leaf's key path as text, in one pass (then kept).

    The key tuples are not kept when they were not made yet: a plan of a
    large tree needs only the text, and fewer long-lived objects mean fewer
    collector passes over the whole heap.
    """
    if self._texts is None:
      if self._keys is not None:
        self._texts = [path_str(k) for k in self._keys]
      else:
        flat, _ = jax.tree_util.tree_flatten_with_path(
          self._tree, is_leaf=self._is_leaf
        )
        self._texts = [path_str(k) for k, _ in flat]
    return self._texts

  def _descend(self, i: int) -> tuple[Any, ...]:
    node, treedef, keys = self._tree, self._treedef, []
    while True:
      children = self._children(node, treedef)
      if not children:
        return tuple(keys)
      for key, child, child_def, n in children:
        if i < n:
          keys.append(key)
          node, treedef = child, child_def
          break
        i -= n

  def _children(self, node: Any, treedef: Any) -> list[tuple[Any, Any, Any, int]]:
    """``(key, child, child treedef, leaf count)`` per child (cached per node)."""
    kids = self._kids.get(id(node))
    if kids is None:
      defs = treedef.children()
      if defs:
        # One level only: every child is a leaf of this flattening.
        flat, _ = jax.tree_util.tree_flatten_with_path(
          node, is_leaf=lambda x: x is not node
        )
        kids = [(k[0], x, d, d.num_leaves) for (k, x), d in zip(flat, defs)]
      else:
        kids = []
      self._kids[id(node)] = kids
    return kids


class Prefix:
  """The text path of an optimizer-state node, made on first use."""

  __slots__ = ('_paths', '_index')

  def __init__(self, paths: KeyPaths, index: int):
    self._paths, self._index = paths, index

  def __str__(self) -> str:
    return self._paths.text(self._index)


class JoinedPrefix:
  __slots__ = ('_outer', '_inner')

  def __init__(self, outer: Any, inner: Any):
    self._outer, self._inner = outer, inner

  def __str__(self) -> str:
    return '/'.join(p for p in (str(self._outer), str(self._inner)) if p)


def nest(items: Any) -> dict[str, Any]:
  """``(path, value)`` pairs as nested dicts, one level per path component
  (the tree a treescope view of a plan shows).

  Example:
    >>> nest([('params/dense/kernel', 1), ('params/bias', 2)])
    {'params': {'dense': {'kernel': 1}, 'bias': 2}}
  """
  tree: dict[str, Any] = {}
  for path, value in items:
    node = tree
    *parents, leaf = path.split('/')
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return tree


def argument_names(step: Any, n: int) -> tuple[str, ...]:
  """The names of ``step``'s first ``n`` positional parameters (``arg{i}``
  where it has none), as paths of its arguments begin (``state/params/w``)
  in fit, why and plans of a step.

  Example:
    >>> argument_names(lambda state, batch: None, 3)
    ('state', 'batch', 'arg2')
  """
  fn = inspect.unwrap(step)
  try:
    params = [
      p.name
      for p in inspect.signature(fn).parameters.values()
      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
  except (TypeError, ValueError):
    params = []
  return tuple(params[i] if i < len(params) else f'arg{i}' for i in range(n))
