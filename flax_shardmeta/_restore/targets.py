"""A restore target's leaves: each laid out, checked, and on which mesh.

Structs carry their own ``NamedSharding``; boxes are laid out on the mesh by
the rules as ``fsm.plan`` lays them out, unmapped logical names reported as
it reports them. A sharding a dimension cannot be split by is a problem of
its leaf here, before orbax would refuse it mid-read. Leaves on more than
one mesh: the mesh most of them are on is the target's, and the others are
named; with no such mesh, every mesh found is listed with its leaves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jax.sharding import NamedSharding

from flax_shardmeta import _annotation as ann_lib
from flax_shardmeta._errors import ShardingProblem
from flax_shardmeta._sharding import lay_out, leaf_shape
from flax_shardmeta._typing import AnyMesh, LogicalRules, PyTree
from flax_shardmeta._validate import check_spec

PATHS_SHOWN = 3
"""Paths named per mesh when the meshes of a target are listed."""


@dataclasses.dataclass(frozen=True)
class Target:
  """One target array leaf.

  Attributes:
    path: its path (boxes are not a level).
    value: the struct or array (a box's value).
    sharding: its target sharding (None: none given, or not laid out).
    faulty: its annotation could not be laid out, or its sharding cannot
      split it: its problems are listed already (and it is not also
      "without a sharding").
  """

  path: str
  value: Any
  sharding: NamedSharding | None
  faulty: bool = False


def target_leaves(
  tree: PyTree,
  mesh: AnyMesh | None,
  rules: LogicalRules | None,
  problems: list[ShardingProblem],
  replicate_unannotated: bool = False,
) -> list[Target]:
  """Every array leaf of ``tree`` with its sharding; problems appended.

  A leaf that brings its own ``NamedSharding`` keeps it (checked against its
  shape); an annotated one is laid out on ``mesh`` as ``fsm.plan`` lays it
  out, its problems and unmapped names reported the same way; with
  ``replicate_unannotated``, so is an unannotated one (replicated).
  """
  if mesh is None:
    leaves, _ = ann_lib.walk(tree, every_path=True)
    layouts: list[Any] = [None] * len(leaves)
  else:
    # Warnings name the user's call: 5 up (report, lay_out, here, the plan).
    def keeps_its_own(lf: ann_lib.Leaf) -> bool:
      """Not laid out by the rules: not an array, unannotated (unless asked
      to replicate those), or it brings a NamedSharding of its own."""
      return (
        leaf_shape(lf.value) is None
        or (lf.annotation is None and not replicate_unannotated)
        or _own_sharding(lf) is not None
      )

    laid = lay_out(
      tree, mesh, rules, every_path=True, skip=keeps_its_own, names_first=False,
      stacklevel=5,
    )  # fmt: skip
    leaves, layouts = laid.leaves, laid.layouts
    problems.extend(_for_restore(p) for p in laid.problems)
  out = []
  for lf, layout in zip(leaves, layouts):
    shape = leaf_shape(lf.value)
    if shape is None:
      continue
    if layout is not None:
      out.append(Target(lf.path, lf.value, layout.sharding, bool(layout.issues)))
      continue
    sharding = _own_sharding(lf)
    split = [] if sharding is None else split_problems(lf.path, shape, sharding)
    problems.extend(split)
    out.append(Target(lf.path, lf.value, sharding, bool(split)))
  return out


def _own_sharding(lf: ann_lib.Leaf) -> NamedSharding | None:
  sharding = getattr(lf.value, 'sharding', None)
  return sharding if isinstance(sharding, NamedSharding) else None


def split_problems(
  path: str, shape: tuple[int, ...], sharding: NamedSharding
) -> list[ShardingProblem]:
  """What stops ``sharding`` from splitting an array of ``shape`` (a
  dimension its axes do not divide, too many entries), as ``fsm.plan`` says it."""
  issues = check_spec(shape, tuple(sharding.spec), sharding.mesh)
  return [
    _for_restore(ShardingProblem(path, shape, None, sharding.spec, r, h, d))
    for r, h, d in issues
  ]


def _for_restore(problem: ShardingProblem) -> ShardingProblem:
  """A dimension its axes do not divide, with the fixes a restore target
  has (fsm.restore has no ``replicate_indivisible``)."""
  if 'is not divisible by' not in problem.reason:
    return problem
  (dim,) = problem.dims
  size = problem.shape[dim] if problem.shape is not None else '?'
  return dataclasses.replace(
    problem,
    hint=f'shard dimension {dim} over mesh axes whose sizes divide {size}, '
    'or replicate it (None at that place in the spec; with boxes, a rule '
    'mapping its name to None): a restore cannot split it unevenly',
  )


def mesh_text(mesh: Any) -> str:
  """``data=2 x model=4``."""
  return ' x '.join(f'{n}={s}' for n, s in zip(mesh.axis_names, mesh.axis_sizes))


def _key(mesh: Any) -> tuple[tuple[str, ...], tuple[int, ...]]:
  return tuple(mesh.axis_names), tuple(mesh.axis_sizes)


def target_mesh(
  targets: list[Target], mesh: AnyMesh | None
) -> tuple[AnyMesh | None, Callable[[str], tuple[str, str] | None]]:
  """The mesh the target restores onto, and per path, (reason, hint) if its
  leaf is on another mesh.

  ``mesh`` given: that one. Else the mesh of most leaves; where two or more
  meshes have as many leaves, the first of them, every mesh then listed.
  """
  by_mesh: dict[Any, list[str]] = {}
  meshes: dict[Any, Any] = {}
  for t in targets:
    if t.sharding is not None:
      key = _key(t.sharding.mesh)
      by_mesh.setdefault(key, []).append(t.path)
      meshes.setdefault(key, t.sharding.mesh)
  counts = sorted((len(p) for p in by_mesh.values()), reverse=True)
  tie = len(counts) > 1 and counts[0] == counts[1]
  if mesh is None and by_mesh:
    mesh = meshes[max(by_mesh, key=lambda k: len(by_mesh[k]))]  # first of the most
  if mesh is None or len(by_mesh) <= 1 and _key(mesh) in by_mesh:
    return mesh, lambda path: None
  chosen = _key(mesh)
  on = {p: k for k, paths in by_mesh.items() for p in paths}
  others = sum(len(p) for k, p in by_mesh.items() if k != chosen)
  listing = '; '.join(
    f'{mesh_text(meshes[k])}: {_paths(paths)}' for k, paths in by_mesh.items()
  )

  def reason(path: str) -> tuple[str, str] | None:
    key = on.get(path)
    if key is None or key == chosen:
      return None
    here = mesh_text(meshes[key])
    if tie:
      return (
        f'on {here}, while the target has leaves on {len(by_mesh)} meshes ({listing})',
        'put every leaf of the target on one mesh (fsm.as_abstract(tree, mesh))',
      )
    rest = len(by_mesh.get(chosen, ()))
    where = f'the mesh given ({mesh_text(mesh)})' if rest == 0 else (
      f'{mesh_text(mesh)}, the mesh of {rest} other leaves'
    )  # fmt: skip
    if not rest:
      return (
        f'on {here}, not {where}',
        'pass the mesh the target is laid out on as mesh=, or lay the target '
        'out on the mesh given (fsm.as_abstract(tree, mesh))',
      )
    return (
      f'on {here}, not {where}'
      + (f' ({others} leaves are on other meshes)' if others > 1 else ''),
      'lay this leaf out on the target mesh too (fsm.as_abstract(tree, mesh))',
    )

  return mesh, reason


def _paths(paths: list[str]) -> str:
  shown = ', '.join(paths[:PATHS_SHOWN])
  more = len(paths) - PATHS_SHOWN
  return shown + (f' and {more} more' if more > 0 else '')
