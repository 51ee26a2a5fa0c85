"""A saved checkpoint's layout, read from orbax's own metadata.

Nothing of the arrays is read: orbax's metadata gives each leaf's shape,
dtype, the mesh and ``PartitionSpec`` it was saved with, and the shape of the
chunks it was written in. The saved mesh becomes an ``AbstractMesh`` of the
saved axis sizes and names, so its devices need not exist here.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from flax_shardmeta._errors import FlaxShardmetaError
from flax_shardmeta._paths import nest
from flax_shardmeta._restore import checksums as checksums_lib, damage
from flax_shardmeta._typing import PyTree

Chunks = dict[str, tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class SavedCheckpoint:
  """What a checkpoint's metadata says, nothing of its arrays read.

  Attributes:
    directory: the checkpoint's directory (a step's item folder, resolved).
    tree: ``jax.ShapeDtypeStruct`` leaves carrying the saved ``NamedSharding``
      (None for a leaf saved without one), nested as saved.
    chunks: per leaf path, the chunk shape orbax wrote it in, where recorded.
    stored: per leaf path, the bytes each chunk takes on disk (compressed), as
      an array over the chunk grid, where the storage says (OCDBT).
    keys: per leaf path, its keys in the saved tree (boxes' ``value``
      included), as orbax's restore arguments nest them.
    metadata: orbax's metadata tree, nested as saved.
    checksums: the content checksums ``fsm.save`` wrote beside it (None:
      none, so a restore cannot check the values it reads).
  """

  directory: str
  tree: PyTree
  chunks: Chunks
  stored: dict[str, np.ndarray]
  keys: dict[str, tuple[str, ...]]
  metadata: PyTree = None
  checksums: dict[str, Any] | None = None


def checkpoint_directory(path: str | os.PathLike[str], step: int | None = None) -> str:
  """The item folder of the checkpoint at ``path``.

  ``path`` is a checkpoint (it holds ``_METADATA``), a step folder of a
  ``CheckpointManager`` holding one item, or the manager's root: then the
  step ``step`` (default: the latest) is taken.

  Example:
    >>> checkpoint_directory('/no/such/dir')
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
  if os.path.exists(os.path.join(where, '_METADATA')):
    return where
  steps = sorted(int(n) for n in os.listdir(where) if n.isdigit())
  if steps:
    if step is not None and step not in steps:
      raise FlaxShardmetaError(
        f'{where} has no step {step}: its steps are {steps}; pass one of them'
      )
    where = os.path.join(where, str(steps[-1] if step is None else step))
  items = [
    n for n in sorted(os.listdir(where))
    if os.path.exists(os.path.join(where, n, '_METADATA'))
  ]  # fmt: skip
  if len(items) == 1:
    return os.path.join(where, items[0])
  raise FlaxShardmetaError(
    f'{where} holds no orbax checkpoint'
    + (f' but items {items}: pass the one to restore' if items else '')
    + ' (pass the directory holding its _METADATA file, a step folder of a '
    'CheckpointManager, or its root)'
  )


def read_checkpoint(
  path: str | os.PathLike[str], step: int | None = None
) -> SavedCheckpoint:
  """The saved layout of the orbax checkpoint at ``path`` (see
  :func:`checkpoint_directory` for what ``path`` and ``step`` may name).

  Raises ``FlaxShardmetaError`` naming ``path`` if it is not a checkpoint.

  Example:
    >>> read_checkpoint('/no/such/dir')
    Traceback (most recent call last):
    ...
    flax_shardmeta._errors.FlaxShardmetaError: /no/such/dir is not a directory...
  """
  where = checkpoint_directory(path, step)
  structs: list[tuple[str, Any]] = []
  chunks: Chunks = {}
  keys: dict[str, tuple[str, ...]] = {}
  metadata = _metadata_tree(where)
  for leaf_path, leaf_keys, meta in _metadata_leaves(metadata):
    shape = getattr(meta, 'shape', None)
    dtype = getattr(meta, 'dtype', None)
    if shape is None or dtype is None:
      continue  # strings and other non-array leaves are not planned
    shape = tuple(int(n) for n in shape)
    sharding = _sharding(getattr(meta, 'sharding', None))
    structs.append((leaf_path, jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)))
    keys[leaf_path] = leaf_keys
    chunk = _chunk(getattr(meta, 'storage', None), len(shape))
    if chunk is not None:
      chunks[leaf_path] = chunk
  stored = _stored_bytes(where, keys, dict(structs), chunks)
  sums = checksums_lib.read(where)
  return SavedCheckpoint(where, nest(structs), chunks, stored, keys, metadata, sums)


