"""Placing a value on a mesh: the context mesh, Manual axes and ``apply_spec``.

Auto mesh axes take ``with_sharding_constraint``; Explicit ones take
``jax.sharding.reshard`` (a constraint would only assert there). Mesh axes that
are Manual (inside ``jax.shard_map``) are left alone.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from flax_shardmeta._errors import NoMeshError, ShardingError, ShardingProblem
from flax_shardmeta._specs import mesh_axes_of
from flax_shardmeta._typing import AnyMesh
from flax_shardmeta._validate import check_spec, fit_spec


def context_mesh() -> AnyMesh | None:
  """The mesh set by ``jax.set_mesh`` (concrete if known), or None.

  The deprecated ``with mesh:`` context is honoured too, as jax still
  honours it for ``with_sharding_constraint``: ignoring it would silently
  drop every constraint of code not yet moved to ``jax.set_mesh``.
  """
  abstract = jax.sharding.get_abstract_mesh()
  if abstract.empty:
    return legacy_mesh()
  if getattr(abstract, 'manual_axes', ()):
    return abstract  # inside shard_map only the abstract view knows Manual axes
  try:
    concrete = jax.sharding.get_mesh()
  except ValueError:  # inside jit only the abstract mesh is available
    return abstract
  return abstract if concrete.empty else concrete


def legacy_mesh() -> jax.sharding.Mesh | None:
  """The mesh of an enclosing ``with mesh:`` (deprecated by jax), or None."""
  # jax has no public accessor for it (only the deprecated, warning
  # jax.interpreters.pxla.thread_resources); read the private state, and treat
  # its absence in a future jax as "no legacy mesh".
  try:
    from jax._src import mesh as mesh_internals

    legacy = mesh_internals.thread_resources.env.physical_mesh
  except (ImportError, AttributeError):
    return None
  return None if legacy.empty else legacy


def manual_axes(mesh: AnyMesh) -> frozenset[str]:
  manual = set(getattr(mesh, 'manual_axes', ()) or ())
  abstract = jax.sharding.get_abstract_mesh()
  if not abstract.empty:
    manual |= set(getattr(abstract, 'manual_axes', ()) or ())
  return frozenset(manual)


def _drop_axes(entries: tuple[Any, ...], drop: frozenset[str]) -> tuple[Any, ...]:
  out = []
  for e in entries:
    axes = mesh_axes_of(e)
    if not axes or not drop.intersection(axes):
      out.append(e)
      continue
    kept = tuple(a for a in axes if a not in drop)
    out.append(kept[0] if len(kept) == 1 else (kept or None))
  return tuple(out)


def apply_spec(
  value: Any,
  entries: tuple[Any, ...],
  mesh: AnyMesh,
  *,
  path: str = '<value>',
  names: Any = None,
  fit_changes: list[str] | None = None,
) -> Any:
  """Validates ``entries`` for ``value`` on ``mesh`` and applies them.

  With ``fit_changes`` (a list), dimensions the mesh cannot shard as asked
  are replicated instead of failing (``fit=True``), and each change is
  appended to it as one sentence.
  """
  manual = manual_axes(mesh)
  if manual:
    entries = _drop_axes(entries, manual)
  shape = tuple(getattr(value, 'shape', ()))
  if fit_changes is not None:
    entries, issues, changes = fit_spec(shape, entries, mesh)
    fit_changes.extend(changes)
  else:
    issues = check_spec(shape, entries, mesh)
  spec = PartitionSpec(*entries)
  if issues:
    raise ShardingError(
      [ShardingProblem(path, shape, names, spec, r, h, d) for r, h, d in issues]
    )
  types = {n: t for n, t in zip(mesh.axis_names, mesh.axis_types) if n not in manual}
  if not types:
    return value
  kinds = set(types.values())
  if kinds == {AxisType.Explicit}:
    if manual or isinstance(mesh, jax.sharding.AbstractMesh):
      return jax.sharding.reshard(value, spec)
    return jax.sharding.reshard(value, NamedSharding(mesh, spec))
  if kinds == {AxisType.Auto}:
    if manual:
      return jax.lax.with_sharding_constraint(value, spec)
    return jax.lax.with_sharding_constraint(value, NamedSharding(mesh, spec))
  raise ShardingError(
    [
      ShardingProblem(
        path,
        shape,
        names,
        spec,
        f'the mesh mixes axis types { {n: str(t) for n, t in types.items()} }, '
        'and a layout is applied with with_sharding_constraint (all Auto) or '
        'reshard (all Explicit)',
        'make every axis the same type, e.g. jax.make_mesh(shape, names, '
        'axis_types=(AxisType.Explicit,) * n)',
      )
    ]
  )


def require_mesh(mesh: AnyMesh | None, what: str) -> AnyMesh:
  mesh = mesh if mesh is not None else context_mesh()
  if mesh is None:
    raise NoMeshError(
      f'{what} needs a mesh: pass mesh=... or run inside `with jax.set_mesh(mesh):`.'
    )
  return mesh
