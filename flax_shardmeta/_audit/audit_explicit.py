"""``fsm.audit_explicit``: every site a step written for Auto axes needs
changed for Explicit ones, the fix that keeps its layout, and the proof.

The step is traced and compiled on its mesh with Auto axes. It is then
traced again, as the user's code, on the same mesh with every axis Explicit,
going on past each operation jax refuses (``intercept``). A fix's layout is
XLA's: the refused values are returned as extra outputs of the Auto program
(``replay``), whose compiled output shardings say how XLA lays each out. A
round traces again with those layouts (a fix may make a later operation
fail: it is listed then), until every refusal has XLA's layout or a few
rounds have run. The last trace, every fix in it, is compiled under Explicit
axes and set beside the Auto program (``figures``); ``report.fixed_step``
runs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from flax_shardmeta._audit.audit_report import ExplicitAudit
from flax_shardmeta._audit.figures import figures
from flax_shardmeta._audit.intercept import Key, Recorder, going_on
from flax_shardmeta._audit.notes import notes_of
from flax_shardmeta._audit.replay import Replay, equations
from flax_shardmeta._audit.sites import sites
from flax_shardmeta._frames import import_path, is_library_file, user_frame
from flax_shardmeta._rules import logical_axis_rules
from flax_shardmeta._typing import AnyMesh, LogicalRules

ROUNDS = 3
"""Replays at most: each adds XLA's layouts for refusals the last one found."""


def audit_explicit(
  step: Callable[..., Any],
  *args: Any,
  mesh: AnyMesh | None = None,
  rules: LogicalRules | None = None,
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
      arrays.
    mesh: the mesh (a pod's from ``fsm.make_mesh(..., topology=...)``
      works); default: the arguments' or the step's. Its axis types are
      ignored: the audit makes them Auto, then Explicit.
    rules: logical axis rules in force while tracing (None: the context's).

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
  mesh = _mesh(mesh, args, step)
  if rules is None:
    rules = getattr(step, 'rules', None)  # fsm.jit's own
  auto, explicit = _typed(mesh, AxisType.Auto), _typed(mesh, AxisType.Explicit)
  with _rules(rules), jax.set_mesh(auto):
    traced_auto = _jitted(step).trace(*_onto(args, auto))
    lowered_auto = traced_auto.lower()
    compiled_auto = lowered_auto.compile()
  in_shardings = compiled_auto.input_shardings[0]
  in_specs = [_spec(s) for s in jax.tree.leaves(in_shardings)]
  xargs = jax.tree.map(
    lambda x, s: _struct(x, NamedSharding(explicit, _spec(s))),
    tuple(args),
    tuple(in_shardings),
  )
  fn = _function(step)
  specs: dict[Key, PartitionSpec] = {}
  error, traced, lowered, compiled = '', None, None, None
  for _ in range(ROUNDS):
    recorder = Recorder(explicit, specs)
    try:
      traced = _trace_explicit(fn, xargs, explicit, rules, recorder)
    except Exception as e:  # noqa: BLE001 - reported: the trace stopped there
      error = _stopped(e)
      break
    missing = {r.key for r in recorder.refused} | set(recorder.opaque)
    missing -= set(specs)
    if not missing:
      break
    specs.update(_auto_layouts(traced_auto, auto, missing, in_specs))
  try:
    if traced is not None and not error:
      with going_on(recorder), _rules(rules), jax.set_mesh(explicit):
        lowered = traced.lower()
        compiled = lowered.compile()
  except Exception as e:  # noqa: BLE001 - reported: the proof did not hold
    error = _stopped(e)
  return ExplicitAudit(
    sites=tuple(sites(recorder.refused)),
    notes=tuple(notes_of(recorder, in_specs, mesh, args, rules)),
    mesh=explicit,
    auto=figures(lowered_auto, compiled_auto, auto),
    explicit=None if compiled is None else figures(lowered, compiled, explicit),
    error=error,
    fixed_step=_runner(compiled, xargs, explicit),
  )


def _mesh(mesh: AnyMesh | None, args: Any, step: Any) -> AnyMesh:
  if mesh is not None:
    return mesh
  for leaf in jax.tree.leaves(args):
    sharding = getattr(leaf, 'sharding', None)
    if isinstance(sharding, NamedSharding):
      return sharding.mesh
  found = getattr(step, 'mesh', None)
  if found is not None:
    return found
  from flax_shardmeta._errors import NoMeshError

  raise NoMeshError(
    'audit_explicit needs a mesh: pass mesh= or arguments with shardings'
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


def _jitted(step: Callable[..., Any]) -> Any:
  return step if hasattr(step, 'trace') else jax.jit(step)


def _onto(args: Any, mesh: Any) -> Any:
  """``args`` with each sharding's mesh made ``mesh`` (same spec)."""

  def move(x: Any) -> Any:
    sharding = getattr(x, 'sharding', None)
    if isinstance(sharding, NamedSharding) and sharding.mesh != mesh:
      new = NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=new)
    return x

  return jax.tree.map(move, args)


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


def _struct(x: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _shape(aval: Any) -> tuple[int, ...]:
  return tuple(int(d) for d in getattr(aval, 'shape', ()))


def _function(step: Any) -> Callable[..., Any]:
  """The Python function a jitted step wraps (fsm.jit's, jax.jit's)."""
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
    with going_on(recorder), _rules(rules), jax.set_mesh(mesh):
      return jax.jit(lambda *a: fn(*a)).trace(*xargs)
  finally:
    jax.clear_caches()


def _auto_layouts(
  traced: Any, auto: Any, wanted: set[Key], in_specs: list[PartitionSpec]
) -> dict[Key, PartitionSpec]:
  """XLA's layout under Auto axes of the first value of each wanted key."""
  closed = traced.jaxpr
  first: dict[Key, int] = {}
  for eqn, frame in equations(closed.jaxpr, _frame):
    if frame is None:
      continue
    shapes = tuple(_shape(v.aval) for v in eqn.invars)
    key = (frame[0], frame[1], eqn.primitive.name, shapes)
    if key in wanted:
      first.setdefault(key, id(eqn))
    # A jnp function refused in Python is known by its result: the last
    # forward value of that shape its line makes.
    if eqn.outvars and 'transpose' not in str(eqn.source_info.name_stack):
      made = (_shape(eqn.outvars[0].aval),)
      for want in wanted:
        if want[:2] == frame and want[2].startswith('jnp.') and want[3] == made:
          first[want] = id(eqn)
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


def _runner(compiled: Any, xargs: Any, mesh: Any) -> Callable[..., Any]:
  """The step with every fix, compiled on the Explicit mesh: same arguments."""
  shardings = jax.tree.map(lambda x: x.sharding, xargs)

  def fixed_step(*args: Any) -> Any:
    if compiled is None:
      raise RuntimeError('the step did not compile under Explicit axes (see error)')
    with jax.set_mesh(mesh):
      return compiled(*jax.device_put(args, shardings))

  return fixed_step
