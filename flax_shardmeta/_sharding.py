"""From annotations to validated ``NamedSharding`` trees.

Each distinct (shape, annotation, rules, mesh) is resolved and validated once
and cached: models repeat a handful of annotation patterns thousands of times.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from jax.sharding import AxisType, NamedSharding, PartitionSpec

from flax_shardmeta import _annotation as ann_lib, _unmapped as unmapped_lib
from flax_shardmeta._axis_typos import with_typo_hint
from flax_shardmeta._caches import paused_gc
from flax_shardmeta._errors import (
  FlaxShardmetaError,
  InvalidNamesError,
  ShardingError,
  ShardingProblem,
  message,
)
from flax_shardmeta._names import check_entries
from flax_shardmeta._placement import check_mesh
from flax_shardmeta._resolution import resolve
from flax_shardmeta._rules import (
  SOURCE_NONE,
  composite_rules,
  get_logical_axis_rules,
  normalize_rules,
  rules_and_source,
)
from flax_shardmeta._specs import (
  UNASSIGNED,
  UNCONSTRAINED,
  make_spec,
  mesh_axes_of,
  spec_sets,
)
from flax_shardmeta._typing import AnyMesh, LogicalRules, PyTree
from flax_shardmeta._validate import (
  check_spec,
  rank_issue,
  replicate_indivisible,
  replicate_option,
  unconstrained_issue,
  warn_replicated,
)


@dataclasses.dataclass(frozen=True)
class LeafLayout:
  """The resolved layout of one leaf (path-free, so it can be cached).

  Attributes:
    shape: the leaf's shape, or None for a non-array leaf.
    spec: the resolved PartitionSpec, or None for a non-array leaf.
    issues: ``(reason, hint, dims)`` problems left after any replication.
    adjustments: what ``replicate_indivisible`` changed, one sentence each.
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
  replicate: bool = False,
  *,
  for_constraint: bool = False,
) -> LeafLayout:
  """Resolves and validates one leaf (cached on all arguments).

  ``replicate``: replicate the dimensions the mesh cannot divide
  (``replicate_indivisible=True``). ``for_constraint``: the spec is applied
  as a sharding constraint, where UNCONSTRAINED is valid; otherwise it becomes
  a ``NamedSharding`` for ``jit`` / ``device_put``, which refuse it.
  """
  return _layout_cached(shape, annotation, mesh, rules, replicate, for_constraint)


@functools.lru_cache(maxsize=65536)
def _layout_cached(
  shape, annotation, mesh, rules, replicate, for_constraint
) -> LeafLayout:
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
      shape, None, ((message(e).rstrip('.'), 'fix the names or the rules', ()),)
    )
  issues = check_spec(shape, entries, mesh)
  if issues and annotation.optimizer_state:
    # Same rank but another shape (adafactor's v_row/v_col of a rank-1
    # parameter are shape (1,)), or a full-size moment of a parameter whose
    # dimension does not divide. Faults are reported on the parameter itself;
    # here only the dimensions at fault are replicated, so a moment keeps the
    # rest of its parameter's layout (as replicate_indivisible gives the
    # parameter).
    bad = {d for _, _, dims in issues for d in dims}
    kept = tuple(None if d in bad else e for d, e in enumerate(entries))
    keep = any(e is not None for e in kept) and not check_spec(shape, kept, mesh)
    spec = PartitionSpec(*kept) if keep else PartitionSpec()
    return LeafLayout(shape, spec, sharding=named_sharding(mesh, spec))
  adjustments: tuple[str, ...] = ()
  if replicate and issues:
    entries, issues, adjustments = replicate_indivisible(shape, entries, mesh)
  if not for_constraint:
    open_dims = unconstrained_issue(entries)
    if open_dims is not None and replicate:
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
  issues += reduction_issues(entries, reductions, mesh)
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


def reduction_issues(
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
        message(error).rstrip('.'),
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
  replicate: bool = False,
  *,
  every_path: bool = False,
  skip: Any = None,
) -> tuple[list[ann_lib.Leaf], list[Any], Any]:
  """Walks ``tree`` and lays out every leaf; returns leaves, layouts, builder.

  ``replicate``: replicate what the mesh cannot divide (see :func:`layout_of`).
  ``every_path``: the caller reads every leaf's path (see ``walk``).
  ``skip``: leaves it returns True for get no layout (None).
  """
  rules_t = effective_rules(rules)
  ann_lib.check_not_function(tree)
  with paused_gc():  # a few objects per leaf: see _caches
    leaves, build = ann_lib.walk(tree, every_path)
    # mesh, rules and replicate are fixed for this call: memoize on what varies.
    memo: dict[Any, LeafLayout] = {}
    layouts = []
    for lf in leaves:
      if skip is not None and skip(lf):
        layouts.append(None)
        continue
      if isinstance(lf.value, PartitionSpec):
        layouts.append(spec_layout(lf.value, mesh))
        continue
      key = (leaf_shape(lf.value), lf.annotation)
      layout = memo.get(key)
      if layout is None:
        layout = memo[key] = layout_of(key[0], key[1], mesh, rules_t, replicate)
      layouts.append(layout)
  return leaves, layouts, build


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


