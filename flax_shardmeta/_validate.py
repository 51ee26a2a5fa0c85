"""Checks a resolved PartitionSpec against a shape and a mesh, and the one rule
that replicates what the mesh cannot divide.

The four checks jax's own sharding code makes one at a time, with opaque
messages, made all at once and phrased for the parameter they concern: rank,
mesh axis exists, mesh axis used once, dimension divisible by its mesh axes.
With ``replicate_indivisible=True`` the dimensions at fault are replicated
instead (:func:`replicate_indivisible`) and one
:class:`IndivisibleDimensionWarning` lists the changes (:func:`warn_replicated`).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from typing import Any

from flax_shardmeta._errors import IndivisibleDimensionWarning
from flax_shardmeta._specs import (
  UNCONSTRAINED,
  format_entry,
  mesh_axes_of,
  spec_entries,
)

Issue = tuple[str, str, tuple[int, ...]]
"""(reason, hint, dims concerned)."""

REPLICATE_CALLS = (
  'replicate_indivisible=True (fsm.get_sharding, fsm.plan, fsm.shard_value, '
  'fsm.with_logical_constraint)'
)
"""Where hints send the reader: every call that takes ``replicate_indivisible=``."""


def mesh_key(mesh: Any) -> tuple[tuple[str, int], ...]:
  """Hashable (axis name, size) pairs of a Mesh or AbstractMesh."""
  return tuple(zip(mesh.axis_names, mesh.axis_sizes))


def check_spec(
  shape: tuple[int, ...], spec: tuple[Any, ...], mesh: Any
) -> tuple[Issue, ...]:
  """All problems of ``spec`` (entries per dimension) for ``shape`` on ``mesh``."""
  return _check(tuple(shape), spec_entries(spec), mesh_key(mesh))


@functools.lru_cache(maxsize=65536)
def _check(
  shape: tuple[int, ...],
  spec: tuple[Any, ...],
  axes: tuple[tuple[str, int], ...],
) -> tuple[Issue, ...]:
  issues: list[Issue] = []
  sizes = dict(axes)
  shown_mesh = ', '.join(f'{n}={s}' for n, s in axes) or 'no axes'
  if len(spec) > len(shape):
    issues.append(
      (
        f'{len(spec)} spec entries for a rank-{len(shape)} array',
        'give at most one entry per dimension',
        (),
      )
    )
    spec = spec[: len(shape)]
  first_use: dict[str, int] = {}
  for dim, entry in enumerate(spec):
    if entry is None or entry is UNCONSTRAINED:
      continue
    axis_names = mesh_axes_of(entry)
    missing = [a for a in axis_names if a not in sizes]
    for a in missing:
      issues.append(
        (
          f"mesh axis '{a}' (dimension {dim}) is not in the mesh ({shown_mesh})",
          'use an axis the mesh has, change the rule that produced it, or '
          f'replicate this dimension with {REPLICATE_CALLS}',
          (dim,),
        )
      )
    for a in axis_names:
      if a in first_use:
        where = (
          f'dimension {dim} twice'
          if first_use[a] == dim
          else f'both dimension {first_use[a]} and dimension {dim}'
        )
        issues.append(
          (
            f"mesh axis '{a}' shards {where}",
            'a mesh axis may shard one dimension only; replicate one of them '
            '(None) or use another axis',
            (dim,),
          )
        )
      else:
        first_use[a] = dim
    if missing:
      continue
    factor = math.prod(sizes[a] for a in axis_names)
    if factor and shape[dim] % factor:
      over = ' x '.join(f"'{a}'={sizes[a]}" for a in axis_names)
      if len(axis_names) > 1:  # one axis: its size is the factor already
        over += f' (= {factor})'
      issues.append(
        (
          f'dimension {dim} of size {shape[dim]} is not divisible by {over}',
          f'make the size a multiple of {factor}, shard it over other mesh '
          f'axes, or replicate this dimension with {REPLICATE_CALLS}',
          (dim,),
        )
      )
  return tuple(issues)


def rank_issue(n_names: int, ndim: int) -> Issue:
  """The problem of an annotation whose length is not the value's rank."""
  hint = 'give exactly one name per dimension (None for a replicated one)'
  if n_names < ndim:
    # Fewer names than dimensions: typically the axis a transform stacked.
    hint += (
      '; if a transform such as nn.scan/nnx.vmap added an axis, pass '
      "metadata_params={fsm.PARTITION_NAME: 'layers'} (Linen) or "
      "transform_metadata={nnx.PARTITION_NAME: 'layers'} (NNX)"
    )
  return (f'{n_names} names for a rank-{ndim} array', hint, ())


def replicate_indivisible(
  shape: tuple[int, ...], spec: tuple[Any, ...], mesh: Any
) -> tuple[tuple[Any, ...], tuple[Issue, ...], tuple[str, ...]]:
  """Replicates the dimensions whose mesh axes cannot shard them.

  The one rule behind every ``replicate_indivisible=True``: each dimension an
  issue of :func:`check_spec` concerns (missing mesh axis, indivisible size,
  axis used twice) becomes None; issues no replication can fix (rank) are kept.

  Returns:
    ``(entries, issues left, changes)``, one sentence per change.
  """
  return _replicate(tuple(shape), spec_entries(spec), mesh_key(mesh))


