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

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from flax_shardmeta._audit.arguments import Arguments, check_divisible, check_step
from flax_shardmeta._audit.audit_report import ExplicitAudit
from flax_shardmeta._audit.figures import figures
from flax_shardmeta._audit.intercept import (
  Key,
  Recorder,
  going_on,
  same_mesh,
  value_key,
)
from flax_shardmeta._audit.notes import notes_of
from flax_shardmeta._audit.replay import Replay, equations
from flax_shardmeta._audit.sites import sites
from flax_shardmeta._errors import FlaxShardmetaError
from flax_shardmeta._frames import import_path, is_library_file, user_frame
from flax_shardmeta._rules import logical_axis_rules
from flax_shardmeta._typing import AnyMesh, LogicalRules

ROUNDS = 8
"""Traces at most: each adds XLA's layouts for refusals the last one found
(a fix gives a later operation new operand types, which jax may refuse)."""


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
  traced_auto, lowered_auto, compiled_auto, auto_error = _auto_program(
    step, args, arguments, auto, rules
  )
  chosen = [PartitionSpec()] * len(arguments.traced)
  if compiled_auto is not None:
    # An argument the program never reads has no sharding (None) there.
    shardings = jax.tree.leaves(compiled_auto.input_shardings[0], is_leaf=_is_none)
    chosen = [_spec(s) for s in shardings]
  in_specs = arguments.given_specs(chosen)
  xargs = arguments.structs(explicit, in_specs)
  fn = arguments.closed(_function(step))

  def layouts(new: set[Key], specs: list[PartitionSpec]) -> dict[Key, PartitionSpec]:
    if traced_auto is None:
      return {}  # the step stops under Auto axes too: XLA gave no layout
    return _auto_layouts(traced_auto, auto, new, specs)

  recorder, traced, error = _rounds(fn, xargs, explicit, rules, layouts, in_specs)
  lowered = compiled = None
  if traced is not None and not error:
    try:
      with going_on(recorder), _rules(rules), jax.set_mesh(explicit), same_mesh():
        lowered = traced.lower()
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - reported: the proof did not hold
      error = _stopped(e)
  found = tuple(sites(recorder.refused))
  fixes = [s.fix for s in found]
  return ExplicitAudit(
    sites=found,
    notes=tuple(notes_of(recorder, in_specs, mesh, args, rules, fixes)),
    mesh=explicit,
    auto=None if compiled_auto is None else figures(lowered_auto, compiled_auto, auto),
    explicit=None if compiled is None else figures(lowered, compiled, explicit),
    error=error or auto_error,
    fixed_step=_runner(compiled, arguments, xargs, explicit),
    auto_error=auto_error,
  )


def _auto_program(
  step: Any, args: Any, arguments: Arguments, auto: Any, rules: LogicalRules | None
) -> tuple[Any, Any, Any, str]:
  """The step traced, lowered and compiled for Auto axes; all None and the
  error, with the user's line, where it stops there (the sites that Explicit
  axes refuse before that point are still listed)."""
  with _rules(rules), jax.set_mesh(auto), same_mesh():
    try:
      traced = _trace_auto(step, args, arguments, auto)
      lowered = traced.lower()
      return traced, lowered, lowered.compile(), ''
    except FlaxShardmetaError:
      raise  # this library's own message (rules, names, a mesh) says it
    except Exception as e:  # noqa: BLE001 - reported: where the step stops
      return None, None, None, _stopped(e)


