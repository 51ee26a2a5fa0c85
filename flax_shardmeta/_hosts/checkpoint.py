"""Checkpoint support: restore targets laid out for any mesh.

orbax-checkpoint restores each array with the sharding of its target leaf;
:func:`as_abstract` builds that target from the same annotations that laid the
arrays out at init, so a checkpoint written on one mesh loads onto another.
"""

from __future__ import annotations

from typing import Any

import jax

from flax_shardmeta import _annotation as ann_lib
from flax_shardmeta._errors import ShardingError
from flax_shardmeta._planning.plan import plan
from flax_shardmeta._sharding import named_sharding
from flax_shardmeta._typing import AnyMesh, LogicalRules, PyTree


def as_abstract(
  tree: PyTree, mesh: AnyMesh, rules: LogicalRules | None = None
) -> PyTree:
  """``tree`` with ``ShapeDtypeStruct`` leaves carrying the planned shardings.

  Pass the result as the restore target of orbax-checkpoint to load a
  checkpoint onto ``mesh``, whatever mesh it was saved from. Boxes are kept
  (each then holds a struct), so the target mirrors a tree saved with boxes;
  non-array leaves are kept as they are.

  Args:
    tree: the abstract (``jax.eval_shape``) or concrete tree.
    mesh: the mesh to restore onto.
    rules: logical axis rules; None uses the context rules.

  Raises:
    ShardingError: if some leaf cannot be laid out on ``mesh``.

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
    >>> tree = {'w': fsm.LogicalPartitioned(
    ...     jax.ShapeDtypeStruct((8, 16), jnp.float32), ('embed', 'mlp'))}
    >>> fsm.as_abstract(tree, mesh, [('mlp', 'model')])['w'].value.sharding.spec
    P(None, 'model')
  """
  p = plan(tree, mesh, rules)
  if p.problems:
    raise ShardingError(
      p.problems, f' on mesh {dict(zip(mesh.axis_names, mesh.axis_sizes))}'
    )
  specs = {e.path: e.spec for e in p.entries}
  leaves, build = ann_lib.walk(tree)
  return build([_abstract_leaf(lf, specs.get(lf.path), mesh) for lf in leaves])


def _abstract_leaf(lf: ann_lib.Leaf, spec: Any, mesh: AnyMesh) -> Any:
  if spec is None:
    return lf.leaf
  struct = jax.ShapeDtypeStruct(
    lf.value.shape, lf.value.dtype, sharding=named_sharding(mesh, spec)
  )
  replace = getattr(lf.leaf, 'replace_boxed', None)
  return replace(struct) if callable(replace) else struct
