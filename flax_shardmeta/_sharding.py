"""From annotations to validated ``NamedSharding`` trees.

Each distinct (shape, annotation, rules, mesh) is resolved and validated once
and cached: models repeat a handful of annotation patterns thousands of times.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from flax_shardmeta import _annotation as ann_lib
from flax_shardmeta import _unmapped as unmapped_lib
from flax_shardmeta._caches import paused_gc
from flax_shardmeta._errors import (
  FlaxShardmetaError,
  InvalidNamesError,
  ShardingError,
  ShardingFitWarning,
  ShardingProblem,
)
from flax_shardmeta._placement import check_mesh
from flax_shardmeta._rules import (
  SOURCE_NONE,
  check_entries,
  composite_rules,
  get_logical_axis_rules,
  normalize_rules,
  resolve,
  rules_and_source,
)
from flax_shardmeta._specs import (
  UNASSIGNED,
  UNCONSTRAINED,
  make_spec,
  mesh_axes_of,
  reductions_of,
  spec_entries,
  spec_sets,
  unassigned_to_none,
)
from flax_shardmeta._typing import AnyMesh, LogicalRules, PyTree
from flax_shardmeta._validate import (
  check_spec,
  fit_spec,
  rank_issue,
  unconstrained_issue,
)


@dataclasses.dataclass(frozen=True)
class LeafLayout:
  """The resolved layout of one leaf (path-free, so it can be cached).

  Attributes:
    shape: the leaf's shape, or None for a non-array leaf.
    spec: the resolved PartitionSpec, or None for a non-array leaf.
    issues: ``(reason, hint, dims)`` problems left after any fitting.
    adjustments: what fit mode changed, one sentence each.
    sharding: ``NamedSharding(mesh, spec)`` when the layout is valid.
    unmapped: logical names no rule maps (replicated), in dimension order.
    names_error: the issue is malformed names (an InvalidNamesError).
  """

  shape: tuple[int, ...] | None
  spec: PartitionSpec | None
  issues: tuple[tuple[str, str, tuple[int, ...]], ...] = ()
  adjustments: tuple[str, ...] = ()
  sharding: NamedSharding | None = None
  unmapped: tuple[str, ...] = ()
  names_error: bool = False


def leaf_shape(value: Any) -> tuple[int, ...] | None:
  """Shape of an array-like leaf (arrays, ShapeDtypeStruct), else None."""
  shape = getattr(value, 'shape', None)
  return shape if shape is None or type(shape) is tuple else tuple(shape)


def effective_rules(rules: LogicalRules | None) -> tuple[tuple[str, Any], ...]:
  """The explicit rules if given, else the context rules."""
  return normalize_rules(rules) if rules is not None else get_logical_axis_rules()


def layout_of(
  shape: tuple[int, ...] | None,
  annotation: ann_lib.Annotation | None,
  mesh: AnyMesh,
  rules: tuple[tuple[str, Any], ...],
  fit: bool = False,
  *,
  for_constraint: bool = False,
) -> LeafLayout:
  """Resolves and validates one leaf (cached on all arguments).

  ``for_constraint``: the spec is applied as a sharding constraint, where
  UNCONSTRAINED is valid; otherwise it becomes a ``NamedSharding`` for
  ``jit`` / ``device_put``, which refuse it.
  """
  return _layout_cached(shape, annotation, mesh, rules, fit, for_constraint)


@functools.lru_cache(maxsize=65536)
def _layout_cached(shape, annotation, mesh, rules, fit, for_constraint) -> LeafLayout:
  if shape is None:
    return LeafLayout(None, None)
  if annotation is None:
    return LeafLayout(
      shape, PartitionSpec(), sharding=named_sharding(mesh, PartitionSpec())
    )
  names = annotation.names
  try:
    check_entries(names)
  except InvalidNamesError as e:
    return _names_layout(shape, e)
  if len(names) != len(shape):
    if annotation.optimizer_state:
      # Documented rule: optimizer leaves whose rank differs from their
      # parameter (factored moments, counts) are replicated; they are small.
      return LeafLayout(
        shape, PartitionSpec(), sharding=named_sharding(mesh, PartitionSpec())
      )
    return LeafLayout(shape, None, (rank_issue(len(names), len(shape)),))
  try:
    entries = resolve_names(annotation, mesh, rules)
  except InvalidNamesError as e:
    return _names_layout(shape, e)
  except FlaxShardmetaError as e:
    return LeafLayout(
      shape, None, ((str(e).rstrip('.'), 'fix the names or the rules', ()),)
    )
  issues = check_spec(shape, entries, mesh)
  if issues and annotation.optimizer_state:
    # Same rank but another shape (adafactor's v_row/v_col of a rank-1
    # parameter are shape (1,)), or a full-size moment of a parameter whose
    # dimension does not divide. Faults are reported on the parameter itself;
    # here only the dimensions at fault are replicated, so a moment keeps the
    # rest of its parameter's layout (as fit mode gives the parameter).
    bad = {d for _, _, dims in issues for d in dims}
    kept = tuple(None if d in bad else e for d, e in enumerate(entries))
    keep = any(e is not None for e in kept) and not check_spec(shape, kept, mesh)
    spec = PartitionSpec(*kept) if keep else PartitionSpec()
    return LeafLayout(shape, spec, sharding=named_sharding(mesh, spec))
  adjustments: tuple[str, ...] = ()
  if fit and issues:
    entries, issues, adjustments = fit_spec(shape, entries, mesh)
  if not for_constraint:
    open_dims = unconstrained_issue(entries)
    if open_dims is not None and fit:
      entries = tuple(None if e is UNCONSTRAINED else e for e in entries)
      adjustments += tuple(
        f'dimension {d}: UNCONSTRAINED -> None (a NamedSharding cannot leave '
        'a dimension to the compiler)'
        for d in open_dims[2]
      )
    elif open_dims is not None:
      issues += (open_dims,)
  # A moment is stored reduced, whatever its parameter's gradient is.
  reductions = None if annotation.optimizer_state else annotation.reductions
  issues += _set_issues(entries, reductions, mesh)
  spec = make_spec(entries, None if issues else reductions)
  unmapped = () if annotation.optimizer_state else unmapped_of(annotation, mesh, rules)
  return LeafLayout(
    shape,
    spec,
    issues,
    adjustments,
    None if issues else named_sharding(mesh, spec),
    unmapped,
  )


def _set_issues(
  entries: tuple[Any, ...], reductions: Any, mesh: AnyMesh
) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
  """Problems with a spec's unreduced / reduced axes, which jax checks too."""
  if reductions is None:
    return ()
  unreduced, reduced = spec_sets(reductions)
  issues = []
  kinds = dict(zip(mesh.axis_names, mesh.axis_types))
  used = {a for e in entries for a in mesh_axes_of(e)}
  for kind, axes in (('unreduced', unreduced), ('reduced', reduced)):
    for axis in sorted(axes):
      if axis not in kinds:
        reason = f'{kind} axis {axis!r} is not a mesh axis {tuple(kinds)}'
      elif kinds[axis] != AxisType.Explicit:
        reason = f'{kind} axis {axis!r} is {kinds[axis].name}; jax needs it Explicit'
      elif axis in used:
        reason = f'{kind} axis {axis!r} also shards a dimension'
      else:
        continue
      hint = f'make {axis!r} an Explicit mesh axis, or drop it from {kind}'
      issues.append((reason, hint, ()))
  return tuple(issues)


