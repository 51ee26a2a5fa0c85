"""Index arithmetic of a restore: which saved chunks each host reads.

A layout cuts every dimension into equal shards (the last one short or
empty), so its shard boxes form a grid. Each device of the target mesh holds
one cell of the target grid; a host needs the distinct cells of its devices
and reads, whole, every saved chunk (a cell of the saved grid) that meets
them. The work is per distinct cell set, not per device: hosts holding the
same cells share one answer, and leaves of the same shape and layouts share
one :class:`LeafCost`. Also here: what a saved leaf's layout is, and the
greedy grouping of leaves under a per-host read budget.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding

from flax_shardmeta._sharding import leaf_shape
from flax_shardmeta._specs import mesh_axes_of, spec_entries
from flax_shardmeta._typing import AnyMesh


@dataclasses.dataclass(frozen=True, slots=True)
class LeafCost:
  """Bytes of one leaf's restore, per host and per device.

  Attributes:
    needed: per host, bytes of the target shards its devices hold (each
      distinct shard once).
    read: per host, bytes of the saved chunks meeting those shards, whole.
    device: per device of the target mesh (in ``mesh.devices`` order), bytes
      of its target shard.
  """

  needed: np.ndarray
  read: np.ndarray
  device: np.ndarray


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


def chunk_shape(
  shape: tuple[int, ...], axes: tuple[tuple[str, ...], ...], sizes: dict[str, int]
) -> tuple[int, ...]:
  """The shard shape of a layout (ceil division, as jax pads uneven shards)."""
  return tuple(
    -(-n // math.prod(sizes.get(a, 1) for a in dim)) for n, dim in zip(shape, axes)
  )


@functools.lru_cache(maxsize=64)
def _coords(axis_sizes: tuple[int, ...]) -> np.ndarray:
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
    procs = np.array([d.process_index for d in devices.flat], dtype=np.int64)
    _, hosts = np.unique(procs, return_inverse=True)
    return hosts.astype(np.int64)
  return np.zeros(n, dtype=np.int64)


def _lengths(n: int, chunk: int, count: int) -> np.ndarray:
  """Lengths of the ``count`` shards of a dimension of ``n`` cut by ``chunk``."""
  starts = np.arange(count, dtype=np.int64) * chunk
  return np.clip(np.minimum(starts + chunk, n) - starts, 0, None)


def _cell_bytes(lengths: list[np.ndarray], itemsize: int) -> np.ndarray:
  """Bytes of every cell of a grid, as a flat (row-major) array."""
  out = np.array(itemsize, dtype=np.int64)
  for ln in lengths:
    out = np.multiply.outer(out, ln)
  return out.reshape(-1)


def leaf_cost(
  shape: tuple[int, ...],
  saved_chunk: tuple[int, ...],
  saved_itemsize: int,
  target_axes: tuple[tuple[str, ...], ...],
  target_itemsize: int,
  mesh: AnyMesh,
  hosts: np.ndarray,
  num_hosts: int,
) -> LeafCost:
  """Bytes needed and read per host, and held per device, for one leaf."""
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  index = {a: i for i, a in enumerate(mesh.axis_names)}
  coords = _coords(tuple(mesh.axis_sizes))
  t_chunk = chunk_shape(shape, target_axes, sizes)
  t_counts = tuple(math.prod(sizes[a] for a in dim) for dim in target_axes)
  # Each device's target cell per dimension: the mixed-radix index of its
  # coordinates over the dimension's mesh axes.
  ndev = coords.shape[0]
  code = np.zeros(ndev, dtype=np.int64)
  for dim, count in zip(target_axes, t_counts):
    idx = np.zeros(ndev, dtype=np.int64)
    for a in dim:
      idx = idx * sizes[a] + coords[:, index[a]]
    code = code * count + idx
  t_len = [_lengths(n, c, k) for n, c, k in zip(shape, t_chunk, t_counts)]
  t_bytes = _cell_bytes(t_len, target_itemsize)
  device = t_bytes[code] if shape else np.full(ndev, target_itemsize, np.int64)
  ncells = max(1, math.prod(t_counts))
  pairs = np.unique(hosts * ncells + code)
  pair_host, pair_cell = pairs // ncells, pairs % ncells
  needed = np.bincount(pair_host, weights=t_bytes[pair_cell], minlength=num_hosts)
  read = _read_per_host(
    shape, t_chunk, t_counts, saved_chunk, saved_itemsize, pair_host, pair_cell,
    num_hosts,
  )  # fmt: skip
  return LeafCost(needed.astype(np.int64), read, device.astype(np.int64))


def _read_per_host(
  shape: tuple[int, ...],
  t_chunk: tuple[int, ...],
  t_counts: tuple[int, ...],
  s_chunk: tuple[int, ...],
  itemsize: int,
  pair_host: np.ndarray,
  pair_cell: np.ndarray,
  num_hosts: int,
) -> np.ndarray:
  """Per host, bytes of the saved chunks meeting its target cells."""
  s_counts = tuple(-(-n // max(c, 1)) for n, c in zip(shape, s_chunk))
  s_bytes = _cell_bytes(
    [_lengths(n, c, k) for n, c, k in zip(shape, s_chunk, s_counts)], itemsize
  ).reshape(s_counts)
  out = np.zeros(num_hosts, dtype=np.int64)
  bounds = np.searchsorted(pair_host, np.arange(num_hosts + 1))
  memo: dict[bytes, int] = {}
  for h in range(num_hosts):
    cells = pair_cell[bounds[h] : bounds[h + 1]]
    key = cells.tobytes()
    got = memo.get(key)
    if got is None:
      got = memo[key] = _read_of_cells(
        cells, shape, t_chunk, t_counts, s_chunk, s_bytes
      )
    out[h] = got
  return out


def _read_of_cells(
  cells: np.ndarray,
  shape: tuple[int, ...],
  t_chunk: tuple[int, ...],
  t_counts: tuple[int, ...],
  s_chunk: tuple[int, ...],
  s_bytes: np.ndarray,
) -> int:
  """Bytes of the saved chunks meeting any of ``cells`` (flat target cells)."""
  if len(cells) == 0:
    return 0
  if not shape:
    return int(s_bytes)
  mask = np.zeros(s_bytes.shape, dtype=bool)
  per_dim = np.unravel_index(cells, t_counts)
  for i in range(len(cells)):
    box = []
    for d, n in enumerate(shape):
      lo = int(per_dim[d][i]) * t_chunk[d]
      hi = min(lo + t_chunk[d], n)
      if hi <= lo:  # an empty (padding) shard reads nothing
        break
      box.append(slice(lo // s_chunk[d], (hi - 1) // s_chunk[d] + 1))
    else:
      mask[tuple(box)] = True
  return int(s_bytes[mask].sum())


def schedule(
  costs: list[tuple[str, LeafCost]], budget: int | None, num_hosts: int
) -> list[list[tuple[str, LeafCost]]]:
  """Leaves grouped greedily in tree order, each group's reads per host within
  ``budget`` (a leaf over it alone gets a group of its own)."""
  if budget is None:
    return [costs] if costs else []
  groups: list[list[tuple[str, LeafCost]]] = []
  load = np.zeros(num_hosts, dtype=np.int64)
  for item in costs:
    if groups and bool(np.all(load + item[1].read <= budget)):
      groups[-1].append(item)
      load = load + item[1].read
    else:
      groups.append([item])
      load = item[1].read.copy()
  return groups


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
