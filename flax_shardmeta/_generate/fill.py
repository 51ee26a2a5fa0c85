"""Each device making its own shard of a parameter from windows.

A parameter that :mod:`flax_shardmeta._generate.windowed` can compute window by
window is made inside ``shard_map``: each device fills its shard chunk by
chunk (temporaries of a chunk's size), or computes it as one window, or
computes the whole parameter in the unsharded initializer's own loop and
keeps its shard (:data:`Generation`); :func:`in_one_piece` chooses between
the last two where chunks are not needed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from flax_shardmeta._arrays import element_bits
from flax_shardmeta._generate.loops import Span, chunk_plan, rows_plan
from flax_shardmeta._generate.windowed import CHUNK_BYTES
from flax_shardmeta._specs import mesh_axes_of

if TYPE_CHECKING:
  from flax_shardmeta._generate.windowed import WindowedOutput

Generation = Literal['chunks', 'shard', 'whole']
"""How each device makes its shard of a parameter from windows: ``'chunks'``,
chunk by chunk; ``'shard'``, its shard as one window; ``'whole'``, the whole
parameter in the unsharded initializer's own loop, keeping its shard."""


def in_one_piece(
  w: WindowedOutput, sharding: NamedSharding, itemsize: int, chunk_bytes: int
) -> Generation | None:
  """How a parameter that is not generated chunk by chunk is made so that its
  values are the unsharded initializer's; None: as XLA partitions it.

  ``'whole'`` when the whole parameter fits in ``chunk_bytes``: every device
  computes it by the unsharded initializer's own operations, in its very
  loops, and keeps its shard; exact by construction, whatever XLA's code
  looks at, and for any initializer (orthogonal, a reshaped kernel).
  ``'shard'`` when a larger parameter's shards cut its last dimension (see
  :class:`Loop`; elementwise initializers only). A shard that keeps the last
  dimension is computed in loops of the unsharded one's minor dimension
  already; a constant, or a parameter that is not sharded, is exact anyway.
  """
  shard = sharding.shard_shape(w.shape)
  if not w.random or shard == w.shape:
    return None
  if math.prod(w.shape) * itemsize <= chunk_bytes:
    return 'whole'
  return 'shard' if shard[-1] != w.shape[-1] else None