def _metadata_tree(where: str) -> PyTree:
  """orbax's metadata tree of the checkpoint at ``where``."""
  import orbax.checkpoint as ocp
  from etils import epath

  # orbax logs a corrupt step metadata file and goes on; it is named here.
  damage.check_metadata_files(where)
  try:
    # The handler itself: orbax's checkpointer logs its errors and returns none.
    meta = ocp.StandardCheckpointHandler().metadata(epath.Path(where))
  except FileNotFoundError as e:
    raise FlaxShardmetaError(
      f'{where}: orbax cannot read its metadata ({e}); pass the directory of '
      'an orbax checkpoint (the one holding its _METADATA file)'
    ) from e
  except Exception as e:  # noqa: BLE001 - orbax and TensorStore raise bare ones
    raise damage.metadata_error(where, e) from e
  # Newer orbax wraps the tree in step metadata, older returns it directly.
  item = getattr(meta, 'item_metadata', meta)
  tree = getattr(item, 'tree', item)
  if not tree:
    raise FlaxShardmetaError(
      f'{where} holds no orbax checkpoint metadata: pass the directory of an '
      'orbax checkpoint (the one holding its _METADATA file), e.g. a step '
      "directory's item folder"
    )
  return tree


def saved_keys(tree: PyTree) -> list[tuple[tuple[str, ...], Any]]:
  """(keys as text, leaf) of every leaf of a tree nested as saved."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(tuple(_key(k) for k in keys), leaf) for keys, leaf in flat]


def _metadata_leaves(tree: PyTree) -> list[tuple[str, tuple[str, ...], Any]]:
  """(path, saved keys, orbax leaf metadata) of every leaf of the metadata."""
  flat = saved_keys(tree)
  paths = [p for p, _ in flat]
  children: dict[tuple[str, ...], int] = {}
  for p in paths:
    children[p[:-1]] = children.get(p[:-1], 0) + 1
  # A box (flax's Partitioned, fsm's) is saved as a node with one 'value'
  # field; plans do not count boxes as a path level, so neither is it here.
  return [
    ('/'.join(p[:-1] if p[-1:] == ('value',) and children[p[:-1]] == 1 else p), p, leaf)
    for p, (_, leaf) in zip(paths, flat)
  ]


def _stored_bytes(
  where: str,
  keys: dict[str, tuple[str, ...]],
  structs: dict[str, Any],
  chunks: Chunks,
) -> dict[str, np.ndarray]:
  """Per leaf path, the on-disk bytes of each chunk, from the OCDBT b-tree.

  Compressed chunks make a read fetch fewer bytes than it decodes; tensorstore
  lists each stored value's length without reading it. Empty where the
  checkpoint is not OCDBT (then reads are planned at decoded size).
  """
  try:
    import tensorstore as ts

    store = ts.KvStore.open(f'file://{os.path.abspath(where)}/').result()
    lengths = dict(_ocdbt_values(ts, store))
  except Exception:  # noqa: BLE001 - not OCDBT, or a format this reader predates
    return {}
  by_name = {'.'.join(k): path for path, k in keys.items()}
  grids = {
    path: np.zeros(
      tuple(-(-n // max(c, 1)) for n, c in zip(structs[path].shape, chunks[path])),
      dtype=np.int64,
    )
    for path in keys if path in chunks
  }  # fmt: skip
  for key, length in lengths.items():
    name, _, chunk = key.rpartition('/')
    path = by_name.get(name)
    index = tuple(int(i) for i in re.findall(r'\d+', chunk))
    if path in grids and len(index) == grids[path].ndim and chunk[:1] != '.':
      grids[path][index] = length
  # A leaf with no listed chunk (a b-tree this reader cannot walk) is planned
  # at decoded size rather than as free.
  return {path: g for path, g in grids.items() if g.any()}


def _ocdbt_values(ts: Any, store: Any, node: str | None = None) -> Any:
  """(key, stored length) of every value in the OCDBT b-tree under ``node``."""
  dump = ts.ocdbt.dump(store, node).result()
  if node is None:
    versions = dump.get('versions') or []
    if versions:
      yield from _ocdbt_values(ts, store, versions[-1]['root']['location'])
    return
  for entry in dump.get('entries', ()):
    key = entry.get('key', b'')
    key = key.decode() if isinstance(key, bytes) else str(key)
    if 'indirect_value' in entry:
      yield key, int(str(entry['indirect_value']).rsplit(':', 1)[-1])
    elif 'inline_value' in entry:
      yield key, len(entry['inline_value'])
    for child in ('node', 'location'):
      if isinstance(entry.get(child), str):
        yield from _ocdbt_values(ts, store, entry[child])


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
