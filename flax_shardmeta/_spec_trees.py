"""Trees of PartitionSpecs: annotations as written, and logical specs resolved.

The flax-style conversions: :func:`get_partition_spec` reads each leaf's
annotation as written; :func:`logical_to_mesh` resolves a tree of logical
specs to mesh axes and :func:`logical_to_mesh_sharding` makes them
``NamedSharding``s, checked against the mesh (shapes are unknown here).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax.sharding import PartitionSpec

from flax_shardmeta import _annotation as ann_lib, _unmapped as unmapped_lib
from flax_shardmeta._errors import InvalidNamesError, ShardingError, ShardingProblem
from flax_shardmeta._placement import check_mesh
from flax_shardmeta._resolution import resolve
from flax_shardmeta._rules import SOURCE_NONE, rules_and_source
from flax_shardmeta._sharding import leaf_shape, named_sharding, reduction_issues
from flax_shardmeta._specs import (
  UNASSIGNED,
  make_spec,
  reductions_of,
  spec_entries,
  unassigned_to_none,
)
from flax_shardmeta._typing import AnyMesh, LogicalRules, PyTree
from flax_shardmeta._validate import check_spec


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
  _refuse_bare_names(tree)
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


def _refuse_bare_names(tree: PyTree) -> None:
  """A string where a PartitionSpec belongs: never translated, so refuse it.

  flax maps only PartitionSpec leaves and would read ``'embed'`` letter by
  letter; coming back untranslated would hide the mistake.
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_spec)
  bare = [(ann_lib.path_str(p), x) for p, x in flat if isinstance(x, str)]
  if not bare:
    return
  if isinstance(tree, str) or (
    isinstance(tree, tuple) and all(isinstance(x, (str, type(None))) for x in tree)
  ):
    names = (tree,) if isinstance(tree, str) else tree
    fix = f'Pass P{names!r} or a tree of PartitionSpecs.'.replace(',)', ')')
  else:
    fix = "Make each leaf a PartitionSpec, e.g. P('embed')."
  where = ', '.join(f'{p or "<tree>"}={x!r}' for p, x in bare)
  raise InvalidNamesError(
    f'logical names given as bare strings ({where}): only PartitionSpec leaves '
    f'are translated, so these would come back unchanged. {fix}'
  )


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
    issues += reduction_issues(entries, reductions_of(spec), mesh)
    problems += [
      ShardingProblem(ann_lib.path_str(path), None, None, spec, r, h, d)
      for r, h, d in issues
    ]
    # jax rejects a bad spec on construction; collect every problem first.
    out.append(None if issues else named_sharding(mesh, spec))
  if problems:
    raise ShardingError(problems)
  return jax.tree_util.tree_unflatten(treedef, out)
