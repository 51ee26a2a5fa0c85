"""A saved checkpoint's layout, read from orbax's own metadata.

Nothing of the arrays is read: orbax's metadata gives each leaf's shape,
dtype, the mesh and ``PartitionSpec`` it was saved with, and the shape of the
chunks it was written in. The saved mesh becomes an ``AbstractMesh`` of the
saved axis sizes and names, so its devices need not exist here.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from flax_shardmeta._errors import FlaxShardmetaError
from flax_shardmeta._paths import nest
from flax_shardmeta._typing import PyTree

Chunks = dict[str, tuple[int, ...]]


def read_checkpoint(path: str | os.PathLike[str]) -> tuple[PyTree, Chunks]:
  """The saved layout of the orbax checkpoint at ``path``, and its chunk shapes.

  Returns a tree of ``jax.ShapeDtypeStruct`` carrying the saved
  ``NamedSharding`` (None for a leaf saved without one: unsharded), nested as
  saved, and per leaf path the chunk shape orbax wrote it in, where recorded.
  Raises ``FlaxShardmetaError`` naming ``path`` if it is not a checkpoint.

  Example:
    >>> read_checkpoint('/no/such/dir')
    Traceback (most recent call last):
    ...
    flax_shardmeta._errors.FlaxShardmetaError: /no/such/dir is not a directory...
  """
  where = os.fspath(path)
  if not os.path.isdir(where):
    raise FlaxShardmetaError(
      f'{where} is not a directory: pass the directory of an orbax checkpoint '
      '(the one holding its _METADATA file)'
    )
  flat = _metadata_leaves(where)
  structs: list[tuple[str, Any]] = []
  chunks: Chunks = {}
  for leaf_path, meta in flat:
    shape = getattr(meta, 'shape', None)
    dtype = getattr(meta, 'dtype', None)
    if shape is None or dtype is None:
      continue  # strings and other non-array leaves are not planned
    shape = tuple(int(n) for n in shape)
    sharding = _sharding(getattr(meta, 'sharding', None))
    structs.append((leaf_path, jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)))
    chunk = _chunk(getattr(meta, 'storage', None), len(shape))
    if chunk is not None:
      chunks[leaf_path] = chunk
  return nest(structs), chunks


def _metadata_leaves(where: str) -> list[tuple[str, Any]]:
  """(path, orbax leaf metadata) of every leaf of the checkpoint at ``where``."""
  import orbax.checkpoint as ocp

  try:
    meta = ocp.StandardCheckpointer().metadata(where)
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise FlaxShardmetaError(
      f'{where}: orbax cannot read its metadata ({e}); pass the directory of '
      'an orbax checkpoint (the one holding its _METADATA file)'
    ) from e
  # Newer orbax wraps the tree in step metadata, older returns it directly.
  item = getattr(meta, 'item_metadata', meta)
  tree = getattr(item, 'tree', item)
  if not tree:
    raise FlaxShardmetaError(
      f'{where} holds no orbax checkpoint metadata: pass the directory of an '
      'orbax checkpoint (the one holding its _METADATA file), e.g. a step '
      "directory's item folder"
    )
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  paths = [tuple(_key(k) for k in keys) for keys, _ in flat]
  children: dict[tuple[str, ...], int] = {}
  for p in paths:
    children[p[:-1]] = children.get(p[:-1], 0) + 1
  # A box (flax's Partitioned, fsm's) is saved as a node with one 'value'
  # field; plans do not count boxes as a path level, so neither is it here.
  return [
    ('/'.join(p[:-1] if p[-1:] == ('value',) and children[p[:-1]] == 1 else p), leaf)
    for p, (_, leaf) in zip(paths, flat)
  ]


def _key(entry: Any) -> str:
  for attr in ('key', 'name', 'idx'):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def _sharding(meta: Any) -> NamedSharding | None:
  """The saved ``NamedSharding`` on an abstract mesh (None: not a named one)."""
  names = getattr(meta, 'axis_names', None)
  sizes = getattr(meta, 'shape', None)
  spec = getattr(meta, 'partition_spec', None)
  if names is None or sizes is None or spec is None:
    return None
  sizes = tuple(int(n) for n in np.asarray(sizes).reshape(-1))
  names = tuple(names)
  types = getattr(meta, 'axis_types', None) or (AxisType.Auto,) * len(names)
  mesh = AbstractMesh(sizes, names, axis_types=tuple(_axis_type(t) for t in types))
  return NamedSharding(mesh, PartitionSpec(*(_entry(e) for e in spec)))


def _axis_type(value: Any) -> AxisType:
  if isinstance(value, AxisType):
    return value
  # Serialized as 'AxisType.Explicit' or 'Explicit'.
  return AxisType[str(value).rsplit('.', 1)[-1]]


def _entry(entry: Any) -> Any:
  """A spec entry as jax takes it (orbax may store a tuple of axes as a list)."""
  return tuple(entry) if isinstance(entry, list) else entry


def _chunk(storage: Any, ndim: int) -> tuple[int, ...] | None:
  """The recorded storage chunk (else write) shape, one entry per dimension.

  The storage chunk is what a read fetches whole; it may cut a written shard
  finer, never coarser.
  """
  for attr in ('chunk_shape', 'write_shape'):
    shape = getattr(storage, attr, None)
    if shape is not None and len(shape) == ndim:
      return tuple(int(n) for n in shape)
  return None
