"""Per-host data: which rows of the global batch each process loads.

With one process per host, each process reads only the batch rows its own
devices hold and the rows are assembled into global arrays without any host
ever holding the whole batch. Processes whose devices hold the same rows (a
model axis that spans hosts) read the same rows.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import zlib
from collections.abc import Sequence
from typing import Any, cast

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_shardmeta._annotation import path_str
from flax_shardmeta._errors import BatchLayoutError, ShardingError, ShardingProblem
from flax_shardmeta._placement import check_mesh
from flax_shardmeta._programs.hosts import host_of
from flax_shardmeta._resolution import logical_to_mesh_axes
from flax_shardmeta._rules import get_logical_axis_rules
from flax_shardmeta._specs import mesh_axes_of
from flax_shardmeta._typing import LogicalRules, PyTree


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
    BatchLayoutError: the batch size is not a whole number of 1 or more, the
      batch does not divide over the batch axes, or the processes' devices
      hold rows in a way a per-process loader cannot feed.

  Example:
    >>> import jax, flax_shardmeta as fsm
    >>> mesh = jax.make_mesh((2, 4), ('data', 'model'))
    >>> fsm.data_layout(mesh, 32)  # one process holds every row
    DataLayout(batch_size=32, shard_id=0, num_shards=1,
               is_first_host_in_replica_set=True)
  """
  mesh = cast(Mesh, check_mesh(mesh, 'data_layout'))
  _check_batch_size(global_batch_size)
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


