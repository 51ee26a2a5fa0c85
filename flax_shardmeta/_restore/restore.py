"""``fsm.restore``: a checkpoint restored onto a mesh as its plan says.

orbax does the reading (its ``PyTreeCheckpointHandler``, the target
shardings as restore arguments, skipped leaves as its placeholders). fsm adds
what orbax does not: the plan checked before anything is read, leaves read
in the plan's groups with orbax's byte limit set so each host's staging
stays within the budget, host buffers freed between groups, every leaf
checked to have landed with the target's layout, and the result put back in
the target's form (boxes stay boxes, an NNX module gets its state back).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import sys
from typing import Any

import jax
from jax.sharding import NamedSharding

from flax_shardmeta import _annotation as ann_lib
from flax_shardmeta._errors import RestoreError, ShardingProblem
from flax_shardmeta._restore import checksums, damage
from flax_shardmeta._restore.checkpoint import saved_keys
from flax_shardmeta._restore.reading_plan import RestorePlan, restore_plan
from flax_shardmeta._sharding import leaf_shape
from flax_shardmeta._typing import AnyMesh, LogicalRules, PyTree
from flax_shardmeta._units import format_bytes


def restore(
  path: str | os.PathLike[str],
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
) -> PyTree:
  """Restores the orbax checkpoint at ``path`` as ``target`` lays it out.

  Plans first (:func:`flax_shardmeta.restore_plan`) and raises before
  reading anything if the plan has a problem a restore cannot go past, or
  if no schedule meets ``host_budget``. Leaves are then read group by group
  as the plan schedules them, each host reading only what its own devices
  hold; host buffers are freed between groups (buffers of 1 MiB and more are
  returned to the system when freed, for the rest of the process). Every
  leaf is checked to have the target's shape, dtype and sharding, values as
  saved; nothing of an initialised state is needed or kept.

  Args:
    path: an orbax checkpoint, or a ``CheckpointManager`` step folder or root.
    target: ``fsm.as_abstract`` / ``fsm.nnx.as_abstract`` output (structs
      with shardings, boxes or an NNX module holding them), or annotated
      boxes with ``mesh``.
    mesh: the (concrete) mesh; default: the target shardings' mesh.
    rules: logical axis rules for boxes; None uses the context rules.
    host_budget: host memory for staging reads per host, bytes or ``'8GiB'``.
    devices_per_host: as for ``restore_plan`` (default: by process).
    step: with ``path`` a ``CheckpointManager`` root, the step (default:
      latest); with a step folder, only its own step.
    partial: restore the target's leaves even though the checkpoint has more.
    allow_cast: restore into target dtypes that can lose saved values (float
      to int, a narrower type); casts that keep every value need no opt-in.
    replicate_unannotated: with ``mesh``, replicate unannotated array leaves
      that have no sharding of their own (as for ``restore_plan``).

  Returns:
    ``target`` with ``jax.Array`` leaves in place of its structs (boxes hold
    arrays; an NNX module comes back as a module).

  Raises:
    RestoreError: naming every blocking problem by path (a cast that can
      lose values without ``allow_cast``, a sharding that cannot split its
      leaf included), a budget that cannot be met, a step the path does not
      hold, or a leaf that landed with another layout.
    HostBudgetError: ``host_budget`` is not a positive number of bytes.
    CheckpointDamagedError: a leaf's values differ from the checksums
      ``fsm.save`` recorded (checked after each group is read, for every leaf
      restored without a cast), a leaf's data cannot be read, or a metadata
      file is corrupt; named by leaf or file.

  Example:
    >>> import jax, jax.numpy as jnp, orbax.checkpoint as ocp, flax_shardmeta as fsm
    >>> import tempfile, os
    >>> from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
    >>> auto = (AxisType.Auto,) * 2
    >>> saved = jax.make_mesh((8, 1), ('data', 'model'), axis_types=auto)
    >>> w = jax.device_put(jnp.arange(64.0).reshape(8, 8),
    ...                    NamedSharding(saved, P('data')))
    >>> path = os.path.join(tempfile.mkdtemp(), 'ckpt')
    >>> with ocp.StandardCheckpointer() as c:
    ...   c.save(path, {'w': w})
    >>> mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=auto)
    >>> cols = NamedSharding(mesh, P(None, 'model'))
    >>> target = {'w': jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=cols)}
    >>> out = fsm.restore(path, target, host_budget='1KiB')
    >>> out['w'].sharding.spec, bool((out['w'] == w).all())
    (P(None, 'model'), True)
  """
  if not isinstance(path, (str, os.PathLike)):
    raise RestoreError(
      f'path={path!r}: expected the directory of an orbax checkpoint (a str or '
      'os.PathLike); to plan from a saved layout, use fsm.restore_plan'
    )
  plan = restore_plan(
    path, target, mesh=mesh, rules=rules, host_budget=host_budget,
    devices_per_host=devices_per_host, step=step, partial=partial,
    allow_cast=allow_cast, replicate_unannotated=replicate_unannotated,
  )  # fmt: skip
  _check(plan)
  shardings = _shardings(plan)
  _return_freed_memory()
  restored: dict[str, jax.Array] = {}
  for group in plan.groups:
    with damage.reading(plan, group.paths):  # a damaged file names its leaf
      got = _read_group(plan, group.paths, group.limit, shardings)
    checksums.verify(plan, got)  # against fsm.save's checksums, if it wrote any
    restored.update(got)
    gc.collect()
    _trim_heap()
  return _into_target(target, restored)


def _check(plan: RestorePlan) -> None:
  """Raises before reading if the plan cannot be restored as asked."""
  blocking = plan.blocking
  if blocking:
    n = len({p.path for p in blocking})
    head = '1 leaf cannot' if n == 1 else f'{n} leaves cannot'
    raise RestoreError(
      f'{head} be restored as the target asks (nothing was read):\n'
      + '\n'.join(f'  - {p}' for p in blocking),
      blocking,
    )
  if plan.fits_budget is False:
    costs = [(e, e.cost) for e in plan.entries if e.cost is not None]
    worst, cost = max(costs, key=lambda ec: ec[1].min_budget)
    raise RestoreError(
      f'host_budget={format_bytes(plan.host_budget or 0)} cannot be met: a read '
      f'of {worst.path} (shape {worst.shape}, saved as {worst.saved_spec}, '
      f'restored as {worst.spec}) alone stages '
      f'{format_bytes(cost.min_budget)} on one host; pass host_budget of '
      f'at least {format_bytes(plan.min_budget_bytes)} (nothing was read)'
    )
  if plan.checkpoint is None or not isinstance(plan.mesh, jax.sharding.Mesh):
    raise RestoreError(
      'restore needs the concrete mesh it restores onto: pass '
      'mesh=jax.make_mesh(...) or a target whose shardings are on one '
      f'(got {type(plan.mesh).__name__})'
    )


def _shardings(plan: RestorePlan) -> dict[str, NamedSharding]:
  """Per leaf path, the target sharding on the plan's concrete mesh."""
  assert plan.mesh is not None  # checked: a concrete mesh
  out = {}
  for e in plan.entries:
    kind = None if e.memory_kind in (None, 'device') else e.memory_kind
    out[e.path] = NamedSharding(plan.mesh, e.spec, memory_kind=kind)
  return out


