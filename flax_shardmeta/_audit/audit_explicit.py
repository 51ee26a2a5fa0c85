"""``fsm.audit_explicit``: every site a step written for Auto axes needs
changed for Explicit ones, the fix that keeps its layout, and the proof.

The step is traced and compiled on its mesh with Auto axes. It is then
traced again, as the user's code, on the same mesh with every axis Explicit,
going on past each operation jax refuses (``intercept``). A fix's layout is
XLA's: the refused values are returned as extra outputs of the Auto program
(``replay``), whose compiled output shardings say how XLA lays each out. A
round traces again with those layouts (a fix may make a later operation
fail: it is listed then), until a round finds no refusal not already listed
(or :data:`ROUNDS` have run: then it is not said to compile). That last
trace, every listed fix in it with the layout printed, is compiled under
Explicit axes and set beside the Auto program (``figures``);
``report.fixed_step`` runs it. A step that stops (its own error) keeps the
sites found before that point, and the report says where it stopped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from flax_shardmeta._audit.arguments import Arguments, check_divisible, check_step
from flax_shardmeta._audit.audit_text import MORE, text
from flax_shardmeta._audit.figures import ProgramFigures, figures
from flax_shardmeta._audit.intercept import (
  Key,
  going_on,
  same_mesh,
)
from flax_shardmeta._audit.notes import Note, notes_of
from flax_shardmeta._audit.sites import Site, sites
from flax_shardmeta._audit.tracing import (
  auto_layouts,
  auto_program,
  rounds,
  rules_in,
  runner,
  spec_of,
  stopped,
)
from flax_shardmeta._specs import format_spec
from flax_shardmeta._typing import AnyMesh, LogicalRules
from flax_shardmeta._units import format_bytes
from flax_shardmeta._views import ShownWithTreescope


def audit_explicit(
  step: Callable[..., Any],
  *args: Any,
  mesh: AnyMesh | None = None,
  rules: LogicalRules | None = None,
  **step_keywords: Any,
) -> ExplicitAudit:
  """Lists every operation of ``step`` that Explicit axes refuse, with fixes.

  ``step`` is written for Auto axes; it is traced on ``mesh`` with Auto
  axes, and replayed with the same axes Explicit. Each refusal becomes a
  :class:`~flax_shardmeta._audit.sites.Site` at the user's line, with the
  code that keeps today's layout (XLA's under Auto). The step with every fix
  applied is compiled under Explicit axes and compared with the Auto one.

  Args:
    step: a jitted function (``jax.jit``, ``fsm.jit``) or a plain one.
    *args: its arguments: abstract (``ShapeDtypeStruct`` with shardings) or
      arrays, and Python numbers, traced as ``jax.jit`` traces them; any
      other leaf (a string, a config) is passed through as it is, as a
      static argument.
    mesh: the mesh (a pod's from ``fsm.make_mesh(..., topology=...)``
      works); default: the arguments', the step's, else the one set with
      ``jax.set_mesh``. Its axis types are ignored: the audit makes them
      Auto, then Explicit.
    rules: logical axis rules in force while tracing (None: the context's).
    **step_keywords: refused: the step is given positional arguments only
      (bind others with ``functools.partial``).

  Raises:
    AuditInputError: ``step`` is not callable, or keywords were given for it.
    NoMeshError: no mesh to be found, or ``mesh`` is not one.
    ShardingError: an argument's layout does not divide its shape, or names
      an axis the mesh lacks.

  Returns:
    An :class:`ExplicitAudit`: ``sites``, ``notes``, the two programs'
    figures, and ``fixed_step``.

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
    >>> mesh = jax.make_mesh((8,), ('model',), axis_types=(AxisType.Auto,))
    >>> x = jax.ShapeDtypeStruct((4, 16), jnp.float32,
    ...                          sharding=NamedSharding(mesh, P(None, 'model')))
    >>> w = jax.ShapeDtypeStruct((16, 2), jnp.float32,
    ...                          sharding=NamedSharding(mesh, P('model', None)))
    >>> report = fsm.audit_explicit(lambda x, w: x @ w, x, w)
    >>> [(s.op, s.how, s.spec) for s in report.sites], report.compiles
    ([('dot_general', 'out_sharding', P())], True)
  """
  check_step(step, step_keywords)
  mesh = _mesh(mesh, args, step)
  if rules is None:
    rules = getattr(step, 'rules', None)  # fsm.jit's own
  auto, explicit = _typed(mesh, AxisType.Auto), _typed(mesh, AxisType.Explicit)
  arguments = Arguments.of(args, _static_argnums(step))
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  check_divisible(args, sizes, getattr(step, 'in_shardings', None))
  traced_auto, lowered_auto, compiled_auto, auto_error = auto_program(
    step, args, arguments, auto, rules
  )
  chosen = [PartitionSpec()] * len(arguments.traced)
  if compiled_auto is not None:
    # An argument the program never reads has no sharding (None) there.
    shardings = jax.tree.leaves(compiled_auto.input_shardings[0], is_leaf=_is_none)
    chosen = [spec_of(s) for s in shardings]
  in_specs = arguments.given_specs(chosen)
  xargs = arguments.structs(explicit, in_specs)
  fn = arguments.closed(_function(step))

  def layouts(new: set[Key], specs: list[PartitionSpec]) -> dict[Key, PartitionSpec]:
    if traced_auto is None:
      return {}  # the step stops under Auto axes too: XLA gave no layout
    return auto_layouts(traced_auto, auto, new, specs)

  recorder, traced, error = rounds(fn, xargs, explicit, rules, layouts, in_specs)
  lowered = compiled = None
  if traced is not None and not error:
    try:
      with going_on(recorder), rules_in(rules), jax.set_mesh(explicit), same_mesh():
        lowered = traced.lower()
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - reported: the proof did not hold
      error = stopped(e)
  found = tuple(sites(recorder.refused))
  fixes = [s.fix for s in found]
  return ExplicitAudit(
    sites=found,
    notes=tuple(notes_of(recorder, in_specs, mesh, args, rules, fixes)),
    mesh=explicit,
    auto=None if compiled_auto is None else figures(lowered_auto, compiled_auto, auto),
    explicit=None if compiled is None else figures(lowered, compiled, explicit),
    error=error or auto_error,
    fixed_step=runner(compiled, arguments, xargs, explicit),
    auto_error=auto_error,
  )


def _static_argnums(step: Any) -> frozenset[int]:
  """A jitted step's static positional arguments (jax.jit's or fsm.jit's)."""
  info = getattr(step, '_jit_info', None)
  found = getattr(info, 'static_argnums', None)
  if found is None:
    found = (getattr(step, '_jit_kwargs', None) or {}).get('static_argnums', ())
  if isinstance(found, int):
    found = (found,)
  return frozenset(int(n) for n in found or ())


def _mesh(mesh: AnyMesh | None, args: Any, step: Any) -> AnyMesh:
  if isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
    return mesh
  if mesh is not None:
    from flax_shardmeta._errors import NoMeshError

    raise NoMeshError(
      f'audit_explicit needs a mesh, got mesh={mesh!r} ({type(mesh).__name__}): '
      'pass a jax.sharding.Mesh (e.g. jax.make_mesh((2, 4), ("data", "model"))) '
      "or an AbstractMesh, or leave mesh= out to take the arguments' own."
    )
  for leaf in jax.tree.leaves(args):
    sharding = getattr(leaf, 'sharding', None)
    if isinstance(sharding, NamedSharding):
      return sharding.mesh
  found = getattr(step, 'mesh', None)
  if found is not None:
    return found
  context = jax.sharding.get_mesh()
  if not context.empty:
    return context
  from flax_shardmeta._errors import NoMeshError

  raise NoMeshError(
    'audit_explicit needs a mesh: its arguments carry no NamedSharding and the '
    'step none. Pass mesh=..., give the arguments shardings '
    '(jax.ShapeDtypeStruct(..., sharding=NamedSharding(mesh, spec))), or run '
    'inside `with jax.set_mesh(mesh):`.'
  )


def _typed(mesh: AnyMesh, kind: AxisType) -> Any:
  types = (kind,) * len(mesh.axis_names)
  if isinstance(mesh, jax.sharding.Mesh):
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=types)
  return jax.sharding.AbstractMesh(
    tuple(mesh.axis_sizes), tuple(mesh.axis_names), axis_types=types
  )