def _names_layout(
  shape: tuple[int, ...] | None, error: InvalidNamesError
) -> LeafLayout:
  return LeafLayout(
    shape,
    None,
    (
      (
        str(error).rstrip('.'),
        'fix the annotation where the parameter is made',
        (),
      ),
    ),
    names_error=True,
  )


@functools.lru_cache(maxsize=4096)
def spec_layout(spec: PartitionSpec, mesh: AnyMesh) -> LeafLayout:
  """A bare PartitionSpec leaf (as ``match_partition_rules`` gives): mesh axes,
  checked against the mesh (the array's shape is unknown here)."""
  entries = tuple(spec)
  try:
    check_entries(entries)
  except InvalidNamesError as e:
    return _names_layout(None, e)
  # A shape as large as needed makes only the mesh-axis checks bite.
  issues = check_spec((0,) * len(entries), entries, mesh)
  return LeafLayout(
    None, spec, issues, sharding=None if issues else named_sharding(mesh, spec)
  )


def resolve_names(
  annotation: ann_lib.Annotation,
  mesh: AnyMesh | None,
  rules: tuple[tuple[str, Any], ...],
) -> tuple[Any, ...]:
  """Per-dimension mesh axes for an annotation (mesh names pass through)."""
  if not annotation.logical:
    return annotation.names
  resolved = resolve(annotation.names, composite_rules(rules, annotation.rules))
  mesh_axes = set(mesh.axis_names) if mesh is not None else set()
  return tuple(
    (n if annotation.keep_mesh_names and n in mesh_axes else None)
    if r is UNASSIGNED
    else r
    for n, r in zip(annotation.names, resolved)
  )


