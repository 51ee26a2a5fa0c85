"""Host values onto their shards and back: ``shard_tree`` and ``gather_tree``.

Loading external weights onto a pod must not put the whole model on any
device or host: each process transfers only the slices its own devices hold.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Sharding

from flax_shardmeta._annotation import path_str
from flax_shardmeta._boxes import replace_boxed, unbox
from flax_shardmeta._errors import ShardingError, ShardingProblem
from flax_shardmeta._typing import PyTree
from flax_shardmeta._validate import check_spec


def _is_target(x: Any) -> bool:
  return (
    x is None
    or isinstance(x, Sharding)
    or (hasattr(x, 'shape') and hasattr(x, 'sharding'))
  )


def shard_tree(host_tree: PyTree, shardings: PyTree) -> PyTree:
  """Host (numpy) values -> ``jax.Array`` values with the given shardings.

  Each process copies only the slices its own devices hold
  (``jax.make_array_from_callback``); every process passes the same host
  values (or at least correct values at the slices it holds).

  Args:
    host_tree: numpy (or any array-like) leaves; boxes are kept.
    shardings: the same structure with ``Sharding`` leaves, or with leaves
      that carry a shape and a sharding (``fsm.as_abstract`` output,
      ``jax.ShapeDtypeStruct(..., sharding=...)``, arrays); the shape is then
      checked and its dtype applied. ``None`` leaves are passed through.

  Returns:
    ``host_tree`` with sharded ``jax.Array`` leaves.

  Raises:
    ShardingError: a value's shape is not the expected one, or cannot be
      split as the sharding says; every such leaf is named by path.

  Example:
    >>> import jax, numpy as np, flax_shardmeta as fsm
    >>> mesh = jax.make_mesh((2, 4), ('data', 'model'))
    >>> s = jax.NamedSharding(mesh, jax.P(None, 'model'))
    >>> out = fsm.shard_tree({'w': np.ones((2, 8))}, {'w': s})
    >>> out['w'].sharding.spec, out['w'].addressable_shards[0].data.shape
    (P(None, 'model'), (2, 2))
  """
  values = unbox(host_tree)
  targets = unbox(shardings)
  flat, treedef = jax.tree_util.tree_flatten_with_path(values)
  flat_targets = (
    treedef.flatten_up_to(targets) if not _is_target(targets) else [targets] * len(flat)
  )
  problems: list[ShardingProblem] = []
  out = []
  for (path, value), target in zip(flat, flat_targets):
    if target is None:
      out.append(value)
      continue
    sharding = target if isinstance(target, Sharding) else target.sharding
    shape = tuple(np.shape(value))
    where = path_str(path) or '<value>'
    expected = getattr(target, 'shape', None)
    spec = getattr(sharding, 'spec', None)
    mesh = getattr(sharding, 'mesh', None)
    if expected is not None and tuple(expected) != shape:
      problems.append(
        ShardingProblem(
          where,
          shape,
          None,
          spec,
          f'expected shape {tuple(expected)}, got {shape}',
          'load the value the target describes, or fix the target',
        )
      )
      continue
    if spec is not None and mesh is not None:
      issues = check_spec(shape, tuple(spec), mesh)
      if issues:
        problems += [
          ShardingProblem(where, shape, None, spec, r, h, d) for r, h, d in issues
        ]
        continue
    out.append(_transfer(value, shape, sharding, getattr(target, 'dtype', None)))
  if problems:
    raise ShardingError(problems)
  return replace_boxed(host_tree, jax.tree_util.tree_unflatten(treedef, out))


def _transfer(
  value: Any, shape: tuple[int, ...], sharding: Sharding, dtype: Any
) -> jax.Array:
  # Called once per addressable device with that device's slice index; a
  # target that names a dtype (an abstract array) gets the value in it.
  return jax.make_array_from_callback(
    shape, sharding, lambda index: np.asarray(value[index], dtype=dtype)
  )


def gather_tree(tree: PyTree) -> PyTree:
  """Sharded arrays -> full numpy arrays, on every process.

  Arrays that one process cannot see whole are gathered across processes
  (``multihost_utils.process_allgather``); the others are read directly.
  Non-array leaves pass through; boxes are kept.

  Example:
    >>> import jax, numpy as np, flax_shardmeta as fsm
    >>> mesh = jax.make_mesh((2, 4), ('data', 'model'))
    >>> x = fsm.shard_tree(np.arange(8.), jax.NamedSharding(mesh, jax.P('model')))
    >>> fsm.gather_tree({'x': x})['x']
    array([0., 1., 2., 3., 4., 5., 6., 7.], dtype=float32)
  """

  def one(x: Any) -> Any:
    if not isinstance(x, jax.Array):
      return x
    if x.is_fully_addressable:
      return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  return jax.tree_util.tree_map(one, tree)
