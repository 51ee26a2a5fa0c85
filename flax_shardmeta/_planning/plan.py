"""Sharding plans: every array's layout, memory and problems, before anything runs.

A plan is computed from an abstract tree (``jax.eval_shape`` output, a
TrainState, an NNX State) and a mesh that may be abstract and far larger than
the machine. Layouts come from :mod:`flax_shardmeta.sharding`, which caches
them per distinct pattern, so a 126-layer model costs about as much as one
layer. Only problems are found up front: entries, their paths, totals and
explanations are made when first read, so a plan costs little more than the
shardings themselves.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

from jax.sharding import PartitionSpec, Sharding

from flax_shardmeta import _annotation as ann_lib
from flax_shardmeta._caches import paused_gc
from flax_shardmeta._errors import ShardingError, ShardingProblem
from flax_shardmeta._placement import check_mesh
from flax_shardmeta._planning import format as plan_format
from flax_shardmeta._planning.explain import explain_entry
from flax_shardmeta._rules import SOURCE_NONE, Explanation, rules_and_source
from flax_shardmeta._sharding import (
  LeafLayout,
  layout_tree,
  named_sharding,
  problems_of,
  unmapped_record,
  warn_adjustments,
)
from flax_shardmeta._specs import (
  format_spec,
  json_entry,
  mesh_axes_of,
  spec_entries,
  spec_sets,
)
from flax_shardmeta._typing import AnyMesh, LogicalRules, PyTree
from flax_shardmeta._unmapped import Unmapped
from flax_shardmeta._unmapped import report as report_unmapped


@dataclasses.dataclass(frozen=True, slots=True)
class PlanEntry:
  """The planned layout of one array leaf.

  Attributes:
    path: '/'-joined key path, e.g. ``params/layers/wq``.
    shape: the global shape.
    dtype: the element type.
    names: the annotation as written, or None for an unannotated leaf.
    spec: the resolved PartitionSpec (None when it could not be resolved).
    shard_shape: the shape each device holds.
    bytes_per_device: bytes of this array on each device.
    adjustments: what fit mode changed, one sentence each.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import flax_shardmeta as fsm
    >>> mesh = jax.sharding.AbstractMesh(
    ...     (4,), ('model',), axis_types=(jax.sharding.AxisType.Auto,))
    >>> tree = {'w': fsm.Partitioned(
    ...     jax.ShapeDtypeStruct((8, 6), jnp.float32), ('model', None))}
    >>> entry = fsm.plan(tree, mesh).entry('w')
    >>> entry.spec, entry.shard_shape, entry.bytes_per_device
    (P('model', None), (2, 6), 48)
  """

  path: str
  shape: tuple[int, ...]
  dtype: Any
  names: tuple[Any, ...] | None
  spec: PartitionSpec | None
  shard_shape: tuple[int, ...]
  bytes_per_device: int
  adjustments: tuple[str, ...] = ()
  annotation: ann_lib.Annotation | None = dataclasses.field(
    default=None, repr=False, compare=False
  )
  rules: tuple[tuple[str, Any], ...] = dataclasses.field(
    default=(), repr=False, compare=False
  )
  mesh_axis_names: tuple[str, ...] = dataclasses.field(
    default=(), repr=False, compare=False
  )
  rules_source: str = dataclasses.field(default='', repr=False, compare=False)

  @property
  def size(self) -> int:
    """Number of elements."""
    return math.prod(self.shape)

  @property
  def nbytes(self) -> int:
    """Bytes of the whole (global) array."""
    return self.size * _itemsize(self.dtype)

  @property
  def explain(self) -> Explanation:
    """Per dimension: which rule gave the mesh axes, which were skipped and why.

    Computed on first read, not when the plan is made.
    """
    return explain_entry(
      self.shape,
      self.annotation,
      self.rules,
      self.mesh_axis_names,
      self.spec,
      self.rules_source,
    )

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form."""
    return {
      'path': self.path,
      'shape': list(self.shape),
      'dtype': str(self.dtype),
      'names': _json_entries(self.names),
      'spec': _json_entries(self.spec),
      'shard_shape': list(self.shard_shape),
      'bytes_per_device': self.bytes_per_device,
      # Only present when the spec has them, as PartitionSpec shows them.
      **{
        kind: sorted(axes)
        for kind, axes in zip(('unreduced', 'reduced'), spec_sets(self.spec))
        if axes
      },
    }

  def __treescope_repr__(self, path: str, subtree_renderer: Any) -> Any:
    import treescope  # only for notebooks: keeps the CLI start-up light

    return treescope.repr_lib.render_object_constructor(
      object_type=type(self),
      attributes={
        'shape': self.shape,
        'dtype': str(self.dtype),
        'names': self.names,
        'spec': format_spec(self.spec),
        'shard_shape': self.shard_shape,
        'per_device': plan_format.format_bytes(self.bytes_per_device),
      },
      path=path,
      subtree_renderer=subtree_renderer,
    )


