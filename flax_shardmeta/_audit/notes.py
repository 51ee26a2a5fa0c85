"""What an Explicit audit names besides refused operations.

- Specs that keep a size-1 mesh axis: Explicit types carry it, and a reshape
  that merges or splits that dimension must then say where it goes
  (maxtext#4208); naming no axis there keeps the same layout.
- Logical rules mapping two names of one value to one mesh axis: the second
  is dropped (a spec cannot name an axis twice), silently under Auto; under
  Explicit the value's type shows the dimension unsharded.
- Calls whose sharding rules cannot see Explicit axes (a Pallas kernel, a
  ``custom_partitioning`` callback, an FFI or custom call): they see their
  operands as Auto, so each is wrapped in ``jax.sharding.auto_axes``.
- Fixes naming a layout as ``P(...)``: jax reads the mesh axes it names from
  the mesh in context where the line runs, so each such line needs one
  there, initialization included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jax.sharding import PartitionSpec

from flax_shardmeta._frames import import_path
from flax_shardmeta._specs import format_spec, mesh_axes_of, spec_entries


@dataclasses.dataclass(frozen=True)
class Note:
  """One thing the audit names that is not a refused operation.

  Attributes:
    kind: ``'size-1 axis'``, ``'rule maps two names to one axis'``,
      ``'cannot see Explicit axes'`` or ``'fixes need a mesh in context'``.
    where: the parameter path, rule or ``file:line``.
    what: what it is.
    fix: the way out.
  """

  kind: str
  where: str
  what: str
  fix: str

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form."""
    return dataclasses.asdict(self)


def notes_of(
  recorder: Any, in_specs: list[PartitionSpec], mesh: Any, args: Any, rules: Any,
  fixes: Sequence[str] = (),
) -> list[Note]:  # fmt: skip
  """Every note of one audit, in that order (``fixes``: the sites' code)."""
  return [
    *_size_one(in_specs, mesh),
    *_two_names(args, mesh, rules),
    *_opaque(recorder),
    *_mesh_context(fixes),
  ]


def _mesh_context(fixes: Sequence[str]) -> list[Note]:
  """A fix that names a layout ``P(...)`` runs only with a mesh in context."""
  n = sum('P(' in fix for fix in fixes)
  if not n:
    return []
  return [Note(
    'fixes need a mesh in context', f'{n} of the fixes above',
    'out_sharding=P(...) names mesh axes, and jax finds them in the mesh in '
    'context where the line runs: outside one it raises, and with Auto axes '
    'it refuses them, at initialization (init, eval_shape, an nnx '
    'constructor) as in the step',
    'run every call that reaches those lines, the model\'s initialization '
    'included, inside `with jax.set_mesh(mesh):` on a mesh whose axes are '
    'Explicit (axis_types=(AxisType.Explicit,) * n)',
  )]  # fmt: skip


def _size_one(specs: list[PartitionSpec], mesh: Any) -> list[Note]:
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  ones = {a for a, n in sizes.items() if n == 1}
  seen: dict[str, int] = {}
  for spec in specs:
    for entry in spec_entries(spec):
      for a in mesh_axes_of(entry):
        if a in ones:
          seen[a] = seen.get(a, 0) + 1
  return [
    Note(
      'size-1 axis',
      f'mesh axis {a!r}',
      f'{n} argument specs name {a!r}, of size 1: Explicit types carry it, and a '
      'reshape merging or splitting that dimension must say where it goes',
      f'leave {a!r} out of those specs (None there is the same layout), or give '
      'the reshape out_sharding=',
    )  # fmt: skip
    for a, n in sorted(seen.items())
  ]


def _two_names(args: Any, mesh: Any, rules: Any) -> list[Note]:
  """Rules that mapped two names of one leaf to one axis (the second dropped)."""
  import warnings

  from flax_shardmeta._planning.sharding_plan import plan

  try:
    with warnings.catch_warnings():
      # Unmapped names are the plan's business, not this note's.
      warnings.simplefilter('ignore')
      laid_out = plan(args, mesh, rules)
  except Exception:  # noqa: BLE001 - arguments that are not a tree of leaves
    return []
  out: dict[str, Note] = {}
  for entry in laid_out.entries:
    for dim in entry.explain:
      # A rule skipped because its mesh axis is taken by another dimension.
      if any(step.clash is not None for step in getattr(dim, 'steps', ())):
        line = str(dim).strip()
        out.setdefault(line, Note(
          'rule maps two names to one axis', entry.path, line,
          'map one of the names to another axis (or None), or name the axis '
          'once: under Explicit axes the type shows the dimension unsharded',
        ))  # fmt: skip
  return list(out.values())


def _opaque(recorder: Any) -> list[Note]:
  out = []
  for (file, line, _, _), name in recorder.opaque.items():
    spec = next(
      (v for k, v in recorder.specs.items() if k[:3] == (file, line, name)),
      PartitionSpec(),
    )
    out.append(Note(
      'cannot see Explicit axes', f'{import_path(file)}:{line}',
      f'{name}: its sharding rule sees its operands as Auto',
      'wrap the call: jax.sharding.auto_axes(f, out_sharding='
      f'{format_spec(spec)})(...)',
    ))  # fmt: skip
  return out
