"""Checks a resolved PartitionSpec against a shape and a mesh.

The four checks jax's own sharding code makes one at a time, with opaque
messages, made all at once and phrased for the parameter they concern: rank,
mesh axis exists, mesh axis used once, dimension divisible by its mesh axes.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from flax_shardmeta._specs import UNCONSTRAINED, mesh_axes_of

Issue = tuple[str, str, tuple[int, ...]]
"""(reason, hint, dims concerned)."""


def mesh_key(mesh: Any) -> tuple[tuple[str, int], ...]:
  """Hashable (axis name, size) pairs of a Mesh or AbstractMesh."""
  return tuple(zip(mesh.axis_names, mesh.axis_sizes))


def check_spec(
    shape: tuple[int, ...], spec: tuple[Any, ...], mesh: Any
) -> tuple[Issue, ...]:
  """All problems of ``spec`` (entries per dimension) for ``shape`` on ``mesh``."""
  return _check(tuple(shape), tuple(spec), mesh_key(mesh))


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
    issues.append((
        f'{len(spec)} spec entries for a rank-{len(shape)} array',
        'give at most one entry per dimension',
        (),
    ))
    spec = spec[: len(shape)]
  first_use: dict[str, int] = {}
  for dim, entry in enumerate(spec):
    if entry is None or entry is UNCONSTRAINED:
      continue
    axis_names = mesh_axes_of(entry)
    missing = [a for a in axis_names if a not in sizes]
    for a in missing:
      issues.append((
          f"mesh axis '{a}' (dimension {dim}) is not in the mesh ({shown_mesh})",
          'use an axis the mesh has, change the rule that produced it, or '
          'pass fit=True to replicate this dimension',
          (dim,),
      ))
    for a in axis_names:
      if a in first_use:
        where = (f'dimension {dim} twice' if first_use[a] == dim else
                 f'both dimension {first_use[a]} and dimension {dim}')
        issues.append((
            f"mesh axis '{a}' shards {where}",
            'a mesh axis may shard one dimension only; replicate one of them '
            '(None) or use another axis',
            (dim,),
        ))
      else:
        first_use[a] = dim
    if missing:
      continue
    factor = math.prod(sizes[a] for a in axis_names)
    if factor and shape[dim] % factor:
      over = ' x '.join(f"'{a}'={sizes[a]}" for a in axis_names)
      issues.append((
          f'dimension {dim} of size {shape[dim]} is not divisible by {over} '
          f'(= {factor})',
          f'make the size a multiple of {factor}, shard it over other mesh '
          'axes, or pass fit=True to replicate this dimension',
          (dim,),
      ))
  return tuple(issues)


def rank_issue(n_names: int, ndim: int) -> Issue:
  """The problem of an annotation whose length is not the value's rank."""
  return (
      f'{n_names} names for a rank-{ndim} array',
      'give exactly one name per dimension (None for a replicated one); if a '
      'transform such as nn.scan/nnx.vmap added an axis, pass '
      "metadata_params={fsm.PARTITION_NAME: 'layers'} (Linen) or "
      "transform_metadata={nnx.PARTITION_NAME: 'layers'} (NNX)",
      (),
  )
