"""Tracing an audited step under each axis type.

The Auto program (traced, lowered and compiled as ``jax.jit`` would), the
rounds on Explicit axes that go on past each refused operation, XLA's Auto
layouts of the refused values (``replay``), and the step with every fix,
compiled on the Explicit mesh.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from flax_shardmeta._audit.arguments import Arguments
from flax_shardmeta._audit.intercept import (
  Key,
  Recorder,
  going_on,
  same_mesh,
  value_key,
)
from flax_shardmeta._audit.replay import Replay, equations
from flax_shardmeta._errors import FlaxShardmetaError
from flax_shardmeta._frames import import_path, is_library_file, user_frame
from flax_shardmeta._rules import logical_axis_rules
from flax_shardmeta._typing import LogicalRules

ROUNDS = 8
"""Traces at most: each adds XLA's layouts for refusals the last one found
(a fix gives a later operation new operand types, which jax may refuse)."""


def auto_program(
  step: Any, args: Any, arguments: Arguments, auto: Any, rules: LogicalRules | None
) -> tuple[Any, Any, Any, str]:
  """The step traced, lowered and compiled for Auto axes; all None and the
  error, with the user's line, where it stops there (the sites that Explicit
  axes refuse before that point are still listed)."""
  with rules_in(rules), jax.set_mesh(auto), same_mesh():
    try:
      traced = trace_auto(step, args, arguments, auto)
      lowered = traced.lower()
      return traced, lowered, lowered.compile(), ''
    except FlaxShardmetaError:
      raise  # this library's own message (rules, names, a mesh) says it
    except Exception as e:  # noqa: BLE001 - reported: where the step stops
      return None, None, None, stopped(e)


def rounds(
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
      traced = trace_explicit(fn, xargs, explicit, rules, recorder)
    except Exception as e:  # noqa: BLE001 - reported: the trace stopped there
      error = stopped(e)
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


def trace_auto(step: Any, args: Any, arguments: Arguments, auto: Any) -> Any:
  """The step traced for Auto axes, as jax.jit traces it."""
  if hasattr(step, 'trace') and len(arguments.traced) == len(arguments.leaves):
    return step.trace(*onto(args, auto))  # its own jit options hold
  values = onto(arguments.values(), auto)
  return jax.jit(arguments.closed(step)).trace(*values)


@contextlib.contextmanager
def rules_in(rules: LogicalRules | None) -> Iterator[None]:
  if rules is None:
    yield
  else:
    with logical_axis_rules(rules):
      yield


def onto(args: Any, mesh: Any) -> Any:
  """``args`` with each sharding's mesh made ``mesh`` (same spec)."""

  def move(x: Any) -> Any:
    sharding = getattr(x, 'sharding', None)
    if isinstance(sharding, NamedSharding) and sharding.mesh != mesh:
      new = NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=new)
    return x

  return jax.tree.map(move, args)


def spec_of(sharding: Any) -> PartitionSpec:
  return sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()


def stopped(error: Exception) -> str:
  """An error that stopped the trace or the compile, with the user's line."""
  import traceback as tb

  where = ''
  for frame in reversed(tb.extract_tb(error.__traceback__)):
    if not is_library_file(frame.filename):
      where = f' (at {import_path(frame.filename)}:{frame.lineno})'
      break
  text = str(error).strip().splitlines()
  return f'{type(error).__name__}: {text[0] if text else ""}{where}'


def frame_of(eqn: Any) -> tuple[str, int] | None:
  return user_frame(getattr(eqn.source_info, 'traceback', None))


def span_of(eqn: Any) -> tuple[str, tuple[int, int, int, int]] | None:
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


def struct_of(x: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def shape_of(aval: Any) -> tuple[int, ...]:
  return tuple(int(d) for d in getattr(aval, 'shape', ()))


def trace_explicit(
  fn: Callable[..., Any], xargs: Any, mesh: Any, rules: LogicalRules | None,
  recorder: Recorder,
) -> Any:  # fmt: skip
  # jnp's functions are jitted and their traces cached: one traced in an
  # earlier round holds that round's fixes. A new function each time, and no
  # cached trace, before and after (none with fixes may outlive the audit).
  jax.clear_caches()
  try:
    with going_on(recorder), rules_in(rules), jax.set_mesh(mesh), same_mesh():
      return jax.jit(lambda *a: fn(*a)).trace(*xargs)
  finally:
    jax.clear_caches()


def auto_layouts(
  traced: Any, auto: Any, wanted: set[Key], in_specs: list[PartitionSpec]
) -> dict[Key, PartitionSpec]:
  """XLA's layout under Auto axes of the first value of each wanted key."""
  closed = traced.jaxpr
  first: dict[Key, int] = {}
  # A custom_vjp's bwd rule keeps, under Auto, the line that took the
  # gradient, not its own: a key found nowhere else is matched without its
  # file and line, where the program holds one such operation only.
  elsewhere: dict[tuple[Any, ...], set[int]] = {}
  for eqn, frame in equations(closed.jaxpr, frame_of):
    if frame is None:
      continue
    shapes = tuple(shape_of(v.aval) for v in eqn.invars)
    key = (frame[0], frame[1], eqn.primitive.name, shapes)
    if key in wanted:
      first.setdefault(key, id(eqn))
    elsewhere.setdefault(key[2:], set()).add(id(eqn))
    if eqn.outvars and 'transpose' not in str(eqn.source_info.name_stack):
      # An expression's value: the last forward value made at its span (a
      # call's own equation comes after its body's).
      span = span_of(eqn)
      if span is not None and value_key(*span) in wanted:
        first[value_key(*span)] = id(eqn)
      # A jnp function refused in Python is known by its result: the last
      # forward value of that shape its line makes.
      made = (shape_of(eqn.outvars[0].aval),)
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
    structs = [struct_of(a, NamedSharding(auto, s)) for a, s in zip(avals, in_specs)]
    compiled = jax.jit(lambda *xs: run(*consts, *xs)).lower(*structs).compile()
  depths = replay.export_depths()
  by_id = compiled.output_shardings[1]
  got = {}
  for key, k in first.items():
    if k in by_id:
      spec = tuple(spec_of(by_id[k]))
      # A value inside a scan comes back stacked over its iterations.
      got[key] = PartitionSpec(*spec[depths.get(k, 0) :])
  return got


def runner(
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
