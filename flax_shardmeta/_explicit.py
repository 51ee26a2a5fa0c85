"""Explicit mesh axes: out_sharding by logical names; jax's type errors explained.

Under Explicit axes every array's type carries its sharding, and jax refuses,
while tracing, an operation whose output sharding it cannot infer: a matmul
contracting a sharded dimension raises ``ShardingTypeError: Contracting
dimensions are sharded and it is ambiguous how the output should be sharded``.
There are two fixes: Auto axes (the compiler chooses), or an ``out_sharding=``
at that operation. :func:`logical_out_sharding` gives the latter by logical
names, and is None wherever the axes are not Explicit, so the same model code
runs on Auto meshes and under ``fsm.sharded_init`` (which traces with Auto
axes). :func:`explain_sharding_type_errors` re-raises jax's error as
:class:`ExplicitShardingError` naming the operation's source line, its operands'
shardings and both fixes; ``fsm.jit`` and ``fsm.sharded_init`` trace inside it.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import jax
from jax.sharding import AxisType, PartitionSpec

from flax_shardmeta import _unmapped as unmapped_lib
from flax_shardmeta._errors import ExplicitShardingError
from flax_shardmeta._frames import in_dirs, jax_dirs, library_dirs
from flax_shardmeta._names import as_names
from flax_shardmeta._placement import context_mesh
from flax_shardmeta._resolution import resolve
from flax_shardmeta._rules import SOURCE_NONE, rules_and_source
from flax_shardmeta._specs import UNASSIGNED, mesh_axes_of, unassigned_to_none
from flax_shardmeta._typing import LogicalNames, LogicalRules


class _NeverRaised(Exception):
  """Stands in for jax's ShardingTypeError if a future jax moves it."""


def _jax_sharding_type_error() -> type[Exception]:
  # jax raises it but does not export it; if it moves, its errors simply pass
  # through unchanged.
  try:
    from jax._src.core import ShardingTypeError
  except ImportError:  # pragma: no cover - depends on the installed jax
    return _NeverRaised
  return ShardingTypeError


_JaxShardingTypeError = _jax_sharding_type_error()

# jax's messages refusing a PartitionSpec out_sharding that names Auto axes, or
# is given with no mesh set. fsm.sharded_init traces first with no mesh, then
# with Auto axes, so a spec written for Explicit ones meets both there.
_REFUSED_OUT_SHARDING = (
  'cannot contain axis names that are of type Auto',
  'PartitionSpec when you are not under a mesh context',
)


def logical_out_sharding(
  names: LogicalNames, *, rules: LogicalRules | None = None
) -> PartitionSpec | None:
  """An ``out_sharding=`` for jax and flax operations, by logical names.

  The names resolve through the rules like any annotation, and only the
  context mesh's Explicit axes are kept: Auto axes are the compiler's to
  choose (jax refuses them in ``out_sharding``), Manual ones belong to
  ``shard_map``. With no mesh set, or no Explicit axis, it is None, which
  every ``out_sharding`` argument accepts; so one model runs on Auto and
  Explicit meshes and under ``fsm.sharded_init`` alike. Call it while the
  model is traced (inside ``fsm.jit``, or under ``jax.set_mesh`` and the
  rules), where it is needed: NNX layers take ``layer(x, out_sharding=...)``,
  ``jnp.dot`` / ``jnp.einsum`` / ``jax.lax.dot_general`` take
  ``out_sharding=``, and a Linen ``nn.Dense`` takes
  ``dot_general=functools.partial(jax.lax.dot_general, out_sharding=...)``.

  Args:
    names: one logical name (or None) per dimension of the output.
    rules: logical axis rules; None uses the context rules.

  Returns:
    A ``PartitionSpec`` of Explicit mesh axes, or None.

  Example:
    >>> import jax, flax_shardmeta as fsm
    >>> from jax.sharding import AxisType
    >>> rules = [('batch', 'data'), ('embed', 'model')]
    >>> explicit = jax.make_mesh((2, 4), ('data', 'model'),
    ...                          axis_types=(AxisType.Explicit,) * 2)
    >>> with jax.set_mesh(explicit):
    ...   fsm.logical_out_sharding(('batch', 'embed'), rules=rules)
    P('data', 'model')
    >>> auto = jax.make_mesh((2, 4), ('data', 'model'),
    ...                      axis_types=(AxisType.Auto,) * 2)
    >>> with jax.set_mesh(auto):
    ...   print(fsm.logical_out_sharding(('batch', 'embed'), rules=rules))
    None
  """
  mesh = context_mesh()
  if mesh is None:
    return None
  explicit = {
    name
    for name, kind in zip(mesh.axis_names, mesh.axis_types)
    if kind == AxisType.Explicit
  }
  if not explicit:
    return None
  spec = _resolved(names, rules, mesh.axis_names)
  kept = []
  for entry in spec:
    axes = tuple(a for a in mesh_axes_of(entry) if a in explicit)
    kept.append(axes[0] if len(axes) == 1 else (axes or None))
  return PartitionSpec(*kept)