@dataclasses.dataclass(frozen=True)
class Mismatch:
  """An array whose actual sharding differs from its planned one.

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> mesh = jax.make_mesh((2, 4), ('data', 'model'))
    >>> x = jax.device_put(jnp.zeros(8), jax.NamedSharding(mesh, jax.P()))
    >>> (m,) = fsm.verify({'w': x}, {'w': jax.NamedSharding(mesh, jax.P('model'))})
    >>> m.path, m.shape, str(m)
    ('w', (8,), "w: planned P('model'), found P()")
  """

  path: str
  expected: Sharding | None
  actual: Sharding | None
  shape: tuple[int, ...] | None = None

  def __str__(self) -> str:
    return (
      f'{self.path}: planned {_spec_of(self.expected)}, found {_spec_of(self.actual)}'
    )


class Mismatches(list):
  """What :func:`verify` returns: a list of :class:`Mismatch`, printed as a table.

  Compares, iterates and indexes like the list it is; ``str`` (and so
  ``print``) renders the differences as a table like a plan's.

  Attributes:
    checked: how many arrays were compared.

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> mesh = jax.make_mesh((2, 4), ('data', 'model'))
    >>> x = jax.device_put(jnp.zeros(8), jax.NamedSharding(mesh, jax.P('model')))
    >>> found = fsm.verify({'w': x}, {'w': jax.NamedSharding(mesh, jax.P('model'))})
    >>> found == [], found.checked
    (True, 1)
  """

  def __init__(self, mismatches: Sequence[Mismatch] = (), checked: int = 0):
    super().__init__(mismatches)
    self.checked = checked

  def __str__(self) -> str:
    return plan_format.format_mismatches(self, self.checked)


class ShardingPlan:
  """Every array leaf of a tree with its layout on a mesh, totals and problems.

  Problems are found when the plan is made; entries (with their paths), totals
  and fit-mode adjustment lines are made on first read, so a plan of a large
  tree costs little more than :func:`flax_shardmeta.get_sharding` when only
  its shardings are used.

  Attributes:
    entries: one :class:`PlanEntry` per array leaf, in tree order.
    mesh: the mesh planned for (concrete or abstract).
    rules: the logical axis rules used.
    problems: every validation problem, each naming its path.
    adjustments: what fit mode changed, as ``'path: change'`` lines.

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
        self._entries = _entries(
          self._leaves, self._layouts, self._mesh, self._rules, self._source
        )
    return self._entries

  @property
  def adjustments(self) -> tuple[str, ...]:
    """What fit mode changed, as ``'path: change'`` lines."""
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
      sizes = _mesh_sizes(self._mesh)
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
        itemsize = _itemsize(dtype)
        per_device += n * math.prod(_shard_shape(shape, lay.spec, sizes)) * itemsize
        total += n * math.prod(shape) * itemsize
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
    return plan_format.format_table(self)

  def __repr__(self) -> str:
    mesh = dict(zip(self.mesh.axis_names, self.mesh.axis_sizes))
    return (
      f'ShardingPlan({len(self.entries)} arrays, mesh={mesh}, '
      f'bytes_per_device={self.bytes_per_device}, '
      f'total_bytes={self.total_bytes}, problems={len(self.problems)}, '
      f'adjustments={len(self.adjustments)})'
    )

  def _treescope_view(self) -> dict[str, Any]:
    modules: dict[str, Any] = {}
    for e in self.entries:
      node = modules
      *parents, leaf = e.path.split('/')
      for p in parents:
        node = node.setdefault(p, {})
      node[leaf] = e
    return {
      'mesh': dict(zip(self.mesh.axis_names, self.mesh.axis_sizes)),
      'bytes_per_device': plan_format.format_bytes(self.bytes_per_device),
      'total_bytes': plan_format.format_bytes(self.total_bytes),
      'problems': [str(p) for p in self.problems],
      'adjustments': list(self.adjustments),
      'entries': modules,
    }

  def _repr_html_(self) -> str:
    import treescope

    return treescope.render_to_html(self._treescope_view())

  def show(self) -> None:
    """Displays the plan as an interactive treescope tree in a notebook (the
    table where only text can be shown).

    Outside a running IPython shell (where treescope has nowhere to display)
    prints the table instead. Whether IPython is merely installed does not
    matter: the decision is made by ``get_ipython()``.
    """
    if _ipython_shell() is None:
      print(self)
      return
    from IPython.display import display

    # The table is the plain-text fallback: treescope's own would put whole
    # modules on one line of several hundred characters.
    display({'text/html': self._repr_html_(), 'text/plain': str(self)}, raw=True)


def _ipython_shell() -> Any:
  """The running IPython shell, or None (also when IPython is not installed)."""
  try:
    from IPython import get_ipython
  except ImportError:
    return None
  return get_ipython()


def plan(
  tree: PyTree,
  mesh: AnyMesh,
  rules: LogicalRules | None = None,
  *,
  fit: bool = False,
  strict: bool = False,
) -> ShardingPlan:
  """Lays out every array leaf of ``tree`` on ``mesh`` without touching devices.

  Problems do not raise: they are collected in ``plan.problems`` so the whole
  picture is visible at once.

  Args:
    tree: an abstract (or concrete) tree: Linen variables, a TrainState, optax
      states, an NNX State.
    mesh: a ``Mesh`` or an ``AbstractMesh`` of any size.
    rules: logical axis rules; None uses the context rules.
    fit: replicate dimensions their mesh axes cannot divide instead of
      reporting them; changes go to ``plan.adjustments`` and one warning.
    strict: a logical name no usable rule maps is a problem instead of being
      replicated (see :func:`flax_shardmeta.get_sharding`).

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
  mesh = check_mesh(mesh, 'plan')
  rules_t, source = rules_and_source(rules)
  leaves, layouts, build = layout_tree(tree, mesh, rules_t, fit)
  problems: list[ShardingProblem] = []
  adjusted: list[tuple[ann_lib.Leaf, tuple[str, ...]]] = []
  unmapped: list[Unmapped] = []
  # Paths are made only for leaves that something is reported about.
  for lf, lay in zip(leaves, layouts):
    if lay.adjustments:
      adjusted.append((lf, lay.adjustments))
    if lay.issues:
      problems.extend(problems_of(lf.path, lf, lay))
    if lay.unmapped and lf.annotation is not None:  # only annotations map names
      unmapped.append(unmapped_record(lf, lay, rules_t))
  problems += report_unmapped(
    unmapped, tuple(mesh.axis_names), strict, no_rules=source == SOURCE_NONE
  )
  if adjusted:
    warn_adjustments(adjusted)
  return ShardingPlan(
    mesh, rules_t, source, tuple(problems), leaves, layouts, adjusted, build
  )


