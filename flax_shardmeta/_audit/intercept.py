"""The user's step traced on Explicit axes, going on past every refusal.

jax raises a sharding type error from the primitive being bound, with the
user's frame on the stack, and stops there. While :func:`going_on` is
active, a refused bind is recorded (the user's ``file:line``, the operation,
its operands' types, jax's reason) and bound again with the fix: the
operation's own ``out_sharding`` / ``sharding`` where it has one, else the
operation under ``jax.sharding.auto_axes``; both give the result the layout
asked for. The trace then goes on as the user's code does, so autodiff
derives the gradient from the fixed operation as it would from the edited
code, and a fix that makes a later operation fail shows that one too. Each
bind is fixed once: nothing loops.

jax caches the trace of a jitted function (``jnp.matmul`` is one) by its
operands' types: a trace holding one line's fix would be reused, fix and
all, at another line calling it with the same types, and that line's own
refusal never seen. Each fix therefore moves a jit cache key
(:data:`_FIXES`): a trace made after it is never one made before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.extend import core as jcore
from jax.sharding import NamedSharding, PartitionSpec

from flax_shardmeta._explicit import _JaxShardingTypeError
from flax_shardmeta._frames import is_library_file

try:  # jax's error for a spec naming one mesh axis twice
  from jax._src.named_sharding import DuplicateSpecError as _DuplicateSpecError
except ImportError:  # another jax: it raises a ValueError (caught too)
  _DuplicateSpecError = ValueError  # type: ignore[assignment,misc]

Key = tuple[str, int, str, tuple[tuple[int, ...], ...]]
"""(file, line, primitive, operand shapes): a bind told apart across traces."""

_FIXES = jax.make_user_context(None)
"""Part of jax's trace cache key: a new value at each fix (never reused)."""
_COUNT = itertools.count()

# Params that give a primitive's result its layout.
_OUT_PARAM = {'dot_general': 'out_sharding', 'reshape': 'sharding',
              'broadcast_in_dim': 'sharding'}  # fmt: skip


@dataclasses.dataclass
class Refused:
  """One bind jax refused under Explicit axes, and how the trace went on.

  Attributes:
    key: its :data:`Key`.
    op: the primitive's name.
    reason: jax's message, first line.
    operands: the operands' types as jax prints them.
    spec: the layout the fix gave the result.
    how: ``'out_sharding'``, ``'sharding'`` or ``'auto_axes'``.
    from_auto: whether ``spec`` is XLA's layout of the value under Auto axes.
    gradient: whether autodiff made this bind (jax is transposing).
    value_bytes: bytes of the result.
    layer: the flax layer making it, as ``'linen.Dense'`` / ``'nnx.Linear'``
      (its fix is a layer argument), or None.
    position: the user's call being run, as (line, end line, column, end
      column) of its expression, or None: which call of the line it is.
    value_spec: XLA's layout under Auto axes of the value that expression
      makes (a library call's result, not the operation refused inside it),
      or None where not known.
    inner: ``function (file:line)`` of the library function the user's line
      calls, where the refused operation is inside one that is not jax's.
  """

  key: Key
  op: str
  reason: str
  operands: tuple[str, ...]
  spec: PartitionSpec
  how: str
  from_auto: bool
  gradient: bool
  value_bytes: int = 0
  layer: str | None = None
  position: tuple[int, int, int, int] | None = None
  value_spec: PartitionSpec | None = None
  inner: str | None = None