def _resolved(
  names: LogicalNames, rules: LogicalRules | None, axes: Any
) -> PartitionSpec:
  """``names`` resolved, names no rule maps reported as ``fsm.plan`` does
  (also when no rules are given or set at all: the output would be replicated
  with no word)."""
  rules_t, source = rules_and_source(rules)
  written = as_names(names)
  resolved = resolve(written, rules_t)
  spec = PartitionSpec(*unassigned_to_none(resolved))
  missing = unmapped_lib.unmapped_names(written, resolved, UNASSIGNED)
  if missing:
    record = unmapped_lib.Unmapped(
      f'logical_out_sharding({written!r})', None, written, spec, missing, rules_t
    )
    # warn <- _warn_* <- report <- here <- logical_out_sharding <- user.
    unmapped_lib.report(
      [record], axes, False, stacklevel=4, no_rules=source == SOURCE_NONE
    )
  return spec


@contextlib.contextmanager
def explain_sharding_type_errors(operation: str) -> Iterator[None]:
  """Re-raises jax's sharding type errors as :class:`ExplicitShardingError`.

  Enter it inside the function being traced (as ``fsm.jit`` does around the
  jitted function): there the traceback still holds jax's own frames, so the
  error names the primitive and its operands' types (``float32[8,16@model]``:
  dimension 1 sharded over ``'model'``). Entered around a ``jax.jit`` call
  instead, jax has already filtered its frames out and the operands are read
  from the local variables of the operation's frame. Other exceptions pass
  through unchanged. Also explained: jax's refusal of an ``out_sharding``
  naming Auto axes or given with no mesh set, which code written for
  Explicit axes meets under ``fsm.sharded_init``.

  Args:
    operation: what was being traced, for the message, e.g. ``'fsm.jit'``.

  Raises:
    ExplicitShardingError: with ``.source`` (the operation's ``file:line``),
      ``.operands`` and ``.jax_message``; the original error is its cause.

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ('model',), axis_types=(AxisType.Explicit,))
    >>> x = jax.device_put(jnp.ones((4, 16)), NamedSharding(mesh, P(None, 'model')))
    >>> w = jax.device_put(jnp.ones((16, 2)), NamedSharding(mesh, P('model', None)))
    >>> def f(x, w):
    ...   with fsm.explain_sharding_type_errors('my_step'):
    ...     return x @ w
    >>> try:
    ...   with jax.set_mesh(mesh):
    ...     jax.jit(f)(x, w)
    ... except fsm.ExplicitShardingError as e:
    ...   print(e.operands)
    ('float32[4,16@model]', 'float32[16@model,2]')
  """
  try:
    yield
  except _JaxShardingTypeError as e:
    raise _explained(e, operation, auto_out_sharding=False) from e
  except ValueError as e:
    refused = any(m in str(e) for m in _REFUSED_OUT_SHARDING)
    if isinstance(e, ExplicitShardingError) or not refused:
      raise
    raise _explained(e, operation, auto_out_sharding=True) from e


def _explained(
  error: Exception, operation: str, *, auto_out_sharding: bool
) -> ExplicitShardingError:
  frames = _frames(error.__traceback__)
  outside_jax = [i for i, f in enumerate(frames) if not _in(f, _JAX_DIRS)]
  op_frame = frames[outside_jax[-1]] if outside_jax else None
  primitive, operands = operands_from_frames(frames, op_frame)
  if primitive is None and outside_jax and outside_jax[-1] + 1 < len(frames):
    primitive = frames[outside_jax[-1] + 1][0].f_code.co_name  # the jax function
  user_frame = next((f for f in reversed(frames) if not _in(f, library_dirs())), None)
  source = _where(op_frame) if op_frame is not None else '<unknown>'
  what = primitive or 'an operation'
  if auto_out_sharding:
    head = f'{operation}: {what} was given an out_sharding it cannot take here'
  else:
    head = f'{operation}: jax cannot infer the sharding of {what} on Explicit mesh axes'
  lines = [head]
  if user_frame is not None and user_frame is not op_frame:
    lines.append(f'  at {_where(user_frame)}')
    lines.append(f'  inside {source}')
  else:
    lines.append(f'  at {source}')
  if operands:
    lines.append(f'  operands: {", ".join(operands)}')
  lines.append(f'  jax: {str(error).splitlines()[0] if str(error) else type(error)}')
  if auto_out_sharding:
    lines.append(
      'Fix: pass out_sharding=fsm.logical_out_sharding(names): it keeps only '
      'Explicit axes and is None with no mesh or on Auto axes (fsm.sharded_init '
      'traces with both), so the same code runs everywhere.'
    )
  else:
    lines += [
      'Fix, either:',
      '  - Auto axes, so the compiler chooses: '
      'fsm.make_mesh(sizes, names, axis_types=(AxisType.Auto,) * len(names)); or',
      "  - the output's sharding at that line: out_sharding="
      "fsm.logical_out_sharding(('batch', 'embed')) (jnp.dot, jnp.einsum, "
      'jax.lax.dot_general, NNX layers as layer(x, out_sharding=...); a Linen '
      'nn.Dense takes dot_general=functools.partial(jax.lax.dot_general, '
      'out_sharding=...)).',
    ]
  return ExplicitShardingError(
    '\n'.join(lines),
    operation=operation,
    source=source,
    operands=tuple(operands),
    jax_message=str(error),
  )


