"""Index arithmetic of a restore: layouts as grids of shards.

A layout cuts every dimension into equal shards (the last one short or
empty), so its shard boxes form a grid. Each device of the target mesh holds
one cell of the target grid; the saved chunks are the cells of another. Here:
the grids, which host each device is on, what a saved leaf's layout is, and
which Explicit axes a restore loses.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding

from flax_shardmeta._programs.hosts import host_of
from flax_shardmeta._sharding import leaf_shape
from flax_shardmeta._specs import mesh_axes_of, spec_entries
from flax_shardmeta._typing import AnyMesh


def dim_axes(spec: Any, ndim: int) -> tuple[tuple[str, ...], ...]:
  """Per dimension, the mesh axes it is sharded over (major first).

  Example:
    >>> from jax.sharding import PartitionSpec as P
    >>> dim_axes(P(('data', 'model')), 2)
    (('data', 'model'), ())
  """
  entries = spec_entries(spec) if spec is not None else ()
  return tuple(
    mesh_axes_of(entries[d]) if d < len(entries) else () for d in range(ndim)
  )


def resized_axes(
  old_sizes: dict[str, int] | None, mesh: Any, axes: tuple[tuple[str, ...], ...]
) -> bool:
  """Whether a mesh axis a leaf is sharded over (``axes``, per dimension) has
  another size than when it was saved: a new mesh moves only such leaves, and
  a replicated one (a step count, ``P()`` to ``P()``) stays as it was.

  Example:
    >>> import jax
    >>> mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
    >>> saved = {'data': 8}
    >>> resized_axes(saved, mesh, (('data',),)), resized_axes(saved, mesh, ((),))
    (True, False)
  """
  if old_sizes is None:
    return False
  used = {a for dim in axes for a in dim}
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  return any(old_sizes.get(a) != sizes[a] for a in used if a in sizes)


def chunk_shape(
  shape: tuple[int, ...], axes: tuple[tuple[str, ...], ...], sizes: dict[str, int]
) -> tuple[int, ...]:
  """The shard shape of a layout (ceil division, as jax pads uneven shards)."""
  return tuple(
    -(-n // math.prod(sizes.get(a, 1) for a in dim)) for n, dim in zip(shape, axes)
  )


@functools.lru_cache(maxsize=64)
def coords(axis_sizes: tuple[int, ...]) -> np.ndarray:
  """Each device's mesh coordinates, shape ``(devices, axes)``, row-major."""
  grid = np.indices(axis_sizes, dtype=np.int64)
  return grid.reshape(len(axis_sizes), -1).T.copy()


def host_of_devices(mesh: AnyMesh, devices_per_host: int | None) -> np.ndarray:
  """Per device (in ``mesh.devices`` order), its host number from 0.

  A concrete mesh groups by ``process_index`` unless ``devices_per_host`` is
  given; an abstract mesh has no processes, so it is one host by default.
  """
  n = math.prod(mesh.axis_sizes)
  if devices_per_host is not None:
    return np.arange(n, dtype=np.int64) // max(1, devices_per_host)
  # An AbstractMesh raises (not AttributeError) when asked for its devices.
  devices = mesh.devices if isinstance(mesh, jax.sharding.Mesh) else None
  if isinstance(devices, np.ndarray):
    procs = np.array([host_of(d) for d in devices.flat], dtype=np.int64)
    _, hosts = np.unique(procs, return_inverse=True)
    return hosts.astype(np.int64)
  return np.zeros(n, dtype=np.int64)


def lengths(n: int, chunk: int, count: int) -> np.ndarray:
  """Lengths of the ``count`` shards of a dimension of ``n`` cut by ``chunk``."""
  starts = np.arange(count, dtype=np.int64) * chunk
  return np.clip(np.minimum(starts + chunk, n) - starts, 0, None)


def cell_bytes(lengths: list[np.ndarray], itemsize: int) -> np.ndarray:
  """Bytes of every cell of a grid, as a flat (row-major) array."""
  out = np.array(itemsize, dtype=np.int64)
  for ln in lengths:
    out = np.multiply.outer(out, ln)
  return out.reshape(-1)


def saved_layout(value: Any) -> tuple[Any, tuple[int, ...], dict[str, int] | None]:
  """A saved value's spec, chunk shape and mesh sizes (None: unsharded)."""
  shape = leaf_shape(value) or ()
  sharding = getattr(value, 'sharding', None)
  if isinstance(sharding, NamedSharding):
    sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes))
    return (
      sharding.spec,
      chunk_shape(shape, dim_axes(sharding.spec, len(shape)), sizes),
      sizes,
    )
  if sharding is not None and hasattr(sharding, 'shard_shape'):
    return None, tuple(sharding.shard_shape(shape)), None
  return None, shape, None


def explicit_axes(sharding: Any) -> frozenset[str]:
  """The Explicit axes of a sharding's mesh (none without a sharding)."""
  mesh = getattr(sharding, 'mesh', None)
  if mesh is None:
    return frozenset()
  return frozenset(
    n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit
  )


def lost_explicit_axes(saved: Any, target: Any) -> frozenset[str]:
  """The saved sharding's Explicit axes a restore onto ``target`` loses: those
  the target's mesh has under the same name but not Explicit, or all of them
  when it has no Explicit axis at all (other names, all Auto)."""
  was, kept = explicit_axes(saved), explicit_axes(target)
  names = set(getattr(getattr(target, 'mesh', None), 'axis_names', ()))
  same_name = frozenset(a for a in was if a in names and a not in kept)
  return same_name or (was if not kept else frozenset())