def verify(arrays: PyTree, plan_or_shardings: ShardingPlan | PyTree) -> Mismatches:
  """The arrays whose actual sharding differs from the planned one.

  Args:
    arrays: the concrete tree (boxes, TrainState, NNX State...).
    plan_or_shardings: a :class:`ShardingPlan`, or a tree of shardings such
      as :func:`flax_shardmeta.get_sharding` returns.

  Returns:
    One :class:`Mismatch` per differing array, with its path; empty when all
    match. Shardings are compared with ``Sharding.is_equivalent_to``.
    ``print`` shows the differences as a table (path, shape, planned spec,
    actual spec).

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> mesh = jax.make_mesh((8,), ('data',))
    >>> x = {'w': jax.device_put(jnp.zeros((8, 2)), jax.NamedSharding(mesh, jax.P()))}
    >>> fsm.verify(x, fsm.plan(x, mesh))
    []
    >>> print(fsm.verify(x, {'w': jax.NamedSharding(mesh, jax.P('data'))}))
    1 of 1 arrays differ from the plan:
    array  shape  planned    actual
    -------------------------------
    w      8x2    P('data')  P()
  """
  if isinstance(plan_or_shardings, ShardingPlan):
    p = plan_or_shardings
    expected = {
      e.path: named_sharding(p.mesh, e.spec) for e in p.entries if e.spec is not None
    }
  else:
    sh_leaves, _ = ann_lib.walk(plan_or_shardings, every_path=True)
    expected = {lf.path: lf.value for lf in sh_leaves if isinstance(lf.value, Sharding)}
  leaves, _ = ann_lib.walk(arrays, every_path=True)
  out: list[Mismatch] = []
  checked = 0
  for lf in leaves:
    shape = getattr(lf.value, 'shape', None)
    if shape is None:
      continue
    checked += 1
    want = expected.get(lf.path)
    have = getattr(lf.value, 'sharding', None)
    if want is None or have is None or not _same(have, want, len(shape)):
      out.append(Mismatch(lf.path, want, have, tuple(shape)))
  return Mismatches(out, checked)