def _check_batch_size(size: Any) -> None:
  """Refuse a global batch size that is not a positive whole number."""
  # bool is an int subclass; True rows is a mistake, not one row.
  try:
    # operator.index takes ints, numpy and jax integer scalars; not 32.0 or '32'.
    rows = None if isinstance(size, (bool, np.bool_)) else operator.index(size)
  except TypeError:
    rows = None
  if rows is None or rows < 1:
    raise BatchLayoutError(
      f'global_batch_size is {size!r} ({type(size).__name__}); give the rows '
      'of the whole batch as a whole number of 1 or more, e.g. '
      'fsm.data_layout(mesh, 32).'
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
    out.setdefault(host_of(devices[coords]), set()).add(index)
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
  ``jax.make_array_from_process_local_data``). With several processes, the
  processes compare the global shapes their rows imply (one small collective
  per call), so processes that disagree on the batch all get a
  :class:`BatchLayoutError` rather than arrays of a different shape each.

  Args:
    tree: host-local arrays (numpy or jax), leading dimension = local rows.
    mesh: the device mesh.
    names_or_specs: a ``PartitionSpec`` (mesh axes) or a tuple of logical names
      resolved through ``rules``; one for all leaves or a tree of them with
      ``tree``'s structure.
    rules: logical axis rules (None: the context rules).

  Returns:
    ``tree`` with global ``jax.Array`` leaves.

  Raises:
    ShardingError: this process's rows cannot be split over its devices.
    BatchLayoutError: the processes passed rows of different shapes.

  Example:
    >>> import jax, numpy as np, flax_shardmeta as fsm
    >>> mesh = jax.make_mesh((2, 4), ('data', 'model'))
    >>> x = fsm.host_local_to_global(np.ones((8, 3)), mesh, ('batch', None),
    ...                              [('batch', 'data')])
    >>> x.shape, x.sharding.spec
    ((8, 3), P('data', None))
  """
  mesh = cast(Mesh, check_mesh(mesh, 'host_local_to_global'))
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  per_leaf = _specs_and_names(tree, names_or_specs, rules)
  leaves: list[tuple[str, np.ndarray, PartitionSpec, tuple[int, ...]]] = []
  problems: list[ShardingProblem] = []
  for (path, x), (spec, names) in zip(flat, per_leaf):
    where = path_str(path) or '<value>'
    local = np.asarray(x)
    global_shape, issues = _global_shape(local.shape, spec, mesh)
    problems += [
      ShardingProblem(where, local.shape, names, spec, r, h, d) for r, h, d in issues
    ]
    leaves.append((where, local, spec, global_shape))
  # Compared before raising: a process left alone in the collective would hang.
  failed = _processes_agree([(w, x.shape, g) for w, x, _, g in leaves], problems)
  if problems:
    raise ShardingError(problems, context=f' (in process {jax.process_index()})')
  if failed:
    raise BatchLayoutError(
      f'process(es) {failed} could not split their rows over their devices '
      '(each raised a ShardingError saying why), so no global array is made '
      f'in process {jax.process_index()} either.'
    )
  out = [
    jax.make_array_from_process_local_data(NamedSharding(mesh, spec), local, shape)
    for _, local, spec, shape in leaves
  ]
  return jax.tree_util.tree_unflatten(treedef, out)


def _global_shape(
  local: tuple[int, ...], spec: PartitionSpec, mesh: Mesh
) -> tuple[tuple[int, ...], list[tuple[str, str, tuple[int, ...]]]]:
  """The global shape this process's rows imply, and what stops them.

  Along a sharded dimension this process's devices hold ``mine`` of the
  ``total`` shards, so its rows are ``mine`` shards' worth of the global
  dimension.
  """
  out = list(local)
  issues: list[tuple[str, str, tuple[int, ...]]] = []
  entries = tuple(spec)
  if len(entries) > len(local):
    issues.append(
      (
        f'{len(entries)} spec entries for a rank-{len(local)} array',
        'give at most one entry per dimension',
        (),
      )
    )
  devices = np.asarray(mesh.devices)
  names = list(mesh.axis_names)
  here = jax.process_index()
  for dim, entry in enumerate(entries[: len(local)]):
    axes = mesh_axes_of(entry)
    missing = [a for a in axes if a not in names]
    if missing:
      issues.append(
        (
          f'mesh axes {missing} (dimension {dim}) are not in the mesh '
          f'{dict(mesh.shape)}',
          'use axes the mesh has, or a rule that maps the name to them',
          (dim,),
        )
      )
      continue
    if not axes:
      continue
    # How many distinct positions along these axes this process covers.
    mine = len(
      {
        tuple(c[names.index(a)] for a in axes)
        for c in np.ndindex(devices.shape)
        if host_of(devices[c]) == here
      }
    )
    total = math.prod(mesh.shape[a] for a in axes)
    if local[dim] % max(mine, 1):
      shown = ' x '.join(f"'{a}'={mesh.shape[a]}" for a in axes)
      issues.append(
        (
          f'dimension {dim}: this process passed {local[dim]}, and its devices '
          f'hold {mine} of the {total} shards over {shown}: '
          f'{local[dim] / mine:g} each',
          f'pass a multiple of {mine} per process; for the batch, the '
          'fsm.data_layout(mesh, global_batch_size).batch_size rows that '
          f'data_layout assigns each process (a global batch divisible by {total})',
          (dim,),
        )
      )
      continue
    out[dim] = local[dim] * total // max(mine, 1)
  return tuple(out), issues


def _processes_agree(
  leaves: list[tuple[str, tuple[int, ...], tuple[int, ...]]],
  problems: list[ShardingProblem],
) -> list[int]:
  """Every process must imply the same global shapes; else all of them raise.

  A digest of the global shapes is compared first (one small allgather); only
  when the processes disagree is more gathered, to say who passed what. Every
  process sees the same gathered data, so all take the same branch.

  Returns:
    The processes whose own rows had ``problems`` (each raises them).
  """
  if jax.process_count() == 1:
    return []
  flat = [n for _, _, g in leaves for n in (len(g), *g)]
  digest = zlib.crc32(np.asarray(flat, np.int64).tobytes()) & 0x7FFFFFFF
  head = np.asarray([len(leaves), len(flat), digest, len(problems)], np.int32)
  heads = np.asarray(multihost_utils.process_allgather(head))
  failed = [p for p, h in enumerate(heads) if h[3]]
  if failed:
    return failed
  if (heads == heads[0]).all():
    return []
  counts = {p: int(h[0]) for p, h in enumerate(heads)}
  if len(set(counts.values())) > 1 or len({int(h[1]) for h in heads}) > 1:
    detail = ', '.join(
      f'process {p} passed {n} array(s)' for p, n in sorted(counts.items())
    )
  else:
    mine = np.asarray([n for _, local, g in leaves for n in (*local, *g)], np.int32)
    every = np.asarray(multihost_utils.process_allgather(mine))
    lines = []
    pos = 0
    for where, local, g in leaves:
      width = len(local) + len(g)
      block = every[:, pos : pos + width]
      pos += width
      if (block == block[0]).all():
        continue
      said = '; '.join(
        f'process {p} passed shape {tuple(int(v) for v in row[: len(local)])} '
        f'(a global {tuple(int(v) for v in row[len(local) :])})'
        for p, row in enumerate(block)
      )
      lines.append(f'{where}: {said}')
    detail = '\n  '.join(lines)
  raise BatchLayoutError(
    f'the processes passed host_local_to_global rows that do not form one '
    f'global array (seen from process {jax.process_index()} of '
    f'{jax.process_count()}):\n  {detail}\nEvery process must pass the rows '
    'fsm.data_layout(mesh, global_batch_size) assigns it (batch_size rows '
    'each, the same shape everywhere); otherwise each process would build a '
    'global array of another shape.'
  )


def _specs_and_names(
  tree: PyTree, names_or_specs: Any, rules: LogicalRules | None
) -> list[tuple[PartitionSpec, Any]]:
  """Per leaf of ``tree`` (in flattening order): its spec and names as given."""

  def one(n: Any) -> tuple[PartitionSpec, Any]:
    if isinstance(n, PartitionSpec):
      return n, n
    return logical_to_mesh_axes(tuple(n), rules), tuple(n)

  n_leaves = len(jax.tree_util.tree_leaves(tree))
  if _is_names(names_or_specs):
    return [one(names_or_specs)] * n_leaves
  treedef = jax.tree_util.tree_structure(tree)
  try:
    given = treedef.flatten_up_to(names_or_specs)
  except (ValueError, TypeError):
    raise BatchLayoutError(
      'names_or_specs must be one PartitionSpec / names tuple for every leaf, '
      f'or a tree of them with the structure of the rows ({treedef.num_leaves} '
      'leaves)'
    ) from None
  return [one(n) for n in given]


def _is_names(x: Any) -> bool:
  return isinstance(x, PartitionSpec) or (
    type(x) in (tuple, list)
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