@dataclasses.dataclass(frozen=True)
class _ShardWindows:
  """How one device's shard of a parameter is cut into windows."""

  spec: tuple[Any, ...]  # the mesh axes of each dimension
  sizes: dict[str, int]  # the mesh's axis sizes
  local: tuple[int, ...]  # the shard's shape
  minor: int  # the parameter's last dimension (0: fewer than 2 dimensions)
  by_rows: bool  # chunks are whole rows of the last dimension
  dim: int  # the dimension chunks are cut along
  chunk: int  # a chunk's size along ``dim``
  wshape: tuple[int, ...]  # a window's shape
  steps: int  # windows per shard
  limit: int  # elements a window may be padded to (see loops.Loop)

  @classmethod
  def of(
    cls,
    w: WindowedOutput,
    sharding: NamedSharding,
    itemsize: int,
    target_bytes: int,
    chunked: bool,
  ) -> _ShardWindows:
    mesh = sharding.mesh
    spec = tuple(sharding.spec) + (None,) * (len(w.shape) - len(sharding.spec))
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    parts = [math.prod(sizes[a] for a in mesh_axes_of(e)) for e in spec]
    local = tuple(s // p for s, p in zip(w.shape, parts))
    minor = w.shape[-1] if len(w.shape) >= 2 else 0
    by_rows = None
    if chunked and minor:
      by_rows = rows_plan(local, minor, itemsize, target_bytes)
    if by_rows is not None:
      dim, chunk = by_rows
      wshape = (1,) * dim + (chunk,) + local[dim + 1 :]
    else:
      dim, chunk = (
        chunk_plan(local, itemsize, target_bytes) if chunked else (0, local[0])
      )
      wshape = tuple(chunk if d == dim else n for d, n in enumerate(local))
    steps = math.prod(local) // math.prod(wshape)
    limit = target_bytes // itemsize
    return cls(
      spec, sizes, local, minor, bool(by_rows), dim, chunk, wshape, steps, limit
    )

  def shard_offsets(self) -> list[Any]:
    """Where this device's shard starts, per dimension (inside shard_map)."""
    base = []
    for d, entry in enumerate(self.spec):
      idx = jnp.uint32(0)
      for a in mesh_axes_of(entry):
        idx = idx * np.uint32(self.sizes[a]) + lax.axis_index(a).astype(jnp.uint32)
      base.append(idx * np.uint32(self.local[d]))
    return base

  def window_start(self, c: Any) -> list[Any]:
    """Chunk ``c``'s first element, per dimension, within the shard."""
    local, dim, chunk = self.local, self.dim, self.chunk
    start = [jnp.uint32(0)] * len(local)
    c = c.astype(jnp.uint32)
    start[dim] = (c % np.uint32(local[dim] // chunk)) * np.uint32(chunk)
    if self.by_rows:  # chunks run over the dimensions before `dim` too
      c = c // np.uint32(local[dim] // chunk)
      for d in reversed(range(dim)):
        start[d] = c % np.uint32(local[d])
        c = c // np.uint32(local[d])
    return start


def _fill_in_chunks(
  w: WindowedOutput, inputs: list[Any], sw: _ShardWindows, dtype: Any, fill: int
) -> Any:
  """The shard, written chunk by chunk into a buffer starting as ``fill``."""
  base = sw.shard_offsets()
  wshape, minor = sw.wshape, sw.minor

  def body(c, buf):
    start = sw.window_start(c)
    offsets = [b + s for b, s in zip(base, start)]
    if sw.by_rows:
      size = math.prod(wshape)
      span = Span(base, sw.local, c.astype(jnp.uint32) * np.uint32(size))
      piece = w.evaluate(inputs, offsets, wshape, sw.limit, True, span)
      row = c * (size // minor)
      return lax.dynamic_update_slice(buf, piece.astype(dtype), (row, 0))
    piece = w.evaluate(inputs, offsets, wshape, sw.limit).astype(dtype)
    return lax.dynamic_update_slice(buf, piece, [s.astype(jnp.int32) for s in start])

  shape = (math.prod(sw.local) // minor, minor) if sw.by_rows else sw.local
  # Cast as numpy does (wrapping): equal fills only cost that copy.
  buf = jnp.full(shape, np.asarray(fill).astype(np.dtype(dtype)), dtype)
  varying = tuple(a for e in sw.spec for a in mesh_axes_of(e))
  if varying:  # the loop writes per-device data into it
    buf = lax.pcast(buf, varying, to='varying')
  return lax.fori_loop(0, sw.steps, body, buf).reshape(sw.local)


def _fill_in_one(
  w: WindowedOutput, inputs: list[Any], sw: _ShardWindows, dtype: Any, how: Generation
) -> Any:
  """The shard as one window, or cut from the whole parameter."""
  if how == 'whole':
    whole = w.evaluate_whole(inputs)
    # Not fused into the loop: the slice would give it the shard's shape.
    (whole,) = lax.optimization_barrier((whole,))
    piece = lax.dynamic_slice(whole, sw.shard_offsets(), sw.local)
  else:  # the shard as one window
    piece = w.evaluate(inputs, sw.shard_offsets(), sw.local, sw.limit)
  return lax.convert_element_type(piece, dtype)


def generate_sharded(
  w: WindowedOutput,
  inputs: list[Any],
  sharding: NamedSharding,
  dtype: Any,
  target_bytes: int = CHUNK_BYTES,
  buffer_fill: int = 0,
  how: Generation = 'chunks',
) -> Any:
  """The output, laid out as ``sharding``, each device making its own shard
  as ``how`` says (:data:`Generation`). Call inside ``jit``.

  Chunks are whole rows of the parameter's last dimension where the shard
  allows it (:func:`rows_plan`), each written straight from its loop into the
  shard's buffer viewed as rows; otherwise rectangles (:func:`chunk_plan`).

  ``buffer_fill``: the value the shard's buffer starts from (every element is then
  overwritten). Give each output of one program its own: XLA merges identical
  buffers, and copies the merged one into every loop filling it, a temporary
  as large as the shard.
  """
  itemsize = max(1, element_bits(dtype) // 8)
  sw = _ShardWindows.of(w, sharding, itemsize, target_bytes, how == 'chunks')
  used = [inputs[i] for i in w.used_inputs]

  def all_inputs(used_inputs: tuple[Any, ...]) -> list[Any]:
    full = [None] * len(inputs)
    for i, x in zip(w.used_inputs, used_inputs):
      full[i] = x
    return full

  def fill(*used_inputs: Any) -> Any:
    return _fill_in_chunks(w, all_inputs(used_inputs), sw, dtype, buffer_fill)

  def fill_one(*used_inputs: Any) -> Any:
    return _fill_in_one(w, all_inputs(used_inputs), sw, dtype, how)

  return jax.shard_map(
    fill if sw.steps > 1 else fill_one,
    mesh=sharding.mesh,
    in_specs=tuple(PartitionSpec() for _ in used),
    out_specs=PartitionSpec(*sw.spec),
    # One window needs no buffer made to vary over the axes of `spec` (its
    # values do through axis_index, a constant's do not): not checked.
    check_vma=sw.steps > 1,
  )(*used)
