"""What each host's reads of one leaf fetch, stage and keep.

orbax restores a leaf with one read per distinct target shard a process
holds. A read reserves, against orbax's in-flight byte limit, its
*footprint*: the saved-chunk-aligned box around the shard (orbax's own
estimate). It then fetches every saved chunk meeting the shard whole (its
stored, possibly compressed, bytes), decodes them one by one unless the
shard is exactly one chunk, copies the shard out and puts it on its devices.
So a read stages its output shard, the stored chunks and one decoded chunk.
Reads running one at a time fetch each its own chunks, so neighbouring
shards meeting one chunk each fetch it; concurrent reads may share a fetch,
so :attr:`LeafCost.read` is what the host reads at most, and exactly that
when its reads run one at a time.

The work is vectorised over the target grid's cells, once per leaf shape and
layout pair; hosts are then sums over the cells their devices hold.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from flax_shardmeta._restore.chunks import cell_bytes, chunk_shape, coords, lengths
from flax_shardmeta._typing import AnyMesh


@dataclasses.dataclass(frozen=True, slots=True)
class LeafCost:
  """Bytes of one leaf's restore, per host (process) and per device.

  Attributes:
    needed: per host, bytes of the target shards its devices hold (each
      distinct shard once), in the target dtype.
    read: per host, stored bytes its reads fetch, each read its chunks whole.
    reads: per host, how many reads (distinct target shards) it makes.
    footprint: per host, the largest footprint orbax reserves for one read.
    staged: per host, the most one read holds in host memory.
    staged_total: per host, the sum of what its reads hold.
    decoded: per host, decoded bytes of the chunks its reads fetch.
    shards: per host, bytes of its reads' shards as saved (before any cast):
      ``decoded - shards`` is what it over-reads.
    device: per device of the target mesh (in ``mesh.devices`` order), bytes
      of its target shard.
  """

  needed: np.ndarray
  read: np.ndarray
  reads: np.ndarray
  footprint: np.ndarray
  staged: np.ndarray
  staged_total: np.ndarray
  decoded: np.ndarray
  shards: np.ndarray
  device: np.ndarray

  @property
  def ratio(self) -> float:
    """The most a read stages per byte of its footprint (0 without reads)."""
    with np.errstate(divide='ignore', invalid='ignore'):
      r = np.where(self.footprint > 0, self.staged / self.footprint, 0.0)
    return float(r.max(initial=0.0))

  @property
  def min_budget(self) -> int:
    """The smallest host budget under which this leaf's reads can run."""
    return math.ceil(float(self.footprint.max(initial=0)) * self.ratio)


def leaf_cost(
  shape: tuple[int, ...],
  saved_chunk: tuple[int, ...],
  stored: np.ndarray | None,
  itemsizes: tuple[int, int],
  target_axes: tuple[tuple[str, ...], ...],
  mesh: AnyMesh,
  hosts: np.ndarray,
  num_hosts: int,
) -> LeafCost:
  """One leaf's costs; ``stored`` is its chunks' on-disk bytes (None: as decoded).

  ``itemsizes`` is (saved, target) bytes per element.
  """
  saved_size, target_size = itemsizes
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  index = {a: i for i, a in enumerate(mesh.axis_names)}
  grid = coords(tuple(mesh.axis_sizes))
  t_chunk = chunk_shape(shape, target_axes, sizes)
  t_counts = tuple(math.prod(sizes[a] for a in dim) for dim in target_axes)
  # Each device's target cell: the mixed-radix index of its coordinates over
  # each dimension's mesh axes.
  ndev = grid.shape[0]
  code = np.zeros(ndev, dtype=np.int64)
  for dim, count in zip(target_axes, t_counts):
    idx = np.zeros(ndev, dtype=np.int64)
    for a in dim:
      idx = idx * sizes[a] + grid[:, index[a]]
    code = code * count + idx
  cells = _cells(shape, t_chunk, t_counts, saved_chunk, stored, saved_size)
  t_len = [lengths(n, c, k) for n, c, k in zip(shape, t_chunk, t_counts)]
  t_bytes = cell_bytes(t_len, target_size)
  device = t_bytes[code] if shape else np.full(ndev, target_size, np.int64)
  ncells = max(1, math.prod(t_counts))
  pairs = np.unique(hosts * ncells + code)
  host, cell = pairs // ncells, pairs % ncells

  def per_host(values: np.ndarray) -> np.ndarray:
    return np.bincount(host, weights=values[cell], minlength=num_hosts).astype(np.int64)

  def most(values: np.ndarray) -> np.ndarray:
    out = np.zeros(num_hosts, dtype=np.int64)
    np.maximum.at(out, host, values[cell])
    return out

  fetched, footprint, staged, decoded, out = cells
  return LeafCost(
    needed=per_host(t_bytes),
    read=per_host(fetched),
    reads=per_host((footprint > 0).astype(np.int64)),
    footprint=most(footprint),
    staged=most(staged),
    staged_total=per_host(staged),
    decoded=per_host(decoded),
    shards=per_host(out),
    device=device.astype(np.int64),
  )


