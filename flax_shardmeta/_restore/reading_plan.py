"""Restore plans: a checkpoint saved on one mesh, restored onto another.

Before a job starts, :func:`restore_plan` answers what each host reads and
holds, the device memory before and after, how leaves can be restored in
groups under a host-memory budget, and what is wrong, by parameter path.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np

from flax_shardmeta import _annotation as ann_lib
from flax_shardmeta._caches import paused_gc
from flax_shardmeta._errors import RestoreError, ShardingProblem
from flax_shardmeta._paths import nest
from flax_shardmeta._placement import check_mesh
from flax_shardmeta._planning.entry import nbytes
from flax_shardmeta._restore.casts import CAST, saved_as_target
from flax_shardmeta._restore.checkpoint import SavedCheckpoint, read_checkpoint
from flax_shardmeta._restore.chunks import (
  dim_axes,
  host_of_devices,
  lost_explicit_axes,
  resized_axes,
  saved_layout,
)
from flax_shardmeta._restore.inputs import (
  budget_bytes,
  check_flag,
  check_hosts,
  check_step,
  count,
)
from flax_shardmeta._restore.reads import LeafCost, leaf_cost
from flax_shardmeta._restore.schedule import Group, min_budget, schedule
from flax_shardmeta._restore.targets import Target, target_leaves, target_mesh
from flax_shardmeta._sharding import leaf_shape
from flax_shardmeta._specs import format_spec, json_entry, spec_entries
from flax_shardmeta._typing import AnyMesh, LogicalRules, PyTree
from flax_shardmeta._units import format_bytes
from flax_shardmeta._views import ShownWithTreescope

# Reasons of problems a restore reports but goes past: the target asks for them.
KIND, TYPES = 'memory kind changes', 'saved on Explicit mesh axes'
NOTES = (CAST, KIND, TYPES)
EXTRA = 'saved in the checkpoint but not in the target'


@dataclasses.dataclass(frozen=True, slots=True)
class RestoreEntry:
  """One leaf of a restore: its saved and target layouts and bytes per host.

  ``cost`` is None where the leaf cannot be restored as planned (see the
  plan's problems); its byte figures are then 0.
  """

  path: str
  saved_shape: tuple[int, ...] | None
  shape: tuple[int, ...]
  saved_dtype: Any
  dtype: Any
  saved_spec: Any
  spec: Any
  saved_memory_kind: str | None
  memory_kind: str | None
  moves: bool
  cost: LeafCost | None = dataclasses.field(default=None, repr=False, compare=False)

  @property
  def bytes_needed(self) -> int:
    """Bytes of target shards all hosts need, each host's distinct ones once."""
    return 0 if self.cost is None else int(self.cost.needed.sum())

  @property
  def bytes_read(self) -> int:
    """Stored bytes all hosts' reads fetch (each read its chunks, whole)."""
    return 0 if self.cost is None else int(self.cost.read.sum())

  @property
  def over_read(self) -> int:
    """Decoded bytes read beyond the shards kept (as saved, before a cast)."""
    return 0 if self.cost is None else int((self.cost.decoded - self.cost.shards).sum())

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form."""
    return {
      'path': self.path,
      'saved_shape': None if self.saved_shape is None else list(self.saved_shape),
      'shape': list(self.shape),
      'saved_dtype': None if self.saved_dtype is None else str(self.saved_dtype),
      'dtype': str(self.dtype),
      'saved_spec': _json_spec(self.saved_spec),
      'spec': _json_spec(self.spec),
      'saved_memory_kind': self.saved_memory_kind,
      'memory_kind': self.memory_kind,
      'moves': self.moves,
      'bytes_needed': self.bytes_needed,
      'bytes_read': self.bytes_read,
      'max_host_read': 0 if self.cost is None else int(self.cost.read.max()),
    }


class RestorePlan(ShownWithTreescope):
  """What restoring a checkpoint onto a mesh reads and holds, per host and device.

  Attributes:
    entries: one :class:`RestoreEntry` per target array leaf, in tree order.
    problems: what is wrong, each naming its path.
    mesh: the target mesh.
    num_hosts: hosts of the target mesh.
    host_budget: the host-memory budget in bytes (None: no budget).
    schedule: groups of leaf paths restored in turn (one group without a budget).
    groups: the schedule's groups with the byte limit each is read under.
    min_budget_bytes: the smallest budget any schedule meets: the most one
      read stages on one host (its stored chunks, one decoded chunk and its
      shard; see ``_restore/reads.py``).
    fits_budget: whether every group fits the budget (None without one).
    needed_per_host: bytes of the target shards each host holds.
    read_per_host: stored bytes each host fetches, every read its chunks
      whole: exact when reads run one at a time, at most that otherwise.
    staging_peak_per_host: per host, the most its reads stage at once (with
      no budget, every read at once: at most).
    device_peak_bytes, device_after_bytes: per device, the most held during
      the restore and what is held after it.
    partial, allow_cast: as planned: saved leaves the target lacks are left
      unread; casts that can lose values are made (both notes, not problems).

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> from jax.sharding import AbstractMesh, AxisType, NamedSharding
    >>> from jax.sharding import PartitionSpec as P
    >>> auto = (AxisType.Auto,)
    >>> old = AbstractMesh((4,), ('data',), axis_types=auto)
    >>> new = AbstractMesh((4,), ('model',), axis_types=auto)
    >>> w = lambda m, s: jax.ShapeDtypeStruct((8, 4), jnp.float32,
    ...                                       sharding=NamedSharding(m, s))
    >>> r = fsm.restore_plan({'w': w(old, P('data'))}, {'w': w(new, P(None, 'model'))},
    ...                      devices_per_host=2)
    >>> r.needed_per_host, r.read_per_host, r.problems
    ((64, 64), (256, 256), ())
  """

  def __init__(
    self,
    entries: tuple[RestoreEntry, ...],
    problems: tuple[ShardingProblem, ...],
    mesh: AnyMesh | None,
    num_hosts: int,
    host_budget: int | None,
    checkpoint: SavedCheckpoint | None = None,
    *,
    partial: bool = False,
    allow_cast: bool = False,
  ):
    """Made by :func:`restore_plan`; not meant to be called directly."""
    self.checkpoint = checkpoint
    self.partial, self.allow_cast = partial, allow_cast
    self.entries = entries
    self.problems = problems
    self.mesh = mesh
    self.num_hosts = num_hosts
    self.host_budget = host_budget
    costs = [(e.path, e.cost) for e in entries if e.cost is not None]
    ndev = math.prod(mesh.axis_sizes) if mesh is not None else 0
    zeros = np.zeros(num_hosts, dtype=np.int64)
    read = sum((c.read for _, c in costs), zeros)
    self.read_per_host = tuple(int(x) for x in read)
    needed = sum((c.needed for _, c in costs), zeros)
    self.needed_per_host = tuple(int(x) for x in needed)
    self.min_budget_bytes = min_budget(costs)
    self.groups: tuple[Group, ...] = tuple(schedule(costs, host_budget, num_hosts))
    self.schedule = tuple(g.paths for g in self.groups)
    self.fits_budget = (
      None if host_budget is None else self.min_budget_bytes <= host_budget
    )
    staging, during = zeros.copy(), np.zeros(ndev, dtype=np.int64)
    held = np.zeros(ndev, dtype=np.int64)
    for group in self.groups:
      staging = np.maximum(staging, group.staging)
      # Shards are put in place as they arrive: a device holds what is restored
      # so far and the group being restored, never a second copy.
      held = held + sum((c.device for _, c in group.items), np.zeros(ndev, np.int64))
      during = np.maximum(during, held)
    self.staging_peak_per_host = tuple(int(x) for x in staging)
    self.device_peak_bytes = tuple(int(x) for x in during)
    self.device_after_bytes = tuple(int(x) for x in held)

  @property
  def blocking(self) -> tuple[ShardingProblem, ...]:
    """The problems a restore cannot go past: all but the notes (a cast that
    keeps values or one allowed, a memory-kind change, axis types the target
    chose, with ``partial`` a saved leaf the target lacks), which it reports."""
    notes = NOTES + ((EXTRA,) if self.partial else ())
    return tuple(p for p in self.problems if not p.reason.startswith(notes))

  @property
  def total_read(self) -> int:
    """Bytes all hosts read."""
    return sum(self.read_per_host)

  @property
  def total_needed(self) -> int:
    """Bytes all hosts need."""
    return sum(self.needed_per_host)

  @property
  def over_read(self) -> int:
    """Decoded bytes read beyond the shards kept, over all hosts."""
    return sum(e.over_read for e in self.entries)

  @property
  def content_check(self) -> Any:
    """Which leaves a restore checks against the checksums ``fsm.save`` wrote
    (a ``ContentCheck``: ``algorithm`` None when the checkpoint has none)."""
    from flax_shardmeta._restore.checksums import content_check

    return content_check(self)

  def entry(self, path: str) -> RestoreEntry:
    """The entry at ``path`` (KeyError if none)."""
    for e in self.entries:
      if e.path == path:
        return e
    raise KeyError(f'No target array at {path!r} in this restore plan')

  def to_dict(self) -> dict[str, Any]:
    """JSON-serializable form."""
    mesh = self.mesh
    return {
      'mesh': None if mesh is None else dict(zip(mesh.axis_names, mesh.axis_sizes)),
      'num_hosts': self.num_hosts,
      'entries': [e.to_dict() for e in self.entries],
      'hosts': [
        {'host': h, 'needed': n, 'read': r, 'staging_peak': s}
        for h, (n, r, s) in enumerate(
          zip(self.needed_per_host, self.read_per_host, self.staging_peak_per_host)
        )
      ],
      'total_needed': self.total_needed,
      'total_read': self.total_read,
      'host_budget': self.host_budget,
      'fits_budget': self.fits_budget,
      'min_budget_bytes': self.min_budget_bytes,
      'schedule': [list(g) for g in self.schedule],
      'device_peak_bytes': max(self.device_peak_bytes, default=0),
      'device_after_bytes': max(self.device_after_bytes, default=0),
      'problems': [p.to_dict() for p in self.problems],
      # Of those, the ones a restore cannot go past (the rest are notes).
      'blocking': [p.to_dict() for p in self.blocking],
      'content_check': self.content_check.to_dict(),
    }

  def format(self, verbose: bool = False) -> str:
    """The plan as text: a row per module (``verbose``: per array), then
    hosts, totals, problems and notes; ``str(plan)`` is ``format()``."""
    from flax_shardmeta._restore.plan_text import plan_text

    return plan_text(self, verbose)

  def __str__(self) -> str:
    return self.format()

  def __repr__(self) -> str:
    return (
      f'RestorePlan({len(self.entries)} arrays, {self.num_hosts} hosts, '
      f'total_read={self.total_read}, total_needed={self.total_needed}, '
      f'problems={len(self.problems)})'
    )

  def _treescope_view(self) -> dict[str, Any]:
    tree = nest(
      (
        e.path,
        {
          'saved_spec': format_spec(e.saved_spec),
          'spec': format_spec(e.spec),
          'moves': e.moves,
          'read': format_bytes(e.bytes_read),
          'needed': format_bytes(e.bytes_needed),
        },
      )
      for e in self.entries
    )
    return {
      'total_read': format_bytes(self.total_read),
      'total_needed': format_bytes(self.total_needed),
      'schedule': [list(g) for g in self.schedule],
      'problems': [str(p) for p in self.problems],
      'entries': tree,
    }


def _json_spec(spec: Any) -> list[Any] | None:
  return None if spec is None else [json_entry(e) for e in spec_entries(spec)]


def restore_plan(
  source: PyTree | str | os.PathLike[str],
  target: PyTree,
  *,
  mesh: AnyMesh | None = None,
  rules: LogicalRules | None = None,
  host_budget: int | str | None = None,
  devices_per_host: int | None = None,
  step: int | None = None,
  partial: bool = False,
  allow_cast: bool = False,
  replicate_unannotated: bool = False,
) -> RestorePlan:
  """Plans restoring a checkpoint saved with ``source``'s layouts as ``target``.

  Leaves are matched by path (boxes are not a path level). Each host reads,
  whole, every saved chunk meeting the shards its devices hold; with
  ``host_budget`` leaves are restored in groups whose reads fit it.

  Args:
    source: an orbax checkpoint directory, a ``CheckpointManager`` step
      folder or root (its metadata is read, not its arrays; chunks as orbax
      wrote them, at their stored size), or the saved layout on paper:
      ``ShapeDtypeStruct`` leaves carrying the saved ``NamedSharding``
      (None: saved unsharded).
    target: the restore target: ``fsm.as_abstract`` output, shardings of a
      plan as struct leaves, or annotated boxes (then ``mesh`` is needed).
    mesh: the target mesh; default: the first target sharding's.
    rules: logical axis rules for boxes; None uses the context rules.
    host_budget: host memory for staging reads, in bytes or as ``'8GiB'``.
    devices_per_host: group the mesh's devices into hosts of this many
      (default: a concrete mesh by process, an abstract one as one host).
    step: with ``source`` a ``CheckpointManager``'s root, the step to plan
      (default: the latest); with a step folder, only its own step.
    partial: plan restoring the target's leaves of a checkpoint that has
      more (those it lacks are then notes, not problems).
    allow_cast: a target dtype that can lose saved values (float to int, a
      narrower type) is a note, not a problem.
    replicate_unannotated: with ``mesh``, an unannotated array leaf with no
      sharding of its own (a step count) is replicated on it, as
      ``fsm.plan`` and ``fsm.as_abstract`` lay it out, instead of being a
      problem (it would restore with the saved layout).

  Returns:
    The :class:`RestorePlan`; problems of the leaves are collected, not raised.

  Raises:
    HostBudgetError: ``host_budget`` is not a positive number of bytes.
    RestoreError: ``step`` is not a step, or not the one ``source`` holds;
      ``devices_per_host`` is not a positive int.
    FlaxShardmetaError: ``source`` is not a checkpoint.

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P
    >>> saved = AbstractMesh((8,), ('data',))
    >>> tree = {'w': fsm.LogicalPartitioned(
    ...     jax.ShapeDtypeStruct((16, 8), jnp.float32), ('embed', 'mlp'))}
    >>> source = fsm.as_abstract(tree, saved, [('embed', 'data')])
    >>> r = fsm.restore_plan(source, tree, mesh=AbstractMesh((2, 4), ('data', 'model')),
    ...                      rules=[('mlp', 'model')], devices_per_host=4)
    >>> r.entry('w').spec, r.needed_per_host, r.read_per_host
    (P(None, 'model'), (512, 512), (2048, 2048))
  """
  budget = budget_bytes(host_budget)
  per_host = count('devices_per_host', devices_per_host, 1)
  partial = check_flag('partial', partial)
  allow_cast = check_flag('allow_cast', allow_cast)
  replicate = check_flag('replicate_unannotated', replicate_unannotated)
  mesh = None if mesh is None else check_mesh(mesh, 'restore_plan')
  problems: list[ShardingProblem] = []
  saved_ckpt = None
  if isinstance(source, (str, os.PathLike)):
    saved_ckpt = read_checkpoint(source, count('step', step, 0))
    check_step(source, saved_ckpt.directory, step)
    source = saved_ckpt.tree
  with paused_gc():
    saved = _arrays(source)
    targets = target_leaves(target, mesh, rules, problems, replicate)
  if not targets:
    raise RestoreError(
      f'the target holds no arrays (got {type(target).__name__}): pass the '
      'tree to restore into, e.g. fsm.as_abstract(abstract_state, mesh)'
    )
  if not saved and saved_ckpt is None:
    raise RestoreError(
      f'the source holds no arrays (got {type(source).__name__}): pass an '
      "orbax checkpoint's directory, or the saved layout as structs"
    )
  mesh, elsewhere = target_mesh(targets, mesh)
  if mesh is not None:
    check_hosts(math.prod(mesh.axis_sizes), per_host)
  hosts = host_of_devices(mesh, per_host) if mesh is not None else None
  num_hosts = 0 if hosts is None else int(hosts.max()) + 1
  memo: dict[Any, LeafCost] = {}
  entries = []
  for t in targets:
    old = saved.pop(t.path, None)
    where = (hosts, num_hosts, saved_ckpt, elsewhere(t.path), allow_cast)
    entries.append(_entry(t, old, where, memo, problems))
  for path, old in saved.items():
    problems.append(
      _problem(path, old, None, EXTRA,
               'add it to the target, or restore a subset with partial=True '
               '(restore-plan --partial)')
    )  # fmt: skip
  return RestorePlan(
    tuple(entries), tuple(problems), mesh, num_hosts, budget, saved_ckpt,
    partial=partial, allow_cast=allow_cast,
  )  # fmt: skip


def _arrays(tree: PyTree) -> dict[str, Any]:
  """Path -> array-like value of every array leaf (boxes unboxed)."""
  leaves, _ = ann_lib.walk(tree, every_path=True)
  return {lf.path: lf.value for lf in leaves if leaf_shape(lf.value) is not None}


def _problem(
  path: str, value: Any, spec: Any, reason: str, hint: str
) -> ShardingProblem:
  return ShardingProblem(path, leaf_shape(value), None, spec, reason, hint)


def _entry(
  t: Target,
  old: Any,
  where: tuple[np.ndarray | None, int, SavedCheckpoint | None, Any, bool],
  memo: dict[Any, LeafCost],
  problems: list[ShardingProblem],
) -> RestoreEntry:
  """One target leaf's entry; its problems appended to ``problems``.

  ``where`` is the hosts of the mesh's devices, their count, the checkpoint
  read (None: planned on paper), the (reason, hint) of a leaf on another mesh
  than the plan's (None: on it) and ``allow_cast``.
  """
  hosts, num_hosts, ckpt, elsewhere, allow_cast = where
  path, value, sharding = t.path, t.value, t.sharding
  chunk = None if ckpt is None else ckpt.chunks.get(path)
  stored = None if ckpt is None else ckpt.stored.get(path)
  shape, dtype = leaf_shape(value) or (), getattr(value, 'dtype', None)
  spec = None if sharding is None else sharding.spec
  kind = None if sharding is None else sharding.memory_kind or 'device'
  old_sharding = getattr(old, 'sharding', None)
  old_spec, old_chunk, old_sizes = saved_layout(old)
  old_chunk = chunk or old_chunk
  old_kind = (
    None if old is None else getattr(old_sharding, 'memory_kind', None) or 'device'
  )
  add = lambda reason, hint: problems.append(_problem(path, value, spec, reason, hint))  # noqa: E731
  ok = saved_as_target(old, shape, dtype, allow_cast, add)
  if t.faulty:
    ok = False  # its layout's problems are listed: they say why
  elif sharding is None:
    ok = False
    other = getattr(value, 'sharding', None)
    has = (
      'no sharding' if other is None else f'a {type(other).__name__}, no NamedSharding'
    )
    add(
      f'the target has {has}: it would restore with the saved layout',
      'pass fsm.as_abstract(tree, mesh) or give it a NamedSharding',
    )
  elif elsewhere is not None:
    ok = False
    add(*elsewhere)
  if old is not None and kind is not None and old_kind != kind:
    add(f'{KIND} from {old_kind} to {kind}', 'check it is meant')
  lost = lost_explicit_axes(old_sharding, sharding)
  if old is not None and sharding is not None and lost:
    add(
      f'{TYPES} {sorted(lost)} the target mesh does not make Explicit',
      'make those axes Explicit on the target mesh, or accept Auto ones',
    )
  n = len(shape)
  new_axes = dim_axes(spec, n) if sharding is not None else ()
  resized = sharding is not None and resized_axes(old_sizes, sharding.mesh, new_axes)
  moves = old is not None and (dim_axes(old_spec, n) != new_axes or resized)
  cost = None
  if ok and old is not None and sharding is not None and hosts is not None:
    sizes = (nbytes((), old.dtype), nbytes((), dtype))
    key = (shape, old_chunk, sizes, new_axes, None if stored is None else path)
    cost = memo.get(key)
    if cost is None:
      cost = memo[key] = leaf_cost(
        shape, old_chunk, stored, sizes, new_axes, sharding.mesh, hosts, num_hosts
      )
  return RestoreEntry(
    path, leaf_shape(old), shape, getattr(old, 'dtype', None), dtype,
    old_spec, spec, old_kind, kind, bool(moves), cost,
  )  # fmt: skip