def _read_group(
  plan: RestorePlan,
  paths: tuple[str, ...],
  limit: int | None,
  shardings: dict[str, NamedSharding],
) -> dict[str, jax.Array]:
  """Reads one group's leaves with orbax; checks each landed as planned."""
  import orbax.checkpoint as ocp

  ckpt = plan.checkpoint
  assert ckpt is not None
  by_keys = {ckpt.keys[p]: plan.entry(p) for p in paths}

  def struct_or_skip(keys: tuple[str, ...], _: Any, args: bool) -> Any:
    e = by_keys.get(keys)
    if e is None:
      return ocp.PLACEHOLDER
    sharding = shardings[e.path]
    if args:
      return ocp.ArrayRestoreArgs(
        sharding=sharding, global_shape=e.shape, dtype=e.dtype
      )
    return jax.ShapeDtypeStruct(e.shape, e.dtype, sharding=sharding)

  flat, treedef = jax.tree_util.tree_flatten(ckpt.metadata)
  keyed = saved_keys(ckpt.metadata)
  item = treedef.unflatten([struct_or_skip(k, v, False) for k, v in keyed])
  args = treedef.unflatten([struct_or_skip(k, v, True) for k, v in keyed])
  # orbax's limit is in units of 10**9 bytes; it refuses a read whose
  # footprint is not below it, so one byte over the plan's limit.
  gb = None if limit is None else (limit + 1) / 10**9
  # A float: orbax multiplies it by 10**9, and whole GB is far too coarse.
  handler = ocp.PyTreeCheckpointHandler(restore_concurrent_gb=gb)  # pyright: ignore[reportArgumentType]
  with ocp.Checkpointer(handler) as checkpointer:
    out = checkpointer.restore(
      ckpt.directory, args=ocp.args.PyTreeRestore(item=item, restore_args=args)
    )
  del flat
  got = {}
  for keys, value in saved_keys(out):
    e = by_keys.get(keys)
    if e is not None:
      got[e.path] = _landed(e.path, value, e.shape, e.dtype, shardings[e.path])
  return got