def _rounds(
  fn: Callable[..., Any], xargs: list[Any], explicit: Any,
  rules: LogicalRules | None,
  layouts: Callable[[set[Key], list[PartitionSpec]], dict[Key, PartitionSpec]],
  in_specs: list[PartitionSpec],
) -> tuple[Recorder, Any, str]:  # fmt: skip
  """Traces on Explicit axes until a round finds no refusal it has not asked
  XLA's layout of: that round's trace holds every fix listed, each with the
  layout printed. Returns its recorder, its trace (None if it stopped) and
  the error that stopped it."""
  specs: dict[Key, PartitionSpec] = {}
  asked: set[Key] = set()
  recorder, traced, error = Recorder(explicit, specs), None, ''
  for _ in range(ROUNDS):
    recorder, traced, error = Recorder(explicit, specs), None, ''
    try:
      traced = _trace_explicit(fn, xargs, explicit, rules, recorder)
    except Exception as e:  # noqa: BLE001 - reported: the trace stopped there
      error = _stopped(e)
    # One that stopped after new refusals is traced again with their layouts
    # (a replicated stand-in can break a custom_vjp's types, say); the sites
    # found before a stop are kept.
    new = ({r.key for r in recorder.refused} | set(recorder.opaque)) - asked
    if not new:
      break
    # The value each refused expression makes: its fix's layout, where the
    # operation refused is inside a call whose result is another value.
    new |= {value_key(r.key[0], r.position) for r in recorder.refused if r.position}
    asked |= new
    specs.update(layouts(new, in_specs))
  else:
    if not error:
      error = (
        f'a fix still makes another operation fail after {ROUNDS} rounds; the '
        "last round's sites are listed"
      )
  return recorder, traced, error


def _trace_auto(step: Any, args: Any, arguments: Arguments, auto: Any) -> Any:
  """The step traced for Auto axes, as jax.jit traces it."""
  if hasattr(step, 'trace') and len(arguments.traced) == len(arguments.leaves):
    return step.trace(*_onto(args, auto))  # its own jit options hold
  values = _onto(arguments.values(), auto)
  return jax.jit(arguments.closed(step)).trace(*values)


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


@contextlib.contextmanager
def _rules(rules: LogicalRules | None) -> Iterator[None]:
  if rules is None:
    yield
  else:
    with logical_axis_rules(rules):
      yield


def _onto(args: Any, mesh: Any) -> Any:
  """``args`` with each sharding's mesh made ``mesh`` (same spec)."""

  def move(x: Any) -> Any:
    sharding = getattr(x, 'sharding', None)
    if isinstance(sharding, NamedSharding) and sharding.mesh != mesh:
      new = NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=new)
    return x

  return jax.tree.map(move, args)


def _is_none(x: Any) -> bool:
  return x is None


def _spec(sharding: Any) -> PartitionSpec:
  return sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()


def _stopped(error: Exception) -> str:
  """An error that stopped the trace or the compile, with the user's line."""
  import traceback as tb

  where = ''
  for frame in reversed(tb.extract_tb(error.__traceback__)):
    if not is_library_file(frame.filename):
      where = f' (at {import_path(frame.filename)}:{frame.lineno})'
      break
  text = str(error).strip().splitlines()
  return f'{type(error).__name__}: {text[0] if text else ""}{where}'


def _frame(eqn: Any) -> tuple[str, int] | None:
  return user_frame(getattr(eqn.source_info, 'traceback', None))


def _span(eqn: Any) -> tuple[str, tuple[int, int, int, int]] | None:
  """The user's file and the span (line, end line, column, end column) of
  the expression that made ``eqn``."""
  try:
    from jax._src import source_info_util

    frames = source_info_util.user_frames(eqn.source_info.traceback)
    f = next((f for f in frames if not is_library_file(f.file_name)), None)
  except Exception:  # noqa: BLE001 - a changed private API costs only the span
    return None
  if f is None:
    return None
  return f.file_name, (f.start_line, f.end_line, f.start_column, f.end_column)


