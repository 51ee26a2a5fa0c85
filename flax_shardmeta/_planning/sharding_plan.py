"""Sharding plans: every array's layout, memory and problems, before anything runs.

A plan is computed from an abstract tree (``jax.eval_shape`` output, a
TrainState, an NNX State) and a mesh that may be abstract and far larger than
the machine. Layouts come from :mod:`flax_shardmeta._sharding`, which caches
them per distinct pattern, so a 126-layer model costs about as much as one
layer. Only problems are found up front: entries, their paths, totals and
explanations are made when first read, so a plan costs little more than the
shardings themselves.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from flax_shardmeta import _annotation as ann_lib
from flax_shardmeta._caches import paused_gc
from flax_shardmeta._errors import ShardingError, ShardingProblem
from flax_shardmeta._paths import nest
from flax_shardmeta._placement import check_mesh
from flax_shardmeta._planning.entry import (
  PlanEntry,
  make_entries,
  mesh_sizes,
  nbytes,
  shard_shape,
)
from flax_shardmeta._planning.format import format_table
from flax_shardmeta._sharding import LeafLayout, lay_out
from flax_shardmeta._specs import json_entry
from flax_shardmeta._typing import AnyMesh, LogicalRules, PyTree
from flax_shardmeta._units import format_bytes
from flax_shardmeta._validate import replicate_option, warn_replicated
from flax_shardmeta._views import ShownWithTreescope


class ShardingPlan(ShownWithTreescope):
  """Every array leaf of a tree with its layout on a mesh, totals and problems.

  Problems are found when the plan is made; entries (with their paths), totals
  and the lines of what ``replicate_indivisible`` changed are made on first
  read, so a plan of a large tree costs little more than
  :func:`flax_shardmeta.get_sharding` when only its shardings are used.

  Attributes:
    entries: one :class:`PlanEntry` per array leaf, in tree order.
    mesh: the mesh planned for (concrete or abstract).
    rules: the logical axis rules used.
    problems: every validation problem, each naming its path.
    adjustments: what ``replicate_indivisible`` changed, as ``'path: change'``
      lines.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import flax_shardmeta as fsm
    >>> mesh = jax.sharding.AbstractMesh(
    ...     (4,), ('model',), axis_types=(jax.sharding.AxisType.Auto,))
    >>> tree = {'w': fsm.Partitioned(
    ...     jax.ShapeDtypeStruct((8, 6), jnp.float32), ('model', None))}
    >>> p = fsm.plan(tree, mesh)
    >>> p.bytes_per_device, p.total_bytes, p.problems
    (48, 192, ())
    >>> print(p)  # doctest: +NORMALIZE_WHITESPACE
    Sharding plan: 1 arrays on mesh model=4 (4 devices), 0 rules
    ...
    total: 48 elements, 192 B unsharded, 48 B per device
    problems: none
  """

  __slots__ = (
    '_mesh',
    '_rules',
    '_source',
    '_problems',
    '_leaves',
    '_layouts',
    '_adjusted',
    '_build',
    '_entries',
    '_adjustments',
    '_totals',
  )

  def __init__(
    self,
    mesh: AnyMesh,
    rules: tuple[tuple[str, Any], ...],
    source: str,
    problems: tuple[ShardingProblem, ...],
    leaves: list[ann_lib.Leaf],
    layouts: list[LeafLayout],
    adjusted: list[tuple[ann_lib.Leaf, tuple[str, ...]]],
    build: Callable[[list[Any]], PyTree],
  ):
    """Made by :func:`plan`; not meant to be called directly."""
    self._mesh = mesh
    self._rules = rules
    self._source = source
    self._problems = problems
    self._leaves = leaves
    self._layouts = layouts
    self._adjusted = adjusted
    self._build = build
    self._entries: tuple[PlanEntry, ...] | None = None
    self._adjustments: tuple[str, ...] | None = None
    self._totals: tuple[int, int] | None = None

  @property
  def mesh(self) -> AnyMesh:
    """The mesh planned for (concrete or abstract)."""
    return self._mesh

  @property
  def rules(self) -> tuple[tuple[str, Any], ...]:
    """The logical axis rules used."""
    return self._rules

  @property
  def problems(self) -> tuple[ShardingProblem, ...]:
    """Every validation problem, each naming its path."""
    return self._problems

  @property
  def entries(self) -> tuple[PlanEntry, ...]:
    """One :class:`PlanEntry` per array leaf, in tree order (made on first read)."""
    if self._entries is None:
      with paused_gc():  # one entry and one path per leaf
        self._entries = make_entries(
          self._leaves, self._layouts, self._mesh, self._rules, self._source
        )
    return self._entries

  @property
  def adjustments(self) -> tuple[str, ...]:
    """What ``replicate_indivisible`` changed, as ``'path: change'`` lines."""
    if self._adjustments is None:
      self._adjustments = tuple(
        f'{lf.path}: {a}' for lf, changes in self._adjusted for a in changes
      )
    return self._adjustments

  @property
  def bytes_per_device(self) -> int:
    """Bytes each device holds for all planned arrays."""
    return self._sums()[0]

  @property
  def total_bytes(self) -> int:
    """Bytes of all arrays, unsharded."""
    return self._sums()[1]

  def _sums(self) -> tuple[int, int]:
    """(bytes per device, total bytes), from each distinct layout and dtype."""
    if self._totals is None:
      sizes = mesh_sizes(self._mesh)
      counts: dict[tuple[int, Any], int] = {}
      for lf, lay in zip(self._leaves, self._layouts):
        if lay.shape is not None:
          key = (id(lay), getattr(lf.value, 'dtype', None))
          counts[key] = counts.get(key, 0) + 1
      by_id = {id(lay): lay for lay in self._layouts}
      per_device = total = 0
      for (layout_id, dtype), n in counts.items():
        lay = by_id[layout_id]
        shape = lay.shape or ()
        per_device += n * nbytes(shard_shape(shape, lay.spec, sizes), dtype)
        total += n * nbytes(shape, dtype)
      self._totals = (per_device, total)
    return self._totals

  @property
  def num_devices(self) -> int:
    """Devices in the mesh."""
    return math.prod(self.mesh.axis_sizes)

  def num_elements(self, prefix: str = '') -> int:
    """Elements of the entries whose path starts with ``prefix`` (all by default).

    Example: ``plan.num_elements('params/')`` counts the parameters of a
    TrainState or of ``{'params': ...}``.
    """
    return sum(e.size for e in self.entries if e.path.startswith(prefix))

  def entry(self, path: str) -> PlanEntry:
    """The entry at ``path``; KeyError listing a few known paths otherwise."""
    for e in self.entries:
      if e.path == path:
        return e
    known = ', '.join(e.path for e in self.entries[:5])
    raise KeyError(f'No array at {path!r} in this plan; paths look like: {known}')

  def shardings(self) -> PyTree:
    """The planned ``NamedSharding`` per array leaf (None elsewhere).

    Raises:
      ShardingError: if the plan has problems.
    """
    self._require_valid()
    # Without problems every array's layout holds its NamedSharding.
    with paused_gc():
      return self._build([lay.sharding for lay in self._layouts])

  def _require_valid(self) -> None:
    if self.problems:
      raise ShardingError(self.problems)

  def to_dict(self) -> dict[str, Any]:
    """JSON-serializable form (see the CLI's ``--format json``)."""
    return {
      'mesh': dict(zip(self.mesh.axis_names, self.mesh.axis_sizes)),
      'rules': [[n, json_entry(t)] for n, t in self.rules],
      'entries': [e.to_dict() for e in self.entries],
      'bytes_per_device': self.bytes_per_device,
      'total_bytes': self.total_bytes,
      'problems': [p.to_dict() for p in self.problems],
      'adjustments': list(self.adjustments),
    }

  def __str__(self) -> str:
    return format_table(self)

  def __repr__(self) -> str:
    mesh = dict(zip(self.mesh.axis_names, self.mesh.axis_sizes))
    return (
      f'ShardingPlan({len(self.entries)} arrays, mesh={mesh}, '
      f'bytes_per_device={self.bytes_per_device}, '
      f'total_bytes={self.total_bytes}, problems={len(self.problems)}, '
      f'adjustments={len(self.adjustments)})'
    )

  def _treescope_view(self) -> dict[str, Any]:
    modules = nest((e.path, e) for e in self.entries)
    return {
      'mesh': dict(zip(self.mesh.axis_names, self.mesh.axis_sizes)),
      'bytes_per_device': format_bytes(self.bytes_per_device),
      'total_bytes': format_bytes(self.total_bytes),
      'problems': [str(p) for p in self.problems],
      'adjustments': list(self.adjustments),
      'entries': modules,
    }


def plan(
  tree: PyTree,
  mesh: AnyMesh,
  rules: LogicalRules | None = None,
  *,
  replicate_indivisible: bool = False,
  strict: bool = False,
  fit: bool | None = None,
) -> ShardingPlan:
  """Lays out every array leaf of ``tree`` on ``mesh`` without touching devices.

  Problems do not raise: they are collected in ``plan.problems`` so the whole
  picture is visible at once.

  Args:
    tree: an abstract (or concrete) tree: Linen variables, a TrainState, optax
      states, an NNX State.
    mesh: a ``Mesh`` or an ``AbstractMesh`` of any size.
    rules: logical axis rules; None uses the context rules.
    replicate_indivisible: replicate dimensions their mesh axes cannot divide
      instead of reporting them; changes go to ``plan.adjustments`` and one
      :class:`IndivisibleDimensionWarning`.
    strict: a logical name no usable rule maps is a problem instead of being
      replicated (see :func:`flax_shardmeta.get_sharding`).
    fit: the former name of ``replicate_indivisible`` (deprecated).

  Returns:
    The :class:`ShardingPlan`.

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> mesh = jax.sharding.AbstractMesh((64, 16), ('data', 'model'))
    >>> tree = {'w': fsm.LogicalPartitioned(
    ...     jax.ShapeDtypeStruct((1024, 4096), jnp.float32), ('embed', 'mlp'))}
    >>> p = fsm.plan(tree, mesh, [('embed', 'data'), ('mlp', 'model')])
    >>> p.entries[0].spec, p.entries[0].shard_shape, p.bytes_per_device
    (P('data', 'model'), (16, 256), 16384)
  """
  replicate = replicate_option(replicate_indivisible, fit, 'plan')
  mesh = check_mesh(mesh, 'plan')
  # A plan collects every problem, malformed names among them.
  laid = lay_out(
    tree, mesh, rules, replicate=replicate, strict=strict, names_first=False
  )
  if laid.adjusted:
    warn_replicated(laid.adjusted)
  return ShardingPlan(
    mesh,
    laid.rules,
    laid.source,
    tuple(laid.problems),
    laid.leaves,
    laid.every_layout(),
    laid.adjusted,
    laid.build,
  )