class Recorder:
  """Fixes refused binds with the layouts it is given, and records them.

  Args:
    mesh: the Explicit mesh (its abstract mesh names the layouts).
    specs: per key, XLA's layout of that value under Auto axes (the first
      value with that key: a bind's primal and tangent share one).
  """

  def __init__(self, mesh: Any, specs: dict[Key, PartitionSpec] | None = None):
    self.mesh = getattr(mesh, 'abstract_mesh', mesh)
    self.specs = specs or {}
    self.refused: list[Refused] = []
    self.opaque: dict[Key, str] = {}
    self.contexts = contextlib.ExitStack()

  def record(self, refused: Refused) -> None:
    """Records a refusal; traces made from now on are new ones."""
    if refused.position is None:
      refused.position = user_position()
    if refused.inner is None:
      refused.inner = _inner_call()
    if refused.position is not None:
      refused.value_spec = self.specs.get(value_key(refused.key[0], refused.position))
    self.refused.append(refused)
    self.contexts.enter_context(_FIXES(next(_COUNT)))

  def fix(
    self, prim: Any, args: tuple[Any, ...], params: dict[str, Any],
    error: Exception, bind: Callable[..., Any],
  ) -> Any:  # fmt: skip
    key = key_of(prim, args)
    from_auto = key in self.specs
    spec = self.specs.get(key, PartitionSpec())
    param = _OUT_PARAM.get(prim.name)
    result, how = None, 'auto_axes'
    if param is not None:
      try:
        result = bind(prim, *args, **{**params, param: NamedSharding(self.mesh, spec)})
        how = param
      except _JaxShardingTypeError:
        result = None
    if result is None:
      result = _under_auto_axes(prim, args, params, spec, bind)
    self.record(Refused(
      key, prim.name, str(error).strip().split('\n')[0],
      tuple(str(jax.typeof(a)) for a in args), spec, how, from_auto,
      _in_transpose(), _nbytes(result), _layer(),
    ))  # fmt: skip
    return result

  def fix_call(
    self, name: str, f: Callable[..., Any], args: tuple[Any, ...],
    kwargs: dict[str, Any], error: Exception,
  ) -> Any:  # fmt: skip
    """A jnp function that refused in Python: called again with an
    ``out_sharding``, XLA's layout of its result where known."""
    probe = f(*args, **{**kwargs, 'out_sharding': PartitionSpec()})
    file, line = _user_frame() or ('?', 0)
    key = (file, line, name, (_shape(probe),))
    from_auto = key in self.specs
    spec = self.specs.get(key, PartitionSpec())
    result = probe if not from_auto else f(*args, **{**kwargs, 'out_sharding': spec})
    operands = tuple(str(jax.typeof(a)) for a in args if hasattr(a, 'shape'))
    self.record(Refused(
      key, name, str(error).strip().split('\n')[0], operands, spec, 'out_sharding',
      from_auto, _in_transpose(), _nbytes(result), None,
    ))  # fmt: skip
    return result

  def fix_carry(self, init: Any, specs: Any, error: Exception) -> None:
    """A loop whose body changes its carry's layout: the carry starts with
    the layout the body gives it."""
    file, line = _user_frame() or ('?', 0)
    leaves = jax.tree.leaves(init)
    key = (file, line, 'scan carry', tuple(_shape(a) for a in leaves))
    spec = next(iter(jax.tree.leaves(specs, is_leaf=_is_spec)), PartitionSpec())
    reason = str(error).strip().split('\n')[0]
    self.record(Refused(
      key, 'scan carry', reason, tuple(str(jax.typeof(a)) for a in leaves), spec,
      'reshard', True, _in_transpose(), _nbytes(init), None,
    ))  # fmt: skip


VALUE = '(value)'
"""The operation of a :func:`value_key`."""


def value_key(file: str, span: tuple[int, int, int, int]) -> Key:
  """The key asking XLA's layout of the value the user's expression at
  ``span`` (line, end line, column, end column) makes."""
  return (file, span[0], VALUE, (span,))


def _inner_call() -> str | None:
  """``function (file:line)`` of the innermost frame of a library other than
  jax's (optax, a flax layer) between the refused operation and the user's
  line: the operation is inside it, and its result need not be the value of
  the user's call."""
  frame, inner = sys._getframe(1), None
  while frame is not None:
    file = frame.f_code.co_filename
    if not file.startswith('<frozen') and not _library(file):
      break
    if inner is None and not _jax_or_ours(file):
      inner = frame
    frame = frame.f_back
  if frame is None or inner is None:
    return None
  from flax_shardmeta._frames import import_path

  where = f'{import_path(inner.f_code.co_filename)}:{inner.f_lineno}'
  return f'{inner.f_code.co_qualname} ({where})'


@functools.lru_cache(maxsize=4096)
def _jax_or_ours(file: str) -> bool:
  """Whether ``file`` is jax's, jaxlib's or this package's (the audit's own
  frames), or the interpreter's."""
  slashed = file.replace('\\', '/')
  return file.startswith('<frozen') or any(
    part in slashed for part in ('/jax/', '/jaxlib/', '/flax_shardmeta/')
  )