def unmapped_of(
  annotation: ann_lib.Annotation,
  mesh: AnyMesh | None,
  rules: tuple[tuple[str, Any], ...],
) -> tuple[str, ...]:
  """The annotation's logical names that no rule maps, so are replicated.

  Names flax's own NNX annotations keep as mesh axes are not replicated, so
  they are not listed.
  """
  if not annotation.logical:
    return ()
  resolved = resolve(annotation.names, composite_rules(rules, annotation.rules))
  missing = unmapped_lib.unmapped_names(annotation.names, resolved, UNASSIGNED)
  if missing and annotation.keep_mesh_names and mesh is not None:
    missing = tuple(n for n in missing if n not in mesh.axis_names)
  return missing


@functools.lru_cache(maxsize=16384)
def named_sharding(mesh: AnyMesh, spec: PartitionSpec) -> NamedSharding:
  """Cached ``NamedSharding(mesh, spec)``."""
  return NamedSharding(mesh, spec)


def problems_of(
  path: str, leaf: ann_lib.Leaf, layout: LeafLayout
) -> list[ShardingProblem]:
  """The layout's issues as path-named problems."""
  names = leaf.annotation.names if leaf.annotation is not None else None
  return [
    ShardingProblem(path, layout.shape, names, layout.spec, r, h, d)
    for r, h, d in layout.issues
  ]


def layout_tree(
  tree: PyTree,
  mesh: AnyMesh,
  rules: LogicalRules | None = None,
  fit: bool = False,
  *,
  every_path: bool = False,
) -> tuple[list[ann_lib.Leaf], list[LeafLayout], Any]:
  """Walks ``tree`` and lays out every leaf; returns leaves, layouts, builder.

  ``every_path``: the caller reads every leaf's path (see ``walk``).
  """
  rules_t = effective_rules(rules)
  with paused_gc():  # a few objects per leaf: see _caches
    leaves, build = ann_lib.walk(tree, every_path)
    # mesh, rules and fit are fixed for this call: memoize on what varies.
    memo: dict[Any, LeafLayout] = {}
    layouts = []
    for lf in leaves:
      if isinstance(lf.value, PartitionSpec):
        layouts.append(spec_layout(lf.value, mesh))
        continue
      key = (leaf_shape(lf.value), lf.annotation)
      layout = memo.get(key)
      if layout is None:
        layout = memo[key] = layout_of(key[0], key[1], mesh, rules_t, fit)
      layouts.append(layout)
  return leaves, layouts, build


def get_sharding(
  tree: PyTree,
  mesh: AnyMesh,
  rules: LogicalRules | None = None,
  *,
  fit: bool = False,
  strict: bool = False,
) -> PyTree:
  """A ``NamedSharding`` for every array leaf of ``tree``, validated.

  Partitioned names are mesh axes; LogicalPartitioned names resolve through
  ``composite_rules(rules or context rules, box.rules)``. Plain arrays are
  replicated, non-array leaves map to None. Works on ``jax.eval_shape``
  output, TrainStates, optax states (see :func:`get_partition_spec` for the
  optimizer-state rule) and flax's own boxes. A bare ``PartitionSpec`` leaf
  (a tree of them, as :func:`match_partition_rules` gives) is read as mesh
  axes and checked against the mesh only, its array being unknown.

  A logical name no rule maps is replicated; if it is also a mesh-axis name
  an :class:`UnmappedMeshAxisNameWarning` says so (once per name, listing the
  parameters), and so does an :class:`UnmappedNameWarning` if it is close to a
  rule's name or if no rules are given or set at all.

  Args:
    tree: the (abstract) variables, train state or NNX state.
    mesh: a ``Mesh`` or ``AbstractMesh``.
    rules: logical axis rules; None uses the context rules.
    fit: replicate dimensions their mesh axes cannot divide (or axes the mesh
      lacks, or UNCONSTRAINED entries) instead of failing; the changes are
      listed in one :class:`ShardingFitWarning`.
    strict: a logical name no usable rule maps is a problem (raised with the
      others) instead of being replicated.

  Returns:
    A tree of the same structure with NamedSharding (or None) leaves.

  Raises:
    ShardingError: listing every leaf that cannot be sharded, by path.
    InvalidNamesError: listing every leaf whose names are malformed.
    NoMeshError: ``mesh`` is None or not a mesh.

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
    >>> tree = {'w': fsm.LogicalPartitioned(
    ...     jax.ShapeDtypeStruct((8, 16), jnp.float32), ('embed', 'mlp'))}
    >>> fsm.get_sharding(tree, mesh, [('mlp', 'model')])['w'].spec
    P(None, 'model')
  """
  mesh = check_mesh(mesh, 'get_sharding')
  rules_t, source = rules_and_source(rules)
  leaves, layouts, build = layout_tree(tree, mesh, rules_t, fit)
  problems: list[ShardingProblem] = []
  bad_names: list[ShardingProblem] = []
  adjusted: list[tuple[ann_lib.Leaf, tuple[str, ...]]] = []
  unmapped: list[unmapped_lib.Unmapped] = []
  results: list[Any] = []
  for lf, lay in zip(leaves, layouts):
    if lay.adjustments:
      adjusted.append((lf, lay.adjustments))
    if lay.issues:
      (bad_names if lay.names_error else problems).extend(problems_of(lf.path, lf, lay))
    if lay.unmapped:
      unmapped.append(unmapped_record(lf, lay, rules_t))
    results.append(lay.sharding)
  if bad_names:
    raise InvalidNamesError(problems=bad_names)
  problems += unmapped_lib.report(
    unmapped, mesh.axis_names, strict, no_rules=source == SOURCE_NONE
  )
  if problems:
    raise ShardingError(problems)
  if adjusted:
    warn_adjustments(adjusted)
  with paused_gc():
    return build(results)