def _struct(x: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _shape(aval: Any) -> tuple[int, ...]:
  return tuple(int(d) for d in getattr(aval, 'shape', ()))


def _function(step: Any) -> Callable[..., Any]:
  """The Python function a jitted step wraps (fsm.jit's, jax.jit's).

  Only a jitted one: ``jax.grad``'s result (or any ``functools.wraps``
  decorator's) also has ``__wrapped__``, the function before the transform.
  """
  if not hasattr(step, 'lower'):
    return step
  return getattr(step, '_fn', None) or getattr(step, '__wrapped__', None) or step


def _trace_explicit(
  fn: Callable[..., Any], xargs: Any, mesh: Any, rules: LogicalRules | None,
  recorder: Recorder,
) -> Any:  # fmt: skip
  # jnp's functions are jitted and their traces cached: one traced in an
  # earlier round holds that round's fixes. A new function each time, and no
  # cached trace, before and after (none with fixes may outlive the audit).
  jax.clear_caches()
  try:
    with going_on(recorder), _rules(rules), jax.set_mesh(mesh), same_mesh():
      return jax.jit(lambda *a: fn(*a)).trace(*xargs)
  finally:
    jax.clear_caches()


def _auto_layouts(
  traced: Any, auto: Any, wanted: set[Key], in_specs: list[PartitionSpec]
) -> dict[Key, PartitionSpec]:
  """XLA's layout under Auto axes of the first value of each wanted key."""
  closed = traced.jaxpr
  first: dict[Key, int] = {}
  # A custom_vjp's bwd rule keeps, under Auto, the line that took the
  # gradient, not its own: a key found nowhere else is matched without its
  # file and line, where the program holds one such operation only.
  elsewhere: dict[tuple[Any, ...], set[int]] = {}
  for eqn, frame in equations(closed.jaxpr, _frame):
    if frame is None:
      continue
    shapes = tuple(_shape(v.aval) for v in eqn.invars)
    key = (frame[0], frame[1], eqn.primitive.name, shapes)
    if key in wanted:
      first.setdefault(key, id(eqn))
    elsewhere.setdefault(key[2:], set()).add(id(eqn))
    if eqn.outvars and 'transpose' not in str(eqn.source_info.name_stack):
      # An expression's value: the last forward value made at its span (a
      # call's own equation comes after its body's).
      span = _span(eqn)
      if span is not None and value_key(*span) in wanted:
        first[value_key(*span)] = id(eqn)
      # A jnp function refused in Python is known by its result: the last
      # forward value of that shape its line makes.
      made = (_shape(eqn.outvars[0].aval),)
      for want in wanted:
        if want[:2] == frame and want[2].startswith('jnp.') and want[3] == made:
          first[want] = id(eqn)
  for want in wanted - set(first):
    found = elsewhere.get(want[2:], set())
    if len(found) == 1:
      first[want] = next(iter(found))
  if not first:
    return {}
  replay = Replay(frozenset(first.values()))
  run = replay.function(closed)
  consts = tuple(getattr(traced, '_consts', ()))
  n = len(consts)
  avals = list(closed.in_avals)[n:]
  with jax.set_mesh(auto):
    structs = [_struct(a, NamedSharding(auto, s)) for a, s in zip(avals, in_specs)]
    compiled = jax.jit(lambda *xs: run(*consts, *xs)).lower(*structs).compile()
  depths = replay.export_depths()
  by_id = compiled.output_shardings[1]
  got = {}
  for key, k in first.items():
    if k in by_id:
      spec = tuple(_spec(by_id[k]))
      # A value inside a scan comes back stacked over its iterations.
      got[key] = PartitionSpec(*spec[depths.get(k, 0) :])
  return got


def _runner(
  compiled: Any, arguments: Arguments, xargs: list[Any], mesh: Any
) -> Callable[..., Any]:
  """The step with every fix, compiled on the Explicit mesh: same arguments."""
  shardings = [x.sharding for x in xargs]

  def fixed_step(*args: Any) -> Any:
    if compiled is None:
      raise RuntimeError('the step did not compile under Explicit axes (see error)')
    values = arguments.traced_of(args)
    with jax.set_mesh(mesh):
      put = [
        jax.device_put(v, s) if hasattr(v, 'shape') else v
        for v, s in zip(values, shardings)
      ]
      return compiled(*put)

  return fixed_step