_Frame = tuple[types.FrameType, int]


def _frames(tb: types.TracebackType | None) -> list[_Frame]:
  """(frame, line) from the outermost to the innermost."""
  out = []
  while tb is not None:
    out.append((tb.tb_frame, tb.tb_lineno))
    tb = tb.tb_next
  return out


_JAX_DIRS = jax_dirs()


def _in(frame: _Frame, dirs: tuple[str, ...]) -> bool:
  return in_dirs(frame[0].f_code.co_filename, dirs)


def _where(frame: _Frame) -> str:
  code, line = frame[0].f_code, frame[1]
  text = linecache.getline(code.co_filename, line).strip()
  return f'{_short(code.co_filename)}:{line} in {code.co_name}' + (
    f': {text}' if text else ''
  )


def _short(file: str) -> str:
  """A file relative to the working directory, or an installed package's
  relative to its site-packages directory."""
  roots = [os.getcwd()] + [e for e in sys.path if e and 'site-packages' in e]
  for root in roots:
    if file.startswith(root + os.sep):
      return file[len(root) + 1 :]
  return file


# The names of the local variables read by operands_from_frames: those of
# jax's own frames that bind a primitive (core.Primitive.bind and
# bind_with_trace, lax.utils.standard_abstract_eval and the sharding rules
# it calls, partial_eval's process_primitive).
_AVALS_LOCAL = 'avals'
_PRIMITIVE_LOCALS = ('prim', 'primitive', 'self')


def operands_from_frames(
  frames: list[_Frame], op_frame: _Frame | None
) -> tuple[str | None, tuple[str, ...]]:
  """The primitive jax was binding and its operands' types, read from the
  local variables of the traceback's frames; ``(None, ())`` when they cannot be.

  The one place that reads frames' locals, because jax's ShardingTypeError
  names neither the primitive nor its operands' shardings, and jax gives no
  structured way to them: they are local variables of its own frames. Relied
  on (jax 0.10.2 to 0.12): some frame below the operation holds ``avals``
  (the operands' abstract values, with ``str_short``) next to the
  ``jax.extend.core.Primitive`` being bound, as ``prim``, ``primitive`` or
  ``self``; the innermost such frame is read. Where jax has filtered its own
  frames out (the error caught around a ``jax.jit`` call), the jax Arrays
  among the local variables of the operation's own frame stand in, named.
  Anything else (locals renamed, another kind of aval) gives no operands:
  the error is still explained, without them, never with wrong ones.
  tests/test_explicit.py provokes real errors from flax layers and checks
  the operands read, so a jax release that moves them is noticed there.
  """
  try:
    from jax.extend.core import Primitive

    for frame, _ in reversed(frames):
      local = frame.f_locals
      avals = local.get(_AVALS_LOCAL)
      prim: Any = next(
        (local[n] for n in _PRIMITIVE_LOCALS if isinstance(local.get(n), Primitive)),
        None,
      )
      if isinstance(avals, (list, tuple)) and avals and prim is not None:
        return str(prim.name), tuple(_type_of(a) for a in avals)
    if op_frame is None:
      return None, ()
    return None, tuple(
      f'{name}: {_type_of(value)}'
      for name, value in op_frame[0].f_locals.items()
      if isinstance(value, jax.Array)  # tracers are jax.Arrays too
    )
  except Exception:  # noqa: BLE001 - explained without operands, never wrongly
    return None, ()


def _type_of(value: Any) -> str:
  """``float32[8@data,16@model]``: an array's (or aval's) short type."""
  aval = getattr(value, 'aval', value)
  short = getattr(aval, 'str_short', None)
  return str(short()) if callable(short) else str(aval)