def _is_none(x: Any) -> bool:
  return x is None


def _function(step: Any) -> Callable[..., Any]:
  """The Python function a jitted step wraps (fsm.jit's, jax.jit's).

  Only a jitted one: ``jax.grad``'s result (or any ``functools.wraps``
  decorator's) also has ``__wrapped__``, the function before the transform.
  """
  if not hasattr(step, 'lower'):
    return step
  return getattr(step, '_fn', None) or getattr(step, '__wrapped__', None) or step


@dataclasses.dataclass(frozen=True)
class ExplicitAudit(ShownWithTreescope):
  """What moving a step from Auto to Explicit axes takes, and costs.

  Attributes:
    sites: every refused operation, one per line of code and fix, largest
      value first.
    notes: size-1 axes, rules naming one axis twice, calls that cannot see
      Explicit axes.
    mesh: the Explicit mesh.
    auto, explicit: the compiled programs' figures (``explicit`` is None if
      the fixed step did not compile, ``auto`` if the step stops under Auto
      axes too; ``error`` says why).
    error: empty when the fixed step compiled under Explicit axes; else where
      and why it stopped (the sites are those found before that point).
    fixed_step: the step with every fix applied, on the Explicit mesh; takes
      the step's arguments.
    auto_error: where the step stops under Auto axes (its own error, not a
      sharding one), or empty.

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
    >>> mesh = jax.make_mesh((8,), ('model',), axis_types=(AxisType.Auto,))
    >>> x = jax.ShapeDtypeStruct((4, 16), jnp.float32,
    ...                          sharding=NamedSharding(mesh, P(None, 'model')))
    >>> report = fsm.audit_explicit(jnp.sum, x)
    >>> report.sites, report.compiles
    ((), True)
    >>> report.explicit.collectives == report.auto.collectives
    True
  """

  sites: tuple[Site, ...]
  notes: tuple[Note, ...]
  mesh: Any
  auto: ProgramFigures | None
  explicit: ProgramFigures | None
  error: str
  fixed_step: Callable[..., Any] = dataclasses.field(repr=False, compare=False)
  auto_error: str = ''

  @property
  def compiles(self) -> bool:
    """Whether the step with every fix compiled under Explicit axes."""
    return self.explicit is not None and not self.error

  def costs_more(self) -> list[str]:
    """Where the Explicit program spends more than the Auto one (by over
    :data:`MORE`), in words; empty when it does not."""
    if self.explicit is None or self.auto is None:
      return []
    out = []
    a, e = self.auto, self.explicit
    for key in sorted(set(a.collectives) | set(e.collectives)):
      before, after = a.collectives.get(key, 0), e.collectives.get(key, 0)
      if after > before * (1 + MORE) and after - before > 0:
        kind, axes = key
        out.append(
          f'{kind} over {",".join(axes) or "-"}: {format_bytes(after)} per chip per '
          f'step under Explicit, {format_bytes(before)} under Auto'
        )
    for name in ('sharding_ops', 'transposes', 'memory'):
      before, after = getattr(a, name), getattr(e, name)
      if after > before * (1 + MORE) and after > before:
        shown = format_bytes if name == 'memory' else str
        label = name.replace('_ops', ' annotations')
        out.append(
          f'{label}: {shown(after)} under Explicit, {shown(before)} under Auto'
        )
    return out

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form: each site, each note, both programs."""
    return {
      'mesh': dict(zip(self.mesh.axis_names, self.mesh.axis_sizes)),
      'sites': [s.to_dict() for s in self.sites],
      'notes': [n.to_dict() for n in self.notes],
      'compiles': self.compiles,
      'error': self.error,
      'auto_error': self.auto_error,
      'auto': None if self.auto is None else self.auto.to_dict(),
      'explicit': None if self.explicit is None else self.explicit.to_dict(),
      'costs_more': self.costs_more(),
    }

  def __str__(self) -> str:
    return text(self)

  def _treescope_view(self) -> dict[str, Any]:
    return {
      'sites': {
        f'{s.where} {s.op}': {
          'fix': s.fix,
          'layout': format_spec(s.spec),
          'operands': list(s.operands),
          'reason': s.reason,
          'count': s.count,
        }
        for s in self.sites
      },  # fmt: skip
      'notes': [f'{n.kind}: {n.where}: {n.what}' for n in self.notes],
      'compiles': self.compiles,
      'costs_more': self.costs_more(),
    }
