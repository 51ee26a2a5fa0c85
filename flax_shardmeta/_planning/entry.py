"""Plan entries: one array's planned layout, and how entries are made.

Entries are made when a plan's ``entries`` are first read; what does not
depend on a leaf's path is made once per distinct layout, dtype and
annotation, so entries of a deep model cost little more than their paths.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from jax.sharding import PartitionSpec

from flax_shardmeta import _annotation as ann_lib
from flax_shardmeta._arrays import array_bytes
from flax_shardmeta._planning.explain import explain_entry
from flax_shardmeta._resolution import Explanation
from flax_shardmeta._sharding import LeafLayout
from flax_shardmeta._specs import (
  format_spec,
  json_entry,
  mesh_axes_of,
  spec_entries,
  spec_sets,
)
from flax_shardmeta._typing import AnyMesh
from flax_shardmeta._units import format_bytes


@dataclasses.dataclass(frozen=True, slots=True)
class PlanEntry:
  """The planned layout of one array leaf.

  Attributes:
    path: '/'-joined key path, e.g. ``params/layers/wq``.
    shape: the global shape.
    dtype: the element type.
    names: the annotation as written, or None for an unannotated leaf.
    spec: the resolved PartitionSpec (None when it could not be resolved).
    shard_shape: the shape each device holds.
    bytes_per_device: bytes of this array on each device.
    adjustments: what ``replicate_indivisible`` changed, one sentence each.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import flax_shardmeta as fsm
    >>> mesh = jax.sharding.AbstractMesh(
    ...     (4,), ('model',), axis_types=(jax.sharding.AxisType.Auto,))
    >>> tree = {'w': fsm.Partitioned(
    ...     jax.ShapeDtypeStruct((8, 6), jnp.float32), ('model', None))}
    >>> entry = fsm.plan(tree, mesh).entry('w')
    >>> entry.spec, entry.shard_shape, entry.bytes_per_device
    (P('model', None), (2, 6), 48)
  """

  path: str
  shape: tuple[int, ...]
  dtype: Any
  names: tuple[Any, ...] | None
  spec: PartitionSpec | None
  shard_shape: tuple[int, ...]
  bytes_per_device: int
  adjustments: tuple[str, ...] = ()
  annotation: ann_lib.Annotation | None = dataclasses.field(
    default=None, repr=False, compare=False
  )
  rules: tuple[tuple[str, Any], ...] = dataclasses.field(
    default=(), repr=False, compare=False
  )
  mesh_axis_names: tuple[str, ...] = dataclasses.field(
    default=(), repr=False, compare=False
  )
  rules_source: str = dataclasses.field(default='', repr=False, compare=False)

  @property
  def size(self) -> int:
    """Number of elements."""
    return math.prod(self.shape)

  @property
  def nbytes(self) -> int:
    """Bytes of the whole (global) array."""
    return nbytes(self.shape, self.dtype)

  @property
  def explain(self) -> Explanation:
    """Per dimension: which rule gave the mesh axes, which were skipped and why.

    Computed on first read, not when the plan is made.
    """
    return explain_entry(
      self.shape,
      self.annotation,
      self.rules,
      self.mesh_axis_names,
      self.spec,
      self.rules_source,
    )

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form."""
    return {
      'path': self.path,
      'shape': list(self.shape),
      'dtype': str(self.dtype),
      'names': _json_entries(self.names),
      'spec': _json_entries(self.spec),
      'shard_shape': list(self.shard_shape),
      'bytes_per_device': self.bytes_per_device,
      # Only present when the spec has them, as PartitionSpec shows them.
      **{
        kind: sorted(axes)
        for kind, axes in zip(('unreduced', 'reduced'), spec_sets(self.spec))
        if axes
      },
    }

  def __treescope_repr__(self, path: str, subtree_renderer: Any) -> Any:
    import treescope  # only for notebooks: keeps the CLI start-up light

    return treescope.repr_lib.render_object_constructor(
      object_type=type(self),
      attributes={
        'shape': self.shape,
        'dtype': str(self.dtype),
        'names': self.names,
        'spec': format_spec(self.spec),
        'shard_shape': self.shard_shape,
        'per_device': format_bytes(self.bytes_per_device),
      },
      path=path,
      subtree_renderer=subtree_renderer,
    )


def nbytes(shape: tuple[int, ...], dtype: Any) -> int:
  """Bytes of an array (0 for a value without a dtype); key arrays and
  sub-byte types count as on the device."""
  try:
    return 0 if dtype is None else array_bytes(tuple(shape), dtype)
  except TypeError:  # not an array dtype
    return 0


def mesh_sizes(mesh: AnyMesh) -> tuple[tuple[str, int], ...]:
  """Hashable ``(axis name, size)`` pairs."""
  return tuple(zip(mesh.axis_names, mesh.axis_sizes))


def make_entries(
  leaves: list[ann_lib.Leaf],
  layouts: list[LeafLayout],
  mesh: AnyMesh,
  rules: tuple[tuple[str, Any], ...],
  source: str,
) -> tuple[PlanEntry, ...]:
  """One PlanEntry per array leaf; what does not depend on the path is made
  once per distinct (layout, dtype, annotation)."""
  sizes = mesh_sizes(mesh)
  axis_names = tuple(mesh.axis_names)
  arrays = [i for i, lay in enumerate(layouts) if lay.shape is not None]
  paths = ann_lib.paths_of([leaves[i] for i in arrays])
  shared: dict[tuple[int, Any, int], tuple[Any, ...]] = {}
  out = []
  for path, i in zip(paths, arrays):
    lf, lay = leaves[i], layouts[i]
    dtype = getattr(lf.value, 'dtype', None)
    ann = lf.annotation
    # The plan keeps layouts and annotations alive, so their ids stay unique.
    key = (id(lay), dtype, id(ann))
    fields: tuple[Any, ...] | None = shared.get(key)
    if fields is None:
      shape = lay.shape or ()
      shard = shard_shape(shape, lay.spec, sizes)
      names = ann.names if ann is not None and len(ann.names) == len(shape) else None
      shard_nbytes = nbytes(shard, dtype)
      # In PlanEntry's field order, after the path.
      fields = shared[key] = (
        shape,
        dtype,
        names,
        lay.spec,
        shard,
        shard_nbytes,
        lay.adjustments,
        ann,
        rules,
        axis_names,
        source,
      )
    out.append(PlanEntry(path, *fields))
  return tuple(out)


@functools.lru_cache(maxsize=16384)
def shard_shape(
  shape: tuple[int, ...],
  spec: PartitionSpec | None,
  axis_sizes: tuple[tuple[str, int], ...],
) -> tuple[int, ...]:
  """The shape each device holds of an array of ``shape`` laid out as ``spec``."""
  sizes = dict(axis_sizes)
  if spec is None:
    return shape
  entries = spec_entries(spec)
  out = []
  for dim, n in enumerate(shape):
    entry = entries[dim] if dim < len(entries) else None
    factor = math.prod(sizes.get(a, 1) for a in mesh_axes_of(entry))
    # Uneven shards (only in plans with problems) hold the padded size.
    out.append(-(-n // factor))
  return tuple(out)


def _json_entries(spec: Any) -> list[Any] | None:
  return None if spec is None else [json_entry(e) for e in spec_entries(spec)]
