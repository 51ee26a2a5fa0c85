"""The loops a window of a parameter is computed in, and how a shard is cut
into windows.

XLA compiles an elementwise loop according to its shape. The random bits of a
window are exact whatever its shape, but on CPU the floating-point arithmetic
after them (``erf_inv`` in normal and truncated normal) can round an element's
last bit differently from one loop to another: the loop's minor (last)
dimension decides the vector code. The unsharded initializer computes the
whole parameter, in a loop whose minor dimension is the parameter's last one;
a window computed in a loop of that same minor dimension gets the same values
(tests/test_bit_identity.py checks that XLA still works that way).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from jax import lax
from jax.sharding import NamedSharding


class Unsupported(Exception):
  """The output cannot be computed window by window."""


@dataclasses.dataclass(frozen=True)
class Span:
  """A window that is the flat range ``[start, start + n)``, in row-major
  order, of a block of the parameter (a device's shard) at ``offsets`` with
  shape ``shape``.

  Its elements' indices then follow from ``start``, which changes from one
  chunk to the next: XLA cannot hoist them out of the chunk loop as arrays of
  a chunk's size each.
  """

  offsets: list[Any]
  shape: tuple[int, ...]
  start: Any


class Loop:
  """The loop a window of a parameter is computed in.

  A window whose last dimension is the parameter's, ``minor``, is computed in
  its own shape. A window that cuts it (a shard of a parameter sharded on it,
  or a chunk along it) is not: its elements, in row-major order, are computed
  in rows of ``minor``, ``(ceil(n / minor), minor)``, the last row padded. A
  window of fewer elements than one row is padded to a row only while that
  row fits in ``limit`` elements (or at most doubles the window); otherwise
  it keeps its own shape.

  A value in rows leaves the loop either as rows (for a caller writing whole
  rows of its shard's buffer) or in the window's shape behind an optimization
  barrier: a plain reshape would be fused into the loop, which would then
  have the window's shape again.
  """

  def __init__(
    self,
    shape: tuple[int, ...],
    offsets: list[Any],
    window: tuple[int, ...],
    limit: int = 0,
    span: Span | None = None,
  ):
    self.shape, self.offsets, self.window = shape, offsets, window
    self.limit, self.span = limit, span
    self.size = math.prod(window)
    self.minor = shape[-1] if len(shape) >= 2 else 0
    self.loop = window
    if self.minor and window[-1] != self.minor:
      rows = -(-self.size // self.minor)
      if rows * self.minor <= max(2 * self.size, limit):
        self.loop = (rows, self.minor)
    self.packed = self.loop != window
    self._coords: list[Any] | None = None

  def coords(self) -> list[Any]:
    """Each loop element's index into the parameter, one uint32 array per dim.

    Built from lax primitives: jnp's wrappers would each be traced as a
    function of their own, which costs small programs host memory.
    """
    if self._coords is None:
      u32 = np.dtype(np.uint32)
      if not self.packed:
        self._coords = [
          lax.add(lax.broadcasted_iota(u32, self.window, d), _u32(self.offsets[d]))
          for d in range(len(self.window))
        ]
      else:
        offsets, extent, start = self.offsets, self.window, None
        if self.span is not None:
          offsets, extent = self.span.offsets, self.span.shape
          start = _u32(self.span.start)
        j = lax.broadcasted_iota(u32, self.loop, 1)
        if start is not None:
          # The start first: what depends on it is not hoisted (see Span).
          j = lax.add(j, start)
        row = lax.broadcasted_iota(u32, self.loop, 0)
        j = lax.add(j, lax.mul(row, _full(self.minor, self.loop)))
        if math.prod(self.loop) != self.size:
          # The padding repeats the window's last element.
          last = _full(self.size - 1, self.loop)
          j = lax.min(j, last if start is None else lax.add(last, start))
        coords: list[Any] = [None] * len(extent)
        for d in reversed(range(len(extent))):
          size = _full(extent[d], self.loop)
          local = j if d == 0 else lax.rem(j, size)
          coords[d] = lax.add(local, _u32(offsets[d]))
          j = lax.div(j, size)
        self._coords = coords
    return self._coords

  def flat_index(self) -> Any:
    """Each loop element's row-major flat index into the parameter."""
    flat = None
    for d, c in enumerate(self.coords()):
      stride = math.prod(self.shape[d + 1 :])
      term = c if stride == 1 else lax.mul(c, _full(stride, np.shape(c)))
      flat = term if flat is None else lax.add(flat, term)
    return flat

  def pack(self, x: Any) -> Any:
    """A value of the window's shape, laid out as the loop."""
    if not self.packed:
      return x
    flat = lax.reshape(x, (self.size,))
    pad = math.prod(self.loop) - self.size
    if pad:
      last = lax.slice(flat, (self.size - 1,), (self.size,))
      flat = lax.concatenate([flat, lax.broadcast_in_dim(last, (pad,), (0,))], 0)
    return lax.reshape(flat, self.loop)

  def unpack(self, x: Any) -> Any:
    """A value laid out as the loop, in the window's shape."""
    if not self.packed:
      return x
    (x,) = lax.optimization_barrier((x,))  # keeps the loop's shape
    flat = lax.reshape(x, (math.prod(self.loop),))
    if math.prod(self.loop) != self.size:
      flat = lax.slice(flat, (0,), (self.size,))
    return lax.reshape(flat, self.window)

  def rows(self, x: Any, in_loop: bool) -> Any:
    """A value (laid out as the loop when ``in_loop``, else in the window's
    shape) as ``(n // minor, minor)`` rows; ``n`` must be whole rows."""
    if not self.minor or self.size % self.minor:
      raise Unsupported(f'window {self.window} is not whole rows of {self.shape}')
    if in_loop and self.packed:
      return x  # already whole rows, unpadded
    return lax.reshape(x, (self.size // self.minor, self.minor))


def _u32(x: Any) -> Any:
  return lax.convert_element_type(x, np.uint32)


def _full(value: int, shape: tuple[int, ...]) -> Any:
  """A uint32 constant of ``shape`` (lax's binary operations want equal shapes)."""
  return lax.full(shape, np.uint32(value), np.dtype(np.uint32))


def chunk_plan(
  local: tuple[int, ...], itemsize: int, target_bytes: int
) -> tuple[int, int]:
  """(dimension, chunk length) so a chunk is at most ``target_bytes``.

  A shard that can be split makes at least two chunks, whatever its size: XLA
  turns a one-step loop back into plain generation, which it schedules side by
  side with the others.
  """
  dim = max(range(len(local)), key=lambda d: local[d])
  row = math.prod(local) // local[dim] * itemsize
  want = max(1, min(target_bytes // max(row, 1), local[dim] // 2))
  chunk = max(c for c in range(1, local[dim] + 1) if local[dim] % c == 0 and c <= want)
  return dim, chunk


def rows_plan(
  local: tuple[int, ...], minor: int, itemsize: int, target_bytes: int
) -> tuple[int, int] | None:
  """(dimension, chunk length) of chunks that are whole rows of ``minor``
  elements of the shard, in its row-major order; None when there are none.

  A chunk is ``(1, ..., 1, length, *local[dim + 1:])``: a contiguous range of
  the shard, so its rows are rows of the shard's buffer viewed as
  ``(-1, minor)``, written there straight from the loop computing them. The
  chunk is at most ``target_bytes`` and, as in :func:`chunk_plan`, there are
  at least two: a one-step loop would become plain generation, its rows
  reshaped in the loop, which would then have the shard's shape.
  """
  total = math.prod(local)
  if total % minor or minor * itemsize > target_bytes:
    return None
  for dim in range(len(local)):
    inner = math.prod(local[dim + 1 :])
    if inner * itemsize > target_bytes:
      continue
    step = minor // math.gcd(minor, inner)  # lengths giving whole rows
    fits = [
      n
      for n in range(step, local[dim] + 1, step)
      if local[dim] % n == 0 and n * inner * itemsize <= target_bytes
    ]
    split = [n for n in fits if n * inner < total]
    if split:
      return dim, max(split)
  return None


def cuts_last_dim(shape: tuple[int, ...], sharding: NamedSharding) -> bool:
  """Whether a shard has another last dimension than the parameter: generated
  as is, its loop would not compute the values the unsharded one does (see
  :class:`Loop`)."""
  return len(shape) >= 2 and sharding.shard_shape(shape)[-1] != shape[-1]