def _landed(
  path: str, value: Any, shape: tuple[int, ...], dtype: Any, want: NamedSharding
) -> jax.Array:
  """``value`` if it has the target's shape, dtype and layout; else raises."""
  sharding = getattr(value, 'sharding', None)
  ok = (
    isinstance(value, jax.Array)
    and leaf_shape(value) == shape
    and value.dtype == dtype
    and sharding is not None
    and sharding.is_equivalent_to(want, len(shape))
  )
  if ok:
    return value
  problem = ShardingProblem(
    path, leaf_shape(value), None, want.spec,
    f'landed as {type(value).__name__} {getattr(value, "dtype", "")} with '
    f'{sharding}, not the target layout',
    'report this with the checkpoint metadata; the restore was stopped',
  )  # fmt: skip
  raise RestoreError(f'1 leaf was restored wrongly:\n  - {problem}', [problem])


def _into_target(target: PyTree, restored: dict[str, jax.Array]) -> PyTree:
  """``target`` with each planned leaf's struct replaced by its array."""
  module = _nnx_module(target)
  if module is not None:
    from flax import nnx

    graphdef, state = nnx.split(target)
    return nnx.merge(graphdef, _into_target(state, restored))
  leaves, build = ann_lib.walk(target, every_path=True)
  return build([
    ann_lib.hold(lf.leaf, restored[lf.path]) if lf.path in restored else lf.leaf
    for lf in leaves
  ])  # fmt: skip


def _nnx_module(target: Any) -> Any:
  # A module exists only if flax.nnx was imported: never import it for Linen.
  nnx = sys.modules.get('flax.nnx')
  return target if nnx is not None and isinstance(target, nnx.Module) else None


@functools.cache
def _libc() -> Any:
  """glibc, whose allocator these calls tune (None elsewhere)."""
  try:
    lib = ctypes.CDLL('libc.so.6')  # by name: find_library would run ldconfig
  except OSError:
    return None
  return lib if hasattr(lib, 'malloc_trim') and hasattr(lib, 'mallopt') else None


def _return_freed_memory() -> None:
  """Makes freed host buffers of 1 MiB and more go back to the system.

  glibc keeps freed large blocks in its heap once its mmap threshold has
  risen (it does after the first large free), so a process's memory stays at
  its staging peak after a restore; a fixed threshold maps and unmaps them.
  """
  lib = _libc()
  if lib is not None:
    lib.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD


def _trim_heap() -> None:
  lib = _libc()
  if lib is not None:
    lib.malloc_trim(0)
