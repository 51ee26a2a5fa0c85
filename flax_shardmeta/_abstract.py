"""Abstract trees laid out for a mesh: restore targets, ``lower`` arguments.

One walk over the annotated leaves (Linen boxes, flax's boxes, NNX
Variables, any registered type) lays each out as ``fsm.get_sharding`` does
and puts a ``jax.ShapeDtypeStruct`` carrying its sharding in its place; the
tree keeps its structure (boxes and Variables hold the structs).
"""

from __future__ import annotations

from typing import Any

import jax

from flax_shardmeta import _annotation as ann_lib
from flax_shardmeta._caches import paused_gc
from flax_shardmeta._errors import InvalidNamesError, ShardingError
from flax_shardmeta._placement import check_mesh
from flax_shardmeta._sharding import (
  LeafLayout,
  lay_out,
  leaf_shape,
)
from flax_shardmeta._typing import AnyMesh, LogicalRules, PyTree


def as_abstract(
  tree: PyTree, mesh: AnyMesh, rules: LogicalRules | None = None
) -> PyTree:
  """``tree`` with ``ShapeDtypeStruct`` leaves carrying the planned shardings.

  Pass the result as the restore target of orbax-checkpoint to load a
  checkpoint onto ``mesh``, whatever mesh it was saved from. Boxes are kept
  (each then holds a struct), so the target mirrors a tree saved with boxes;
  non-array leaves are kept as they are. NNX state works too (see
  :func:`flax_shardmeta.nnx.as_abstract`, which also takes a module).

  Args:
    tree: the abstract (``jax.eval_shape``) or concrete tree.
    mesh: the mesh to restore onto.
    rules: logical axis rules; None uses the context rules.

  Raises:
    ShardingError: if some leaf cannot be laid out on ``mesh``.
    InvalidNamesError: if some leaf's names are malformed.

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
    >>> tree = {'w': fsm.LogicalPartitioned(
    ...     jax.ShapeDtypeStruct((8, 16), jnp.float32), ('embed', 'mlp'))}
    >>> fsm.as_abstract(tree, mesh, [('mlp', 'model')])['w'].value.sharding.spec
    P(None, 'model')
  """
  mesh = check_mesh(mesh, 'as_abstract')
  laid = lay_out(tree, mesh, rules)
  if laid.bad_names:
    raise InvalidNamesError(problems=laid.bad_names)
  if laid.problems:
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    raise ShardingError(laid.problems, f' on mesh {sizes}')
  with paused_gc():
    leaves = zip(laid.leaves, laid.every_layout())
    return laid.build([_abstract_leaf(lf, lay) for lf, lay in leaves])


def _abstract_leaf(lf: ann_lib.Leaf, layout: LeafLayout) -> Any:
  """What the abstract tree holds in place of one walked leaf: its value as a
  struct with its sharding (a non-array value as it is), held by the leaf if
  the leaf is a box or another holder (see ``_annotation.register_holder``)."""
  value = lf.value
  if layout.sharding is None or leaf_shape(value) is None:
    struct = value
  else:
    struct = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=layout.sharding)
  return struct if lf.leaf is value else ann_lib.hold(lf.leaf, struct)