def unmapped_record(
  lf: ann_lib.Leaf, lay: LeafLayout, rules: tuple[tuple[str, Any], ...]
) -> unmapped_lib.Unmapped:
  """The leaf's unmapped names, its path (and rules) made only if reported."""
  ann = lf.annotation
  names = ann.names if ann is not None else ()
  local = ann.rules if ann is not None else None
  return unmapped_lib.Unmapped(
    lambda: lf.path,
    lay.shape,
    names,
    lay.spec,
    lay.unmapped,
    lambda: composite_rules(rules, local),
  )


MAX_LISTED = 20
"""Fit changes listed one by one in a warning; more are summarised by kind."""


def warn_adjustments(
  adjusted: list[tuple[Any, tuple[str, ...]]], stacklevel: int = 3
) -> None:
  """One :class:`ShardingFitWarning` for every change fit mode made.

  Up to :data:`MAX_LISTED` changes are listed with their paths. Beyond that,
  each kind of change is listed once with its count and a few example paths
  (so a large tree does not pay for thousands of path strings); the warning's
  ``adjustments`` attribute builds the full list when read.

  Args:
    adjusted: ``(leaf, changes)`` pairs, one per leaf fit mode changed; a
      leaf is an annotation walk's Leaf or a path string.
    stacklevel: passed to ``warnings.warn``.
  """

  def path(leaf: Any) -> str:
    return leaf if isinstance(leaf, str) else leaf.path

  def every_change() -> list[str]:
    return [f'{path(lf)}: {a}' for lf, changes in adjusted for a in changes]

  total = sum(len(changes) for _, changes in adjusted)
  head = (
    f'fit=True replicated {total} dimension(s) that could not be sharded as annotated'
  )
  if total <= MAX_LISTED:
    lines = [f'  - {line}' for line in every_change()]
  else:
    by_change: dict[str, list[Any]] = {}
    for lf, changes in adjusted:
      for a in changes:
        by_change.setdefault(a, []).append(lf)
    lines = []
    for change, where in list(by_change.items())[:MAX_LISTED]:
      examples = ', '.join(path(lf) for lf in where[:3])
      more = ', ...' if len(where) > 3 else ''
      lines.append(f'  - {len(where)} x {change}: {examples}{more}')
    if len(by_change) > MAX_LISTED:
      lines.append(f'  - ... and {len(by_change) - MAX_LISTED} more kinds of change')
    lines.append(
      "  (the full list: the warning's `adjustments`, or "
      'fsm.plan(..., fit=True).adjustments)'
    )
  warnings.warn(
    ShardingFitWarning(f'{head}:\n' + '\n'.join(lines), every_change),
    stacklevel=stacklevel,
  )


def get_partition_spec(tree: PyTree) -> PyTree:
  """Each leaf's annotation as written (logical names stay logical).

  Plain arrays and ShapeDtypeStructs get ``PartitionSpec()``, non-array leaves
  None.

  Optimizer state: optax moments built from boxed parameters carry their
  parameter's annotation. When computing shardings, a leaf of an optax state
  whose shape the annotation does not fit (a different rank, as adafactor's
  factored ``v_row`` / ``v_col`` and scalar counts, or size-1 stand-ins such as
  the ``v_row`` of a rank-1 parameter) is replicated; full-rank moments follow
  their parameter.

  Example:
    >>> import jax.numpy as jnp, flax_shardmeta as fsm
    >>> fsm.get_partition_spec({'w': fsm.LogicalPartitioned(
    ...     jnp.zeros((2, 2)), ('embed', 'mlp')), 'b': jnp.zeros(2)})
    {'b': P(), 'w': P('embed', 'mlp')}
  """
  leaves, build = ann_lib.walk(tree)
  out = []
  for lf in leaves:
    if lf.annotation is not None:
      out.append(PartitionSpec(*lf.annotation.names))
    elif leaf_shape(lf.value) is not None:
      out.append(PartitionSpec())
    else:
      out.append(None)
  return build(out)


