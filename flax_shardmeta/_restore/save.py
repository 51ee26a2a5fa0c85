"""``fsm.save``: an orbax checkpoint with content checksums beside it.

orbax writes the arrays (its ``PyTreeCheckpointHandler``, as ``fsm.restore``
reads them); fsm adds a small JSON file of per-leaf checksums that hold on
any mesh (``checksums.py``), so a restore onto another layout still checks
every value it reads.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import jax

from flax_shardmeta._errors import FlaxShardmetaError
from flax_shardmeta._restore import checksums as checksums_lib
from flax_shardmeta._restore.checkpoint import saved_keys
from flax_shardmeta._typing import PyTree


def save(path: str | os.PathLike[str], tree: PyTree, *, force: bool = False) -> str:
  """Saves ``tree`` as an orbax checkpoint at ``path``, with checksums.

  The arrays are written by orbax exactly as ``ocp.StandardCheckpointer``
  would (plain orbax restores them too). Beside orbax's metadata, fsm writes
  ``_FSM_CHECKSUMS.json``: per leaf, its shape, dtype and a checksum of its
  values that does not depend on how the array is split, so
  :func:`flax_shardmeta.restore` checks every leaf it reads, onto any mesh,
  and raises ``fsm.CheckpointDamagedError`` naming a leaf whose data differ
  from what was saved. Leaves restored with a cast are not checked (the
  checksum is of the saved bits), nor leaves in host memory
  (``pinned_host``); the restore plan lists them.

  Across processes every process calls it (as with orbax): each hashes the
  shards it holds, the sums are combined, and process 0 writes the file.
  For a ``CheckpointManager``-style layout pass a step's item folder,
  ``root/<step>/default``: ``fsm.restore(root, ...)`` finds the latest step.

  Args:
    path: the checkpoint's directory (it must not exist, unless ``force``).
    tree: what ``fsm.restore`` restores: arrays, Linen boxes (as
      ``model.init`` returns them, with optimizer state), an NNX module (its
      ``nnx.state`` is saved) or an ``nnx.State``.
    force: overwrite an existing checkpoint at ``path``.

  Raises:
    FlaxShardmetaError: ``path`` exists (without ``force``), or a leaf is
      abstract (a ``jax.ShapeDtypeStruct``).

  Returns:
    The checkpoint's directory, absolute.

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm, tempfile, os
    >>> from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
    >>> saved = jax.make_mesh((8,), ('data',), axis_types=(AxisType.Auto,))
    >>> w = jax.device_put(jnp.arange(64.0).reshape(8, 8),
    ...                    NamedSharding(saved, P('data')))
    >>> path = fsm.save(os.path.join(tempfile.mkdtemp(), 'ckpt'), {'w': w})
    >>> sorted(n for n in os.listdir(path) if n.startswith('_FSM'))
    ['_FSM_CHECKSUMS.json']
    >>> mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(AxisType.Auto,) * 2)
    >>> target = {'w': jax.ShapeDtypeStruct(
    ...     (8, 8), jnp.float32, sharding=NamedSharding(mesh, P(None, 'model')))}
    >>> print(fsm.restore_plan(path, target).content_check)
    content: 1 array checked against fsm.save's checksums
    >>> bool((fsm.restore(path, target)['w'] == w).all())
    True
  """
  import orbax.checkpoint as ocp

  where = os.path.abspath(os.fspath(path))
  if os.path.exists(where) and not force:
    raise FlaxShardmetaError(
      f'{where} already exists: pass a new directory for the checkpoint, or '
      'force=True to replace it'
    )
  tree = _savable(tree)
  abstract = [
    '/'.join(keys) for keys, leaf in saved_keys(tree)
    if isinstance(leaf, jax.ShapeDtypeStruct)
  ]  # fmt: skip
  if abstract:
    n = len(abstract)
    head = '1 leaf of the tree is' if n == 1 else f'{n} leaves of the tree are'
    raise FlaxShardmetaError(
      f'{head} abstract (jax.ShapeDtypeStruct, no values), e.g. {abstract[0]}: '
      'fsm.save writes arrays; pass the initialised or trained state, not its '
      'abstract form'
    )
  leaves = {
    '/'.join(keys): leaf
    for keys, leaf in saved_keys(tree)
    if isinstance(leaf, jax.Array)
    and checksums_lib.hashable(leaf.dtype)
    and checksums_lib.in_device_memory(leaf.sharding)
  }
  # Hashed before orbax writes: the checksums are of the values meant.
  sums = checksums_lib.checksums(leaves)
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
    checkpointer.save(where, args=ocp.args.PyTreeSave(tree), force=force)
  if jax.process_index() == 0:
    checksums_lib.write(where, leaves, sums)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    # No process returns (and perhaps restores) before the file is there.
    multihost_utils.sync_global_devices(f'fsm.save {where}')
  return where


def _savable(tree: Any) -> Any:
  """An NNX module as its state (orbax saves pytrees); anything else as is."""
  nnx = sys.modules.get('flax.nnx')  # only a program that imported it has modules
  if nnx is not None and isinstance(tree, nnx.Module):
    return nnx.state(tree)
  return tree