def _same(have: Sharding, want: Sharding, rank: int) -> bool:
  # is_equivalent_to compares device layouts, where unreduced / reduced axes
  # do not show; the plan holds them, so they are compared too.
  sets = (spec_sets(getattr(s, 'spec', None)) for s in (have, want))
  return have.is_equivalent_to(want, rank) and next(sets) == next(sets)


def actual_shardings(tree: PyTree) -> PyTree:
  """Each array's actual sharding, read back from the arrays themselves.

  The inverse of :func:`flax_shardmeta.get_sharding`: where that computes the
  layouts annotations ask for, this reads the layouts arrays have (usually a
  ``NamedSharding``; its ``.spec`` is the PartitionSpec). Host values (NumPy
  arrays, Python scalars) and non-array leaves give None. Boxes and NNX
  Variables are read through, and the result has the structure
  ``get_sharding`` would give, so the two compare leaf by leaf.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, flax_shardmeta as fsm
    >>> mesh = jax.make_mesh((8,), ('data',))
    >>> x = jax.device_put(jnp.zeros((8, 2)), jax.NamedSharding(mesh, jax.P('data')))
    >>> out = fsm.actual_shardings({'x': x, 'host': np.zeros(3), 'step': 1})
    >>> out['x'].spec, out['host'], out['step']
    (P('data',), None, None)
  """
  leaves, build = ann_lib.walk(tree)
  return build([_sharding_of(lf.value) for lf in leaves])


def _sharding_of(value: Any) -> Sharding | None:
  sharding = getattr(value, 'sharding', None)
  return sharding if isinstance(sharding, Sharding) else None


# Helpers
# ------------------------------------------------------------------------------


def _itemsize(dtype: Any) -> int:
  return int(getattr(dtype, 'itemsize', 0) or 0)


def _mesh_sizes(mesh: AnyMesh) -> tuple[tuple[str, int], ...]:
  return tuple(zip(mesh.axis_names, mesh.axis_sizes))


def _entries(
  leaves: list[ann_lib.Leaf],
  layouts: list[LeafLayout],
  mesh: AnyMesh,
  rules: tuple[tuple[str, Any], ...],
  source: str,
) -> tuple[PlanEntry, ...]:
  """One PlanEntry per array leaf; what does not depend on the path is made
  once per distinct (layout, dtype, annotation)."""
  sizes = _mesh_sizes(mesh)
  axis_names = tuple(mesh.axis_names)
  arrays = [i for i, lay in enumerate(layouts) if lay.shape is not None]
  paths = ann_lib.paths_of([leaves[i] for i in arrays])
  shared: dict[tuple[int, Any, int], tuple[Any, ...]] = {}
  out = []
  for path, i in zip(paths, arrays):
    lf, lay = leaves[i], layouts[i]
    dtype = getattr(lf.value, 'dtype', None)
    ann = lf.annotation
    # The plan keeps layouts and annotations alive, so their ids stay unique.
    key = (id(lay), dtype, id(ann))
    fields: tuple[Any, ...] | None = shared.get(key)
    if fields is None:
      shape = lay.shape or ()
      shard = _shard_shape(shape, lay.spec, sizes)
      names = ann.names if ann is not None and len(ann.names) == len(shape) else None
      nbytes = math.prod(shard) * _itemsize(dtype)
      # In PlanEntry's field order, after the path.
      fields = shared[key] = (
        shape,
        dtype,
        names,
        lay.spec,
        shard,
        nbytes,
        lay.adjustments,
        ann,
        rules,
        axis_names,
        source,
      )
    out.append(PlanEntry(path, *fields))
  return tuple(out)


@functools.lru_cache(maxsize=16384)
def _shard_shape(
  shape: tuple[int, ...],
  spec: PartitionSpec | None,
  mesh_sizes: tuple[tuple[str, int], ...],
) -> tuple[int, ...]:
  sizes = dict(mesh_sizes)
  if spec is None:
    return shape
  entries = spec_entries(spec)
  out = []
  for dim, n in enumerate(shape):
    entry = entries[dim] if dim < len(entries) else None
    factor = math.prod(sizes.get(a, 1) for a in mesh_axes_of(entry))
    # Uneven shards (only in plans with problems) hold the padded size.
    out.append(-(-n // factor))
  return tuple(out)


def _json_entries(spec: Any) -> list[Any] | None:
  return None if spec is None else [json_entry(e) for e in spec_entries(spec)]


def _spec_of(s: Sharding | None) -> str:
  if s is None:
    return 'no sharding'
  spec = getattr(s, 'spec', None)
  return format_spec(spec) if spec is not None else repr(s)