def _cells(
  shape: tuple[int, ...],
  t_chunk: tuple[int, ...],
  t_counts: tuple[int, ...],
  s_chunk: tuple[int, ...],
  stored: np.ndarray | None,
  itemsize: int,
) -> tuple[np.ndarray, ...]:
  """Per target cell (flat, row-major): stored bytes fetched, orbax's
  footprint, bytes staged by its read, decoded bytes of the chunks fetched and
  the shard's own bytes (all 0 for an empty padding cell)."""
  if not shape:
    one = np.array([itemsize], dtype=np.int64)
    got = one if stored is None else np.array([int(stored.sum())], np.int64)
    return got, one, got + one, one, one
  s_counts = tuple(-(-n // max(c, 1)) for n, c in zip(shape, s_chunk))
  s_len = [lengths(n, c, k) for n, c, k in zip(shape, s_chunk, s_counts)]
  chunk_bytes = cell_bytes(s_len, itemsize).reshape(s_counts)
  if stored is None or stored.shape != s_counts:
    stored = chunk_bytes
  # Per dimension and target cell: its element range and the saved chunks
  # [first, stop) meeting it.
  lo = [np.arange(k, dtype=np.int64) * c for k, c in zip(t_counts, t_chunk)]
  hi = [np.minimum(a + c, n) for a, c, n in zip(lo, t_chunk, shape)]
  empty = [h <= a for a, h in zip(lo, hi)]
  first = [a // c for a, c in zip(lo, s_chunk)]
  stop = [np.where(e, f, -(-h // c)) for e, f, h, c in zip(empty, first, hi, s_chunk)]
  outer = _outer_product
  span = [b - a for a, b in zip(first, stop)]
  footprint = outer([s * c for s, c in zip(span, s_chunk)], itemsize)
  out = outer([np.where(e, 0, h - a) for e, a, h in zip(empty, lo, hi)], itemsize)
  fetched = _box_sums(stored, first, stop)
  decoded = _box_sums(chunk_bytes, first, stop)
  # One decoded chunk in flight, unless the shard is one whole chunk, which
  # decodes straight into it.
  whole = np.ones((1,) * len(shape), dtype=bool)
  for d, (a, h, f, c, n) in enumerate(zip(lo, hi, first, s_chunk, shape)):
    one = (span[d] == 1) & (a == f * c) & (h == np.minimum((f + 1) * c, n))
    whole = whole & one.reshape([-1 if i == d else 1 for i in range(len(shape))])
  one_chunk = math.prod(min(c, n) for c, n in zip(s_chunk, shape)) * itemsize
  staged = out + fetched + np.where(whole, 0, one_chunk)
  staged = np.where(footprint > 0, staged, 0)
  return tuple(a.reshape(-1) for a in (fetched, footprint, staged, decoded, out))


def _outer_product(parts: list[np.ndarray], scale: int) -> np.ndarray:
  out = np.array(scale, dtype=np.int64)
  for p in parts:
    out = np.multiply.outer(out, p)
  return out


def _box_sums(
  grid: np.ndarray, first: list[np.ndarray], stop: list[np.ndarray]
) -> np.ndarray:
  """Per cell of the outer grid of boxes, the sum of ``grid`` over its box.

  A summed-area table and inclusion-exclusion over the box's corners: the
  work is per cell, whatever the number of chunks a box covers.
  """
  table = grid.astype(np.int64)
  for d in range(table.ndim):
    table = np.cumsum(table, axis=d)
  table = np.pad(table, [(1, 0)] * table.ndim)
  total = 0
  for corner in itertools.product((0, 1), repeat=table.ndim):
    picks = [stop[d] if c else first[d] for d, c in enumerate(corner)]
    sign = (-1) ** (table.ndim - sum(corner))
    total = total + sign * table[np.ix_(*picks)]
  return np.asarray(total, dtype=np.int64)