@dataclasses.dataclass
class TreeLayout:
  """A tree laid out on a mesh under rules: what :func:`lay_out` returns.

  Attributes:
    leaves: every walked leaf, in tree order.
    layouts: each leaf's :class:`LeafLayout` (None for a skipped leaf).
    build: rebuilds the tree from one value per leaf.
    rules: the effective rules; ``source`` says where they come from.
    problems: every leaf's problems in tree order (names errors included),
      then the unmapped names ``strict`` makes problems; the misspelt-axis
      hint applied.
    bad_names: the problems that are malformed names.
    adjusted: ``(leaf, changes)`` where ``replicate`` replicated dimensions.
  """

  leaves: list[ann_lib.Leaf]
  layouts: list[LeafLayout | None]
  build: Any
  rules: tuple[tuple[str, Any], ...]
  source: str
  problems: list[ShardingProblem]
  bad_names: list[ShardingProblem]
  adjusted: list[tuple[ann_lib.Leaf, tuple[str, ...]]]

  def every_layout(self) -> list[LeafLayout]:
    """Each leaf's layout, for a tree laid out without ``skip``."""
    return [lay for lay in self.layouts if lay is not None]


def lay_out(
  tree: PyTree,
  mesh: AnyMesh,
  rules: LogicalRules | None = None,
  *,
  replicate: bool = False,
  strict: bool = False,
  every_path: bool = False,
  skip: Any = None,
  names_first: bool = True,
  stacklevel: int = 4,
) -> TreeLayout:
  """Lays out every leaf of ``tree`` on ``mesh`` and collects its problems:
  the one pipeline ``get_sharding``, ``as_abstract``, ``plan`` and a
  restore's targets are views of (each decides what to raise or keep).

  Unmapped names are reported once, the same way for all of them (warnings,
  or problems with ``strict``); ``skip(leaf)`` leaves a leaf out (a restore
  target that brings its own sharding); with ``names_first`` malformed names
  stop there (their error comes before any unmapped-name warning);
  ``stacklevel`` is the warnings' (2 + the caller's depth below the user's
  call, counting this function).
  """
  rules_t, source = rules_and_source(rules)
  leaves, layouts, build = layout_tree(
    tree, mesh, rules_t, replicate, every_path=every_path, skip=skip
  )
  problems: list[ShardingProblem] = []
  bad_names: list[ShardingProblem] = []
  adjusted: list[tuple[ann_lib.Leaf, tuple[str, ...]]] = []
  unmapped: list[unmapped_lib.Unmapped] = []
  # Paths are made only for leaves that something is reported about.
  for lf, lay in zip(leaves, layouts):
    if lay is None:
      continue
    if lay.adjustments:
      adjusted.append((lf, lay.adjustments))
    if lay.issues:
      found = problems_of(lf.path, lf, lay)
      problems.extend(found)
      if lay.names_error:
        bad_names.extend(found)
    if lay.unmapped:  # names only annotations have: never a plain array
      unmapped.append(unmapped_record(lf, lay, rules_t))
  if bad_names and names_first:
    return TreeLayout(
      leaves, layouts, build, rules_t, source, problems, bad_names, adjusted
    )
  problems += unmapped_lib.report(
    unmapped,
    tuple(mesh.axis_names),
    strict,
    no_rules=source == SOURCE_NONE,
    stacklevel=stacklevel,
  )
  problems = with_typo_hint(problems, mesh.axis_names, rules_t)
  return TreeLayout(
    leaves, layouts, build, rules_t, source, problems, bad_names, adjusted
  )


def get_sharding(
  tree: PyTree,
  mesh: AnyMesh,
  rules: LogicalRules | None = None,
  *,
  replicate_indivisible: bool = False,
  strict: bool = False,
  fit: bool | None = None,
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
    replicate_indivisible: replicate dimensions their mesh axes cannot divide
      (or axes the mesh lacks, or UNCONSTRAINED entries) instead of failing;
      one :class:`IndivisibleDimensionWarning` lists the changes.
    strict: a logical name no usable rule maps is a problem (raised with the
      others) instead of being replicated.
    fit: the former name of ``replicate_indivisible`` (deprecated).

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
  replicate = replicate_option(replicate_indivisible, fit, 'get_sharding')
  mesh = check_mesh(mesh, 'get_sharding')
  laid = lay_out(tree, mesh, rules, replicate=replicate, strict=strict)
  if laid.bad_names:
    raise InvalidNamesError(problems=laid.bad_names)
  if laid.problems:
    raise ShardingError(laid.problems)
  if laid.adjusted:
    warn_replicated(laid.adjusted)
  with paused_gc():
    return laid.build([lay.sharding for lay in laid.every_layout()])
