"""Errors raised by flax_shardmeta, and the problem records they carry."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

# The errors page machinery, re-exported: every message here ends with its line.
from flax_shardmeta._error_pages import (
  ERRORS_PAGE as ERRORS_PAGE,
  NamesItsSection as _NamesItsSection,
  errors_page_line as errors_page_line,
  message as message,
)

# Re-exported: the records travel with the errors that carry them.
from flax_shardmeta._problem import ShardingProblem as ShardingProblem


class FlaxShardmetaError(_NamesItsSection, ValueError):
  """Base of every error flax_shardmeta raises.

  A ``ValueError``, so code that already catches bad values keeps working;
  ``except fsm.FlaxShardmetaError`` catches exactly this library's errors.
  Each message ends with the command that prints its section of the errors
  page, e.g.
  ``(what to do: flax-shardmeta explain NoMeshError)``.

  Example:
    >>> import flax_shardmeta as fsm
    >>> try:
    ...   fsm.composite_rules([('embed', 'data')], [('embed', 'model')])
    ... except fsm.FlaxShardmetaError as e:
    ...   print(type(e).__name__)
    RuleConflictError
  """


class ShardingError(FlaxShardmetaError):
  """Raised when annotations cannot become a valid sharding.

  Every problem found in a tree is listed in one message, each naming the
  parameter path, its shape, its names, the resolved spec, what is wrong and
  how to fix it. ``problems`` holds them as :class:`ShardingProblem` records.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import flax_shardmeta as fsm
    >>> mesh = jax.sharding.AbstractMesh(
    ...     (4,), ('model',), axis_types=(jax.sharding.AxisType.Auto,))
    >>> tree = {'w': fsm.Partitioned(
    ...     jax.ShapeDtypeStruct((6,), jnp.float32), ('model',))}
    >>> try:
    ...   fsm.get_sharding(tree, mesh)
    ... except fsm.ShardingError as e:
    ...   print(e)
    ...   print(e.problems[0].path)
    1 leaf cannot be sharded as annotated:
      - w: shape (6,), names ('model',), spec P('model'): dimension 0 of size 6 is
      not divisible by 'model'=4. Fix: make the size a multiple of 4, ...
    w
  """

  def __init__(self, problems: Sequence[ShardingProblem], context: str = ''):
    self.problems = tuple(problems)
    super().__init__(_listing(self.problems, 'be sharded as annotated', context))


def _listing(problems: Sequence[ShardingProblem], what: str, context: str) -> str:
  # A leaf may have several problems; the header counts leaves.
  n = len({p.path for p in problems})
  head = f'{n} leaf cannot' if n == 1 else f'{n} leaves cannot'
  lines = [f'{head} {what}{context}:']
  lines += [f'  - {p}' for p in problems]
  return '\n'.join(lines)


class RuleConflictError(FlaxShardmetaError):
  """Raised when global and per-variable logical rules disagree on a name.

  Example:
    >>> import flax_shardmeta as fsm
    >>> fsm.composite_rules([('embed', 'data')], [('embed', 'model')])
    Traceback (most recent call last):
    ...
    flax_shardmeta._errors.RuleConflictError: Logical axis 'embed' has
    conflicting first choices: ...
  """


class NoMeshError(FlaxShardmetaError):
  """Raised when a sharding must be applied but no mesh was given or set.

  Example:
    >>> import jax.numpy as jnp
    >>> import flax_shardmeta as fsm
    >>> fsm.shard_value(jnp.ones((8, 4)), ('data', None))
    Traceback (most recent call last):
    ...
    flax_shardmeta._errors.NoMeshError: shard_value needs a mesh: pass mesh=... or
    run inside `with jax.set_mesh(mesh):`.
    (what to do: flax-shardmeta explain NoMeshError)
  """


class InvalidRulesError(FlaxShardmetaError):
  """Raised when logical axis rules are not ``(logical_name, mesh_axes)`` pairs.

  Example:
    >>> import flax_shardmeta as fsm
    >>> fsm.set_logical_axis_rules([('embed',)])
    Traceback (most recent call last):
    ...
    flax_shardmeta._errors.InvalidRulesError: Logical axis rule #0 is ('embed',);
    expected a pair (logical_name: str, mesh_axes), e.g. ('mlp', 'model').
    (what to do: flax-shardmeta explain InvalidRulesError)
  """


class InvalidNamesError(FlaxShardmetaError):
  """Raised when an annotation's names are malformed (a bare string, an
  integer or a nested tuple, a repeat, a transform's axis name that does not
  match).

  Names are strings, None, ``PartitionSpec.UNCONSTRAINED`` or tuples of
  mesh-axis names. Raised for a whole tree (``fsm.get_sharding``), it lists
  every parameter at fault and ``problems`` holds them as
  :class:`ShardingProblem` records.

  Example:
    >>> import flax_shardmeta as fsm
    >>> fsm.logical_to_mesh_axes(('embed', 'embed'), [('embed', 'data')])
    Traceback (most recent call last):
    ...
    flax_shardmeta._errors.InvalidNamesError: ...
  """

  def __init__(self, message: str = '', problems: Sequence[ShardingProblem] = ()):
    self.problems = tuple(problems)
    if self.problems and not message:
      message = _listing(self.problems, 'be laid out: their names are malformed', '')
    super().__init__(message)


class RuleContextError(FlaxShardmetaError):
  """Raised when a rules context is misused: exited in another thread or
  asyncio task than the one that entered it, or traced under rules jax's
  cache key does not name.

  Example:
    >>> import flax_shardmeta as fsm
    >>> fsm.logical_axis_rules([('mlp', 'model')]).__exit__(None, None, None)
    Traceback (most recent call last):
    ...
    flax_shardmeta._errors.RuleContextError: fsm.logical_axis_rules((('mlp',
    'model'),)) was exited but never entered.
    (what to do: flax-shardmeta explain RuleContextError)
  """


class MeshShapeError(FlaxShardmetaError):
  """Raised when mesh axis sizes do not fit the devices or the hosts, or the
  axis names or ``axis_types`` are malformed (not distinct strings, not one
  ``AxisType`` per axis).

  Example:
    >>> import flax_shardmeta as fsm
    >>> fsm.make_mesh((3, 4), ('data', 'model'))
    Traceback (most recent call last):
    ...
    flax_shardmeta._errors.MeshShapeError: mesh {'data': 3, 'model': 4} does not fit
    8 devices in 1 process(es) (8 each). A factorisation that fits:
    axis_sizes=(2, 4), or -1 for one axis.
    (what to do: flax-shardmeta explain MeshShapeError)
  """


class BatchLayoutError(FlaxShardmetaError):
  """Raised when a global batch cannot be split over the hosts as laid out.

  Example:
    >>> import jax, flax_shardmeta as fsm
    >>> mesh = jax.make_mesh((2, 4), ('data', 'model'))
    >>> fsm.data_layout(mesh, 7)
    Traceback (most recent call last):
    ...
    flax_shardmeta._errors.BatchLayoutError: a global batch of 7 rows does not divide
    over the batch axes ('data',) (2 ways): each device would hold 3.5 rows. Use a
    multiple of 2, e.g. 8.
    (what to do: flax-shardmeta explain BatchLayoutError)
  """


class LaunchError(FlaxShardmetaError):
  """Raised when a process of a local multi-process launch fails or times out.

  ``results`` holds each process's ``(returncode, stdout, stderr)``; the
  message shows each exit code and the end of each stderr.

  Example:
    >>> error = LaunchError('process 1 exited with code 1', [(0, '', ''),
    ...                                                     (1, '', 'boom')])
    >>> [code for code, _, _ in error.results]
    [0, 1]
  """

  def __init__(self, message: str, results: Sequence[tuple[int | None, str, str]]):
    self.results = tuple(results)
    super().__init__(message)


class TopologyError(FlaxShardmetaError):
  """Raised when the devices of a TPU topology cannot be made on this machine.

  Either ``libtpu`` is not installed (the message names the extra that brings
  it) or the topology name is not one libtpu knows (the message lists the
  accepted forms).

  Example:
    >>> import flax_shardmeta as fsm
    >>> fsm.make_mesh((4,), ('data',), topology='v5p8')
    Traceback (most recent call last):
    ...
    flax_shardmeta._errors.TopologyError: unknown topology 'v5p8': ...
  """


class SizeError(FlaxShardmetaError):
  """Raised when a text meant as a size is not one (``'12 parsecs'``); a call
  taking a size (``fit(hbm=)``) raises its own error, naming the argument.

  Example:
    >>> import flax_shardmeta as fsm
    >>> issubclass(fsm.SizeError, ValueError)
    True
  """


class FitError(FlaxShardmetaError):
  """Raised when ``fit`` cannot analyse a step: a malformed HBM size, no mesh,
  arguments that do not match the step, or a compiler error other than
  running out of memory (which is a verdict, not an error).

  Example:
    >>> import flax_shardmeta as fsm
    >>> fsm.fit(lambda x: x, hbm='lots')
    Traceback (most recent call last):
    ...
    flax_shardmeta._errors.FitError: hbm='lots': 'lots' is not a size; ...
  """


class RestoreError(FlaxShardmetaError):
  """Raised by ``fsm.restore`` before anything is read when the restore plan
  has a problem a restore cannot go past (a leaf missing or saved with another
  shape, a target with no sharding, a saved leaf not in the target) or no
  schedule meets ``host_budget``; and if a leaf read landed with another
  layout. ``problems`` lists them by path (``fsm.restore`` shows a restore).

  Example:
    >>> import flax_shardmeta as fsm
    >>> issubclass(fsm.RestoreError, ValueError), fsm.RestoreError('no').problems
    (True, ())
  """

  def __init__(self, message: str, problems: Sequence[ShardingProblem] = ()):
    self.problems = tuple(problems)
    super().__init__(message)


class CheckpointDamagedError(RestoreError):
  """Raised by ``fsm.restore`` and ``fsm.restore_plan`` when a checkpoint's
  files are damaged: its values differ from the checksums ``fsm.save``
  recorded, a leaf's array data cannot be read, or orbax's metadata files are
  corrupt. The message names the leaf or the file and the reason; restore
  from another checkpoint. A ``RestoreError``.

  Example:
    >>> import flax_shardmeta as fsm
    >>> issubclass(fsm.CheckpointDamagedError, fsm.RestoreError)
    True
  """


class HostBudgetError(FlaxShardmetaError):
  """Raised by ``fsm.restore`` and ``fsm.restore_plan`` when ``host_budget`` is
  not a positive number of bytes: bool, nan, inf, zero, negative, a fraction of
  a byte, or text that is not a size.

  Example:
    >>> import flax_shardmeta as fsm
    >>> issubclass(fsm.HostBudgetError, ValueError)
    True
  """


class NnxJitError(FlaxShardmetaError):
  """Raised when ``fsm.jit`` is used with NNX graph nodes in a way it cannot
  carry their updates: a module the function closes over (pass it as an
  argument instead), a graph node nested in another argument, or static or
  sharded graph-node arguments. The message shows the pattern that works.

  Example:
    >>> import flax_shardmeta as fsm
    >>> issubclass(fsm.NnxJitError, ValueError)
    True
  """


class ExplicitShardingError(FlaxShardmetaError):
  """Raised when jax cannot type an operation's sharding on Explicit mesh axes.

  jax's own ``ShardingTypeError`` (a matmul contracting a sharded dimension,
  say), re-raised while ``fsm.jit`` or ``fsm.sharded_init`` trace with the
  operation's source line, its operands' types (``float32[8,16@model]``:
  dimension 1 sharded over ``'model'``) and the two fixes: Auto axes, or an
  ``out_sharding=`` at that line (:func:`flax_shardmeta.logical_out_sharding`).
  jax's error is its ``__cause__``.

  Attributes:
    operation: what was being traced, e.g. ``'fsm.jit'``.
    source: ``file:line in function: text`` of the operation.
    operands: the operands' types, as jax prints them.
    jax_message: jax's message.

  Example:
    >>> import flax_shardmeta as fsm
    >>> e = fsm.ExplicitShardingError('...', operation='fsm.jit', source='m.py:3',
    ...                               operands=('float32[8,16@model]',))
    >>> e.source, isinstance(e, ValueError)
    ('m.py:3', True)
  """

  def __init__(
    self,
    message: str,
    *,
    operation: str = '',
    source: str = '',
    operands: Sequence[str] = (),
    jax_message: str = '',
  ):
    super().__init__(message)
    self.operation, self.source = operation, source
    self.operands, self.jax_message = tuple(operands), jax_message


class IndivisibleDimensionWarning(_NamesItsSection, UserWarning):
  """Issued when ``replicate_indivisible=True`` replicated dimensions the mesh
  cannot divide as annotated.

  A dimension is indivisible when its size is not a multiple of its mesh
  axes' sizes, or the mesh lacks one of those axes (or uses it twice), or it
  is UNCONSTRAINED where a definite layout is needed. One warning per call
  lists the changes (summarised per kind of change on large trees);
  ``adjustments`` holds every change as a ``'path: change'`` line, built only
  when first read. ``fsm.ShardingFitWarning`` is its former name (deprecated).

  Example:
    >>> import warnings
    >>> import jax, jax.numpy as jnp
    >>> import flax_shardmeta as fsm
    >>> mesh = jax.sharding.AbstractMesh(
    ...     (4,), ('model',), axis_types=(jax.sharding.AxisType.Auto,))
    >>> tree = {'w': fsm.Partitioned(
    ...     jax.ShapeDtypeStruct((6,), jnp.float32), ('model',))}
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter('always')
    ...   plan = fsm.plan(tree, mesh, replicate_indivisible=True)
    >>> caught[0].category.__name__, plan.entries[0].spec
    ('IndivisibleDimensionWarning', P(None,))
    >>> caught[0].message.adjustments
    ("w: dimension 0: 'model' -> None (dimension 0 of size 6 is not divisible
      by 'model'=4)",)
  """

  def __init__(
    self,
    message: str,
    adjustments: Sequence[str] | Callable[[], Iterable[str]] | None = None,
  ):
    super().__init__(message)
    self._adjustments = adjustments

  @property
  def adjustments(self) -> tuple[str, ...]:
    """Every change, one ``'path: change'`` line each, in tree order."""
    if callable(self._adjustments):
      self._adjustments = tuple(self._adjustments())
    return tuple(self._adjustments or ())


class UnmappedNameWarning(_NamesItsSection, UserWarning):
  """Issued when logical names were replicated for a reason that looks like a
  mistake: no rules are given or set at all, or a name is close to a rule's
  name (``'mpl'`` where a rule names ``'mlp'``). One warning per call (per
  name for near misses), listing the parameters concerned.

  Example:
    >>> import warnings
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> mesh = jax.sharding.AbstractMesh((2,), ('model',))
    >>> tree = {'w': fsm.LogicalPartitioned(
    ...     jax.ShapeDtypeStruct((4,), jnp.float32), ('mpl',))}
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter('always')
    ...   spec = fsm.get_sharding(tree, mesh, [('mlp', 'model')])['w'].spec
    >>> spec, caught[0].category.__name__
    (P(None,), 'UnmappedNameWarning')
    >>> print(caught[0].message)
    Logical name 'mpl' is not mapped by any rule, so it was replicated; did you
    mean 'mlp' (rule ('mlp', 'model'))? Concerned: w.
    (what to do: flax-shardmeta explain UnmappedNameWarning)
  """


class UnmappedMeshAxisNameWarning(UnmappedNameWarning):
  """Issued when a logical name no rule maps is also a mesh-axis name.

  Such a dimension is replicated, which is rarely what was meant: either the
  names were meant as mesh axes (annotate with ``with_partitioning`` /
  ``Partitioned``, or pass ``logical=False`` to ``shard_value``), or a rule
  such as ``('data', 'data')`` is missing. One warning per such name and
  call, listing the parameters concerned.

  Example:
    >>> import warnings
    >>> import jax, flax_shardmeta as fsm
    >>> mesh = jax.sharding.AbstractMesh((2,), ('data',))
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter('always')
    ...   spec = fsm.logical_to_mesh_sharding(
    ...       jax.P('data'), mesh, [('batch', 'data')]).spec
    >>> spec, caught[0].category.__name__
    (P(None,), 'UnmappedMeshAxisNameWarning')
  """


def unmapped_hint(name: str) -> str:
  """How to fix a logical name no rule maps (with the mesh-axis case spelled out)."""
  return (
    f'did you mean mesh-axis annotations (`with_partitioning`) or a rule '
    f'({name!r}, {name!r})?'
  )


DEPRECATED_NAMES = {'ShardingFitWarning': 'IndivisibleDimensionWarning'}
"""Former names kept for one release: old name -> current name (read by
``fsm.__getattr__`` too)."""


def __getattr__(name: str) -> Any:
  """Former names of this module's classes, with a DeprecationWarning (PEP 562)."""
  new = DEPRECATED_NAMES.get(name)
  if new is None:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  warnings.warn(
    f'{name} is deprecated: use {new} (the same class; the old name will be '
    'removed in the next release).',
    DeprecationWarning,
    stacklevel=2,
  )
  return globals()[new]