@functools.lru_cache(maxsize=65536)
def _replicate(
  shape: tuple[int, ...],
  spec: tuple[Any, ...],
  axes: tuple[tuple[str, int], ...],
) -> tuple[tuple[Any, ...], tuple[Issue, ...], tuple[str, ...]]:
  issues = _check(shape, spec, axes)
  if not any(dims for _, _, dims in issues):
    return spec, issues, ()
  entries = list(spec)
  changes: list[str] = []
  for reason, _, dims in issues:
    for d in dims:
      if entries[d] is not None:
        changes.append(f'dimension {d}: {format_entry(entries[d])} -> None ({reason})')
        entries[d] = None
  replicated = tuple(entries)
  return replicated, _check(shape, replicated, axes), tuple(changes)


def unconstrained_issue(spec: tuple[Any, ...]) -> Issue | None:
  """The problem of UNCONSTRAINED entries in a spec meant for a ``NamedSharding``.

  ``PartitionSpec.UNCONSTRAINED`` leaves a dimension to the compiler, which
  only a sharding constraint can do: ``jit``'s ``in_shardings`` /
  ``out_shardings`` and ``device_put`` refuse it.
  """
  dims = tuple(i for i, e in enumerate(spec) if e is UNCONSTRAINED)
  if not dims:
    return None
  shown = ', '.join(map(str, dims))
  return (
    f'UNCONSTRAINED (dimension {shown}) is only valid in a sharding '
    "constraint; jit's in/out_shardings and device_put need a definite layout",
    'use None (replicated) or mesh axes in the annotation or rule, or pass '
    'replicate_indivisible=True to replicate it',
    dims,
  )


def replicate_option(
  replicate_indivisible: bool, fit: bool | None, call: str, stacklevel: int = 3
) -> bool:
  """The ``replicate_indivisible=`` option, also when spelled ``fit=``.

  ``fit=`` is its former name, kept for one release: ``fsm.fit`` is the step's
  memory check, a different thing. Passing it warns with a
  ``DeprecationWarning`` naming the new keyword, and behaves the same.

  Args:
    replicate_indivisible: the value passed under the current name.
    fit: the value passed as ``fit=``, or None when it was not passed.
    call: the public function, named in the warning.
    stacklevel: passed to ``warnings.warn`` (3: the caller's caller).
  """
  if fit is None:
    return replicate_indivisible
  warnings.warn(
    f'{call}(fit=...) is deprecated: pass replicate_indivisible={bool(fit)} '
    '(the same behaviour; fit= will be removed in the next release, and '
    'fsm.fit is the memory check of a whole step).',
    DeprecationWarning,
    stacklevel=stacklevel,
  )
  return replicate_indivisible or bool(fit)


MAX_LISTED = 20
"""Changes listed one by one in a warning; more are summarised by kind."""


def warn_replicated(
  replicated: Sequence[tuple[Any, tuple[str, ...]]], stacklevel: int = 3
) -> None:
  """One :class:`IndivisibleDimensionWarning` for every dimension replicated.

  Up to :data:`MAX_LISTED` changes are listed with their paths. Beyond that,
  each kind of change is listed once with its count and a few example paths
  (so a large tree does not pay for thousands of path strings); the warning's
  ``adjustments`` attribute builds the full list when read.

  Args:
    replicated: ``(leaf, changes)`` pairs, one per leaf changed; a leaf is an
      annotation walk's Leaf or a path string.
    stacklevel: passed to ``warnings.warn``.
  """

  def path(leaf: Any) -> str:
    return leaf if isinstance(leaf, str) else leaf.path

  def every_change() -> list[str]:
    return [f'{path(lf)}: {a}' for lf, changes in replicated for a in changes]

  total = sum(len(changes) for _, changes in replicated)
  head = (
    f'{total} dimension(s) could not be sharded as annotated and were replicated '
    '(replicate_indivisible=True)'
  )
  if total <= MAX_LISTED:
    lines = [f'  - {line}' for line in every_change()]
  else:
    by_change: dict[str, list[Any]] = {}
    for lf, changes in replicated:
      for a in changes:
        by_change.setdefault(a, []).append(lf)
    lines = []
    for change, where in list(by_change.items())[:MAX_LISTED]:
      examples = ', '.join(path(lf) for lf in where[:3])
      more = ', ...' if len(where) > 3 else ''
      lines.append(f'  - {len(where)} x {change}: {examples}{more}')
    if len(by_change) > MAX_LISTED:
      lines.append(f'  - ... and {len(by_change) - MAX_LISTED} more kinds of change')
    lines.append(
      "  (the full list: the warning's `adjustments`, or "
      'fsm.plan(..., replicate_indivisible=True).adjustments)'
    )
  warnings.warn(
    IndivisibleDimensionWarning(f'{head}:\n' + '\n'.join(lines), every_change),
    stacklevel=stacklevel,
  )