def _is_spec(x: Any) -> bool:
  return isinstance(x, PartitionSpec)


@contextlib.contextmanager
def going_on(recorder: Recorder) -> Iterator[None]:
  """Within it, a sharding type error at any bind is fixed and recorded."""
  primitive = jcore.Primitive
  original = primitive.bind

  def bind(self: Any, *args: Any, **params: Any) -> Any:
    if self.name in OPAQUE:
      recorder.opaque.setdefault(key_of(self, args), self.name)
    try:
      return original(self, *args, **params)
    except _JaxShardingTypeError as e:
      return recorder.fix(self, args, params, e, original)

  import jax.numpy as jnp
  from jax._src.numpy import indexing

  functions = _taking_out_sharding(jnp)
  scan, take = jax.lax.scan, indexing.rewriting_take
  primitive.bind = bind  # type: ignore[method-assign]
  for name, f in functions.items():
    setattr(jnp, name, _going_on_call(recorder, name, f))
  jax.lax.scan = _going_on_scan(recorder, scan)
  # ``x[i]`` and ``x.at[i].get()``: refused in Python, as jnp.take can be.
  indexing.rewriting_take = _going_on_call(recorder, INDEXING, take)
  recorder.contexts.enter_context(_FIXES(next(_COUNT)))
  try:
    yield
  finally:
    recorder.contexts.close()
    primitive.bind = original  # type: ignore[method-assign]
    for name, f in functions.items():
      setattr(jnp, name, f)
    jax.lax.scan = scan
    indexing.rewriting_take = take


@contextlib.contextmanager
def same_mesh() -> Iterator[None]:
  """Within it, a ``shard_map`` given the step's mesh (``mesh=m``) runs on
  the audit's: the same devices and axes, with the axis types being traced
  (as ``m`` made with those types would)."""
  from jax._src import shard_map as module

  checks = getattr(module, '_shmap_checks', None)
  if checks is None:  # another jax: shard_map is left as it is
    yield
    return

  def rebound(mesh: Any, *args: Any) -> Any:
    context = jax.sharding.get_abstract_mesh()
    if mesh is not None and not context.empty and _same_but_types(mesh, context):
      mesh = None  # the context's: what shard_map does without mesh=
    return checks(mesh, *args)

  module._shmap_checks = rebound
  try:
    yield
  finally:
    module._shmap_checks = checks


def _same_but_types(mesh: Any, context: Any) -> bool:
  abstract = getattr(mesh, 'abstract_mesh', mesh)
  return (
    tuple(abstract.axis_names) == tuple(context.axis_names)
    and tuple(abstract.axis_sizes) == tuple(context.axis_sizes)
    and abstract != context
  )


def _going_on_scan(recorder: Recorder, scan: Callable[..., Any]) -> Any:
  """``jax.lax.scan`` whose carry, if its body changes the carry's layout,
  starts with the layout the body gives it (as the user's fix would)."""

  @functools.wraps(scan)
  def call(
    f: Callable[..., Any], init: Any, xs: Any = None, *args: Any, **kw: Any
  ) -> Any:
    try:
      return scan(f, init, xs, *args, **kw)
    except TypeError as e:
      if 'carry input and carry output must have equal types' not in str(e):
        raise
      first = jax.tree.map(lambda a: a[0], xs) if xs is not None else None
      out = jax.eval_shape(lambda c, x: f(c, x)[0], init, first)
      specs = jax.tree.map(lambda o: o.sharding.spec, out)
      started = jax.tree.map(jax.sharding.reshard, init, specs)
      recorder.fix_carry(init, specs, e)
      return scan(f, started, xs, *args, **kw)

  return call


def _taking_out_sharding(module: Any) -> dict[str, Callable[..., Any]]:
  """The module's functions with an ``out_sharding`` parameter: some refuse
  Explicit operands in Python, before any primitive (``jnp.repeat``)."""
  out = {}
  for name in dir(module):
    f = getattr(module, name)
    if name.startswith('_') or isinstance(f, type) or not callable(f):
      continue
    try:
      params = inspect.signature(f).parameters
    except (TypeError, ValueError):
      continue
    if 'out_sharding' in params:
      out[name] = f
  return out


