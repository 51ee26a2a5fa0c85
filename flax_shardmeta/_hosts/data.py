"""Per-host data: which rows of the global batch each process loads.

With one process per host, each process reads only the batch rows its own
devices hold and the rows are assembled into global arrays without any host
ever holding the whole batch. Processes whose devices hold the same rows (a
model axis that spans hosts) read the same rows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_shardmeta._annotation import path_str
from flax_shardmeta._errors import BatchLayoutError, ShardingError, ShardingProblem
from flax_shardmeta._rules import get_logical_axis_rules, logical_to_mesh_axes
from flax_shardmeta._specs import mesh_axes_of
from flax_shardmeta._typing import LogicalRules, PyTree
from flax_shardmeta._validate import check_spec


@dataclasses.dataclass(frozen=True)
class DataLayout:
  """This process's part of the global batch.

  Attributes:
    batch_size: rows this process loads per step (global batch / num_shards).
    shard_id: which slice of the data this process reads, in ``[0, num_shards)``;
      e.g. ``dataset.shard(num_shards, shard_id)``.
    num_shards: how many distinct slices the batch is split into across hosts.
    is_first_host_in_replica_set: True for the lowest-numbered process among
      those reading the same slice (e.g. the one that writes evaluation output).

  Example:
    >>> import flax_shardmeta as fsm
    >>> layout = fsm.DataLayout(batch_size=8, shard_id=1, num_shards=2,
    ...                         is_first_host_in_replica_set=True)
    >>> rows = list(range(16))  # the global batch, as a loader would split it
    >>> rows[layout.shard_id * layout.batch_size:][:layout.batch_size]
    [8, 9, 10, 11, 12, 13, 14, 15]
  """

  batch_size: int
  shard_id: int
  num_shards: int
  is_first_host_in_replica_set: bool


def data_layout(
  mesh: Mesh,
  global_batch_size: int,
  batch_axes: str | Sequence[str] | None = None,
  rules: LogicalRules | None = None,
) -> DataLayout:
  """How this process takes part in a global batch sharded over ``batch_axes``.

  Args:
    mesh: the device mesh (over all processes).
    global_batch_size: rows of the whole batch, over all processes.
    batch_axes: the mesh axes the batch dimension is sharded over. By default
      what the logical name ``batch`` resolves to (``rules`` or the context
      rules), else ``('data',)``.
    rules: logical axis rules for resolving ``batch``.

  Returns:
    This process's :class:`DataLayout`.

  Raises:
    BatchLayoutError: the batch does not divide over the batch axes, or the
      processes' devices hold rows in a way a per-process loader cannot feed.

  Example:
    >>> import jax, flax_shardmeta as fsm
    >>> mesh = jax.make_mesh((2, 4), ('data', 'model'))
    >>> fsm.data_layout(mesh, 32)  # one process holds every row
    DataLayout(batch_size=32, shard_id=0, num_shards=1,
               is_first_host_in_replica_set=True)
  """
  axes = _batch_axes(mesh, batch_axes, rules)
  missing = [a for a in axes if a not in mesh.axis_names]
  if missing:
    raise BatchLayoutError(
      f'batch axes {axes} are not all in the mesh {dict(mesh.shape)} '
      f'(missing {missing}); pass batch_axes= or a rule for the logical name '
      "'batch'."
    )
  ways = math.prod(mesh.shape[a] for a in axes)
  if global_batch_size % ways:
    raise BatchLayoutError(
      f'a global batch of {global_batch_size} rows does not divide over the '
      f'batch axes {axes} ({ways} ways): each device would hold '
      f'{global_batch_size / ways:g} rows. Use a multiple of {ways}, e.g. '
      f'{ways * max(1, round(global_batch_size / ways))}.'
    )
  rows_of = _rows_per_process(mesh, axes)
  groups = sorted(set(rows_of.values()), key=min)
  flat = sorted(i for g in groups for i in g)
  if (
    flat != list(range(ways))
    or len({len(g) for g in groups}) != 1
    or any(list(g) != list(range(min(g), min(g) + len(g))) for g in groups)
  ):
    shown = {p: sorted(g) for p, g in sorted(rows_of.items())}
    raise BatchLayoutError(
      f'the batch shards over {axes} ({ways} ways) are spread over the '
      f'processes as {shown} (process -> batch shards); a per-process loader '
      'needs each process to hold one contiguous block of shards, of the same '
      'size for all. Put the batch axes first in the mesh or build it with '
      'fsm.make_mesh(..., dcn_axis_sizes=...).'
    )
  mine = rows_of[jax.process_index()]
  shard_id = groups.index(mine)
  first = min(p for p, g in rows_of.items() if g == mine)
  return DataLayout(
    batch_size=global_batch_size // len(groups),
    shard_id=shard_id,
    num_shards=len(groups),
    is_first_host_in_replica_set=jax.process_index() == first,
  )


def _batch_axes(
  mesh: Mesh, batch_axes: str | Sequence[str] | None, rules: LogicalRules | None
) -> tuple[str, ...]:
  if batch_axes is not None:
    return (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
  if rules is not None or get_logical_axis_rules():
    axes = mesh_axes_of(logical_to_mesh_axes(('batch',), rules)[0])
    if axes:
      return axes
  return ('data',)


def _rows_per_process(mesh: Mesh, axes: tuple[str, ...]) -> dict[int, frozenset[int]]:
  """Process -> the batch shards (linear index over ``axes``) its devices hold."""
  devices = np.asarray(mesh.devices)
  names = list(mesh.axis_names)
  out: dict[int, set[int]] = {}
  for coords in np.ndindex(devices.shape):
    index = 0
    for a in axes:
      index = index * mesh.shape[a] + coords[names.index(a)]
    out.setdefault(_process_of(devices[coords]), set()).add(index)
  return {p: frozenset(s) for p, s in out.items()}


def host_local_to_global(
  tree: PyTree,
  mesh: Mesh,
  names_or_specs: Any,
  rules: LogicalRules | None = None,
) -> PyTree:
  """Each process's local rows -> global arrays sharded over ``mesh``.

  Every process calls this with the rows :func:`data_layout` assigned to it;
  the result is one global array per leaf (on
  ``jax.make_array_from_process_local_data``).

  Args:
    tree: host-local arrays (numpy or jax), leading dimension = local rows.
    mesh: the device mesh.
    names_or_specs: a ``PartitionSpec`` (mesh axes) or a tuple of logical names
      resolved through ``rules``; one for all leaves or a tree of them with
      ``tree``'s structure.
    rules: logical axis rules (None: the context rules).

  Returns:
    ``tree`` with global ``jax.Array`` leaves.

  Example:
    >>> import jax, numpy as np, flax_shardmeta as fsm
    >>> mesh = jax.make_mesh((2, 4), ('data', 'model'))
    >>> x = fsm.host_local_to_global(np.ones((8, 3)), mesh, ('batch', None),
    ...                              [('batch', 'data')])
    >>> x.shape, x.sharding.spec
    ((8, 3), P('data', None))
  """
  specs = _spec_tree(tree, names_or_specs, rules)

  def one(path: Any, x: Any, spec: PartitionSpec) -> jax.Array:
    local = np.asarray(x)
    issues = check_spec(_global_shape(local.shape, spec, mesh), tuple(spec), mesh)
    if issues:
      raise ShardingError(
        [
          ShardingProblem(path_str(path), local.shape, None, spec, r, h, d)
          for r, h, d in issues
        ]
      )
    return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), local)

  return jax.tree_util.tree_map_with_path(one, tree, specs)


def _global_shape(
  local: tuple[int, ...], spec: PartitionSpec, mesh: Mesh
) -> tuple[int, ...]:
  """The global shape implied by local rows (for checking; jax infers it too)."""
  out = list(local)
  devices = np.asarray(mesh.devices)
  names = list(mesh.axis_names)
  for dim, entry in enumerate(tuple(spec)[: len(local)]):
    axes = [a for a in mesh_axes_of(entry) if a in names]
    if not axes:
      continue
    # How many distinct positions along these axes this process covers.
    here = jax.process_index()
    mine = {
      tuple(c[names.index(a)] for a in axes)
      for c in np.ndindex(devices.shape)
      if _process_of(devices[c]) == here
    }
    out[dim] = local[dim] * math.prod(mesh.shape[a] for a in axes) // max(len(mine), 1)
  return tuple(out)


def _process_of(device: Any) -> int:
  return device.process_index


def _spec_tree(tree: PyTree, names_or_specs: Any, rules: LogicalRules | None) -> PyTree:
  def to_spec(n: Any) -> PartitionSpec:
    if isinstance(n, PartitionSpec):
      return n
    return logical_to_mesh_axes(tuple(n), rules)

  if _is_names(names_or_specs):
    spec = to_spec(names_or_specs)
    return jax.tree_util.tree_map(lambda _: spec, tree)
  return jax.tree_util.tree_map(
    lambda _, n: to_spec(n), tree, names_or_specs, is_leaf=_is_names
  )


def _is_names(x: Any) -> bool:
  return isinstance(x, PartitionSpec) or (
    type(x) is tuple
    and all(e is None or isinstance(e, (str, tuple)) for e in x)
    and not any(
      isinstance(e, tuple) and not all(isinstance(a, str) for a in e) for e in x
    )
  )


def global_to_host_local(tree: PyTree) -> PyTree:
  """Global arrays -> the part this process's devices hold, as numpy.

  The inverse of :func:`host_local_to_global`, e.g. for evaluation outputs:
  each process gets back the rows it fed in.

  Example:
    >>> import jax, numpy as np, flax_shardmeta as fsm
    >>> mesh = jax.make_mesh((2, 4), ('data', 'model'))
    >>> x = fsm.host_local_to_global(np.arange(8.), mesh, jax.P('data'))
    >>> fsm.global_to_host_local(x)
    array([0., 1., 2., 3., 4., 5., 6., 7.], dtype=float32)
  """
  return jax.tree_util.tree_map(_local_part, tree)


def _local_part(x: Any) -> Any:
  if not isinstance(x, jax.Array):
    return x
  if x.is_fully_addressable:
    return np.asarray(x)
  shards = x.addressable_shards
  bounds = []
  for dim, size in enumerate(x.shape):
    starts = [s.index[dim].indices(size)[0] for s in shards]
    stops = [s.index[dim].indices(size)[1] for s in shards]
    bounds.append((min(starts), max(stops)))
  out = np.empty(tuple(b - a for a, b in bounds), dtype=x.dtype)
  for s in shards:
    local = tuple(
      slice(i.indices(n)[0] - a, i.indices(n)[1] - a)
      for i, n, (a, _) in zip(s.index, x.shape, bounds)
    )
    out[local] = np.asarray(s.data)
  return out
