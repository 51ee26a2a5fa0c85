"""Placing a value on a mesh: the context mesh, Manual axes and ``apply_spec``.

Auto mesh axes take ``with_sharding_constraint``; Explicit ones take
``jax.sharding.reshard`` (a constraint would only assert there). Mesh axes that
are Manual (inside ``jax.shard_map``) are left alone.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.core
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from flax_shardmeta._errors import NoMeshError, ShardingError, ShardingProblem
from flax_shardmeta._specs import UNCONSTRAINED, mesh_axes_of
from flax_shardmeta._typing import AnyMesh
from flax_shardmeta._validate import check_spec, replicate_indivisible


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
  replicated: list[str] | None = None,
) -> Any:
  """Validates ``entries`` for ``value`` on ``mesh`` and applies them.

  With ``replicated`` (a list), dimensions the mesh cannot shard as asked
  are replicated instead of failing (``replicate_indivisible=True``), and
  each change is appended to it as one sentence.
  """
  manual = manual_axes(mesh)
  if manual:
    entries = _drop_axes(entries, manual)
  shape = tuple(getattr(value, 'shape', ()))
  if replicated is not None:
    entries, issues, changes = replicate_indivisible(shape, entries, mesh)
    replicated.extend(changes)
  else:
    issues = check_spec(shape, entries, mesh)
  types = {n: t for n, t in zip(mesh.axis_names, mesh.axis_types) if n not in manual}
  kinds = set(types.values())
  if types and AxisType.Auto not in kinds:
    entries, more = _no_open_dims(entries, replicated, types)
    issues = tuple(issues) + tuple(more)
  spec = PartitionSpec(*entries)
  if issues:
    raise ShardingError(
      [ShardingProblem(path, shape, names, spec, r, h, d) for r, h, d in issues]
    )
  if not types:
    return value
  try:
    return _apply(value, spec, entries, mesh, types, manual, path, names, shape)
  except (TypeError, ValueError) as e:
    # jax's words for an array outside any trace placed on a mesh of no
    # devices (Auto axes: a TypeError; Explicit ones: "not under a mesh").
    if (
      not isinstance(mesh, jax.sharding.AbstractMesh)
      or isinstance(value, jax.core.Tracer)
      or not ('AbstractMesh' in str(e) or 'not under a mesh context' in str(e))
    ):
      raise
    raise NoMeshError(
      f'{path}: an AbstractMesh {dict(zip(mesh.axis_names, mesh.axis_sizes))} '
      'has no devices, so a value outside jit cannot be laid out on it. Pass '
      'the concrete jax.sharding.Mesh (mesh=... or jax.set_mesh(mesh)), or do '
      'this inside jax.jit.'
    ) from None


def _apply(
  value: Any,
  spec: PartitionSpec,
  entries: tuple[Any, ...],
  mesh: AnyMesh,
  types: dict[str, Any],
  manual: frozenset[str],
  path: str,
  names: Any,
  shape: tuple[int, ...],
) -> Any:
  kinds = set(types.values())
  if kinds == {AxisType.Explicit}:
    if manual or isinstance(mesh, jax.sharding.AbstractMesh):
      return jax.sharding.reshard(value, spec)
    return jax.sharding.reshard(value, NamedSharding(mesh, spec))
  if kinds == {AxisType.Auto}:
    if manual:
      return jax.lax.with_sharding_constraint(value, spec)
    return jax.lax.with_sharding_constraint(value, NamedSharding(mesh, spec))
  return _apply_mixed(value, entries, mesh, types, bool(manual), path, names, shape)


def _no_open_dims(
  entries: tuple[Any, ...],
  replicated: list[str] | None,
  types: dict[str, Any],
) -> tuple[tuple[Any, ...], list[tuple[str, str, tuple[int, ...]]]]:
  """UNCONSTRAINED on a mesh with no Auto axes: replicated when ``replicated``
  collects changes, else an issue.

  Only Auto axes can be left to the compiler; jax refuses UNCONSTRAINED when
  every axis is Explicit.
  """
  open_dims = tuple(d for d, e in enumerate(entries) if e is UNCONSTRAINED)
  if not open_dims:
    return entries, []
  shown = ', '.join(f'{n}: {t.name}' for n, t in types.items())
  why = (
    f'UNCONSTRAINED leaves a dimension to the compiler, which only Auto mesh '
    f'axes allow, and this mesh has none ({shown})'
  )
  if replicated is not None:
    replicated.extend(
      f'dimension {d}: UNCONSTRAINED -> None ({why})' for d in open_dims
    )
    return tuple(None if e is UNCONSTRAINED else e for e in entries), []
  return entries, [
    (
      f'dimension {", ".join(map(str, open_dims))} is UNCONSTRAINED: {why}',
      'give the logical name a rule to None or to mesh axes, use a mesh with '
      'Auto axes, or pass replicate_indivisible=True to replicate it',
      open_dims,
    )
  ]


def _apply_mixed(
  value: Any,
  entries: tuple[Any, ...],
  mesh: AnyMesh,
  types: dict[str, Any],
  manual: bool,
  path: str,
  names: Any,
  shape: tuple[int, ...],
) -> Any:
  """A layout on a mesh mixing Explicit and Auto axes, as jax allows it.

  Eagerly, ``jax.device_put`` takes the whole layout. Inside ``jit``, the
  Explicit axes go through ``reshard`` and then the Auto axes through
  ``with_sharding_constraint`` (each takes axes of its own type only), so one
  dimension cannot combine the two kinds. An UNCONSTRAINED dimension keeps
  the Explicit axes the value already has and leaves the Auto ones open.
  """
  current = _current_entries(value, len(entries))
  explicit: list[Any] = []
  auto: list[Any] = []
  for d, e in enumerate(entries):
    if e is UNCONSTRAINED:
      kept = tuple(
        a for a in mesh_axes_of(current[d]) if types.get(a) is AxisType.Explicit
      )
      explicit.append(_pack(kept))
      auto.append(UNCONSTRAINED)
      continue
    axes = mesh_axes_of(e)
    ex = tuple(a for a in axes if types.get(a) is AxisType.Explicit)
    au = tuple(a for a in axes if types.get(a) is AxisType.Auto)
    if ex and au:
      raise ShardingError(
        [
          ShardingProblem(
            path,
            shape,
            names,
            PartitionSpec(*entries),
            f'dimension {d} combines Explicit mesh axes {ex} with Auto mesh axes '
            f'{au}: jax lays Explicit axes out with reshard and Auto axes with '
            'with_sharding_constraint, and neither takes both kinds in one '
            'dimension',
            'shard this dimension over axes of one type, or make the mesh all '
            'Auto or all Explicit',
            (d,),
          )
        ]
      )
    explicit.append(_pack(ex))
    auto.append(_pack(au))
  if not isinstance(value, jax.core.Tracer):
    whole = [
      ex if ex is not None else (None if au is UNCONSTRAINED else au)
      for ex, au in zip(explicit, auto)
    ]
    return jax.device_put(value, NamedSharding(mesh, PartitionSpec(*whole)))
  concrete = not manual and isinstance(mesh, jax.sharding.Mesh)
  ex_spec, au_spec = PartitionSpec(*explicit), PartitionSpec(*auto)
  value = jax.sharding.reshard(
    value, NamedSharding(mesh, ex_spec) if concrete else ex_spec
  )
  return jax.lax.with_sharding_constraint(
    value, NamedSharding(mesh, au_spec) if concrete else au_spec
  )


def _pack(axes: tuple[str, ...]) -> Any:
  return None if not axes else axes[0] if len(axes) == 1 else axes


def _current_entries(value: Any, rank: int) -> tuple[Any, ...]:
  """The value's present spec entries (inside jit: its type's sharding)."""
  try:
    sharding = jax.typeof(value).sharding
    spec = tuple(getattr(sharding, 'spec', ()) or ())
  except (TypeError, AttributeError):
    spec = ()
  if not spec and isinstance(getattr(value, 'sharding', None), NamedSharding):
    spec = tuple(value.sharding.spec)
  return spec[:rank] + (None,) * (rank - len(spec[:rank]))


def require_mesh(mesh: AnyMesh | None, what: str) -> AnyMesh:
  """``mesh``, else the context mesh; NoMeshError if there is none."""
  mesh = mesh if mesh is not None else context_mesh()
  if mesh is None:
    raise NoMeshError(
      f'{what} needs a mesh: pass mesh=... or run inside `with jax.set_mesh(mesh):`.'
    )
  return check_mesh(mesh, what)


def check_mesh(mesh: Any, what: str) -> AnyMesh:
  """``mesh`` if it is a Mesh or AbstractMesh, else a NoMeshError naming it."""
  if isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
    return mesh
  if mesh is None:
    raise NoMeshError(
      f'{what} needs a mesh, got None: pass a jax.sharding.Mesh (e.g. '
      'jax.make_mesh((2, 4), ("data", "model"))) or an AbstractMesh.'
    )
  looks_like_rules = (
    isinstance(mesh, (list, tuple))
    and len(mesh) > 0
    and all(isinstance(r, (list, tuple)) and len(r) == 2 for r in mesh)
  )
  raise NoMeshError(
    f'{what} needs a jax.sharding.Mesh or AbstractMesh as its mesh, got '
    f'{type(mesh).__name__}'
    + (
      ' that looks like logical axis rules: pass them as rules=...'
      if looks_like_rules
      else '.'
    )
  )