def _is_spec(x: Any) -> bool:
  return isinstance(x, PartitionSpec)


def logical_to_mesh(
  tree: PyTree, rules: LogicalRules | None = None, *, strict: bool = False
) -> PyTree:
  """Resolves every logical PartitionSpec leaf of ``tree`` to mesh axes.

  A name no rule maps is replicated (with ``strict=True``, a ShardingError);
  if it is an axis of the mesh set by ``jax.set_mesh``, an
  :class:`UnmappedMeshAxisNameWarning` says so.

  Example:
    >>> import flax_shardmeta as fsm
    >>> from jax.sharding import PartitionSpec as P
    >>> fsm.logical_to_mesh({'w': P('embed', 'mlp')}, [('mlp', 'model')])
    {'w': P(None, 'model')}
  """
  mesh = jax.sharding.get_abstract_mesh()
  return _logical_to_mesh(tree, rules, strict, tuple(mesh.axis_names))


def _logical_to_mesh(
  tree: PyTree,
  rules: LogicalRules | None,
  strict: bool,
  mesh_axis_names: tuple[str, ...],
) -> PyTree:
  rules_t, source = rules_and_source(rules)
  flat, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_spec)
  out: list[Any] = []
  unmapped: list[unmapped_lib.Unmapped] = []
  for i, x in enumerate(flat):
    if not _is_spec(x):
      out.append(x)
      continue
    names = spec_entries(x)
    resolved = resolve(names, rules_t)
    # Unreduced / reduced axes are mesh axes already: they stay as written.
    spec = make_spec(unassigned_to_none(resolved), reductions_of(x))
    missing = unmapped_lib.unmapped_names(names, resolved, UNASSIGNED)
    if missing:
      unmapped.append(
        unmapped_lib.Unmapped(
          functools.partial(_spec_path, tree, i), None, names, spec, missing, rules_t
        )
      )
    out.append(spec)
  problems = unmapped_lib.report(
    unmapped, mesh_axis_names, strict, stacklevel=4, no_rules=source == SOURCE_NONE
  )
  if problems:
    raise ShardingError(problems)
  return jax.tree_util.tree_unflatten(treedef, out)


def _spec_path(tree: PyTree, index: int) -> str:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_spec)
  return ann_lib.path_str(flat[index][0]) or '<spec>'


def logical_to_mesh_sharding(
  tree: PyTree,
  mesh: AnyMesh,
  rules: LogicalRules | None = None,
  *,
  strict: bool = False,
) -> PyTree:
  """Like :func:`logical_to_mesh`, then ``NamedSharding(mesh, spec)`` per leaf.

  Mesh axes are checked against the mesh (shapes are unknown here, so
  divisibility is checked later by :func:`get_sharding` or jax). A logical
  name no rule maps that is one of ``mesh``'s axes gets an
  :class:`UnmappedMeshAxisNameWarning` (with ``strict=True``, every name no
  rule maps is a ShardingError).

  Example:
    >>> import jax, flax_shardmeta as fsm
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
    >>> fsm.logical_to_mesh_sharding(P('batch'), mesh, [('batch', 'data')]).spec
    P('data',)
  """
  mesh = check_mesh(mesh, 'logical_to_mesh_sharding')
  specs = _logical_to_mesh(tree, rules, strict, tuple(mesh.axis_names))
  flat, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)
  problems = []
  out = []
  for path, spec in flat:
    if not _is_spec(spec):
      out.append(spec)
      continue
    # A shape as large as needed makes only the mesh-axis checks bite.
    entries = spec_entries(spec)
    issues = check_spec((0,) * len(entries), entries, mesh)
    issues += _set_issues(entries, reductions_of(spec), mesh)
    problems += [
      ShardingProblem(ann_lib.path_str(path), None, None, spec, r, h, d)
      for r, h, d in issues
    ]
    # jax rejects a bad spec on construction; collect every problem first.
    out.append(None if issues else named_sharding(mesh, spec))
  if problems:
    raise ShardingError(problems)
  return jax.tree_util.tree_unflatten(treedef, out)