INDEXING = 'getitem'
"""The name :func:`going_on` gives indexing (``x[i]``), jnp's ``rewriting_take``."""


def _going_on_call(recorder: Recorder, name: str, f: Callable[..., Any]) -> Any:
  @functools.wraps(f)
  def call(*args: Any, **kwargs: Any) -> Any:
    try:
      return f(*args, **kwargs)
    except (_JaxShardingTypeError, _DuplicateSpecError, ValueError) as e:
      # An indexing gather's result spec can name an axis twice
      # (P('data', None, 'data')): jax refuses it in Python, as a sharding.
      if kwargs.get('out_sharding') is not None or 'shard' not in str(e).lower():
        raise
      return recorder.fix_call(f'jnp.{name}', f, args, kwargs, e)

  return call


OPAQUE = frozenset({'pallas_call', 'custom_partitioning', 'ffi_call', 'custom_call'})
"""Calls whose sharding rules cannot see Explicit axes (they see Auto ones)."""


def _under_auto_axes(
  prim: Any, args: tuple[Any, ...], params: dict[str, Any], spec: PartitionSpec,
  bind: Callable[..., Any],
) -> Any:  # fmt: skip
  plain = {k: (None if isinstance(v, NamedSharding) else v) for k, v in params.items()}

  def op(*xs: Any) -> Any:
    return bind(prim, *xs, **plain)

  out = spec
  if prim.multiple_results:
    n = len(jax.eval_shape(lambda *xs: bind(prim, *xs, **plain), *args))
    out = tuple(spec for _ in range(n))
  return jax.sharding.auto_axes(op, out_sharding=out)(*args)


def key_of(prim: Any, args: tuple[Any, ...]) -> Key:
  """The :data:`Key` of a bind being made now (from the live stack)."""
  file, line = _user_frame() or ('?', 0)
  return (file, line, prim.name, tuple(_shape(a) for a in args))


def _user_frame() -> tuple[str, int] | None:
  frame = sys._getframe(1)
  while frame is not None:
    file = frame.f_code.co_filename
    # '<string>' (python -c) and notebooks' cells are the user's; '<frozen
    # ...>' is the interpreter's own.
    if not file.startswith('<frozen') and not _library(file):
      return file, frame.f_lineno
    frame = frame.f_back
  return None


def user_position() -> tuple[int, int, int, int] | None:
  """The span of the expression the user's frame is running now (a call,
  an ``@``): its line, end line, column and end column."""
  frame = sys._getframe(1)
  while frame is not None:
    file = frame.f_code.co_filename
    if not file.startswith('<frozen') and not _library(file):
      positions = list(frame.f_code.co_positions())
      at = positions[frame.f_lasti // 2] if frame.f_lasti >= 0 else None
      if at is None or None in at:
        return None
      return at  # type: ignore[return-value]
    frame = frame.f_back
  return None


@functools.lru_cache(maxsize=4096)
def _library(file: str) -> bool:
  return is_library_file(file)


def _in_transpose() -> bool:
  """Whether the bind comes from autodiff's backward pass (a transpose rule)."""
  frame = sys._getframe(1)
  while frame is not None:
    if frame.f_code.co_name == 'backward_pass':  # jax's autodiff, reversing
      return True
    frame = frame.f_back
  return False


def _layer() -> str | None:
  """The innermost flax layer whose ``__call__`` is on the stack."""
  frame = sys._getframe(1)
  while frame is not None:
    file = frame.f_code.co_filename.replace('\\', '/')
    if frame.f_code.co_name == '__call__' and '/flax/' in file:
      api = (
        'nnx' if '/flax/nnx/' in file else 'linen' if '/flax/linen/' in file else None
      )
      owner = frame.f_locals.get('self')
      if api is not None and owner is not None:
        return f'{api}.{type(owner).__name__}'
    frame = frame.f_back
  return None


def _shape(x: Any) -> tuple[int, ...]:
  return tuple(int(d) for d in getattr(x, 'shape', ()))


def _nbytes(x: Any) -> int:
  total = 0
  for leaf in jax.tree.leaves(x):
    aval = jax.typeof(leaf)
    n = 1
    for d in getattr(aval, 'shape', ()):
      n *= int(d)
    total += n * getattr(getattr(aval, 'dtype', None), 'itemsize', 0)
  return total
