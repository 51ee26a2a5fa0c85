"""Generating parameters where they live: each device makes only its own shards.

Initializers run under ``jit`` (eagerly) or ``auto_axes`` (under Explicit axes)
with the target sharding; eagerly, sharded and large ones are made from their
windows (``windowed``, ``fill``: whole on every device when small, chunk by
chunk when large) so that their values are the unsharded initializer's, bit
for bit.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.core
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from flax_shardmeta._generate import fill, windowed
from flax_shardmeta._placement import apply_spec, context_mesh, manual_axes
from flax_shardmeta._resolution import resolve
from flax_shardmeta._rules import (
  composite_rules,
  get_logical_axis_rules,
)
from flax_shardmeta._specs import unassigned_to_none
from flax_shardmeta._typing import AnyMesh, LogicalRules
from flax_shardmeta._validate import check_spec


def generate(
  init_fn: Any,
  args: tuple[Any, ...],
  kwargs: dict[str, Any],
  names: Any,
  mesh: AnyMesh | None,
  *,
  logical: bool = False,
  rules: LogicalRules | None = None,
) -> Any:
  """Calls an initializer so that each device generates only its own shard.

  Why: under Explicit axes a random initializer's output is replicated (its
  key is), so constraining it afterwards means every device first holds the
  whole parameter, 8x its size on 8 devices plus temporaries; and eagerly, on
  any mesh, the initializer would build the whole parameter on one device
  before it is split. Here the initializer runs under ``jit`` (when eager)
  and ``auto_axes`` (when Explicit) with the target sharding, so jax's
  partitionable RNG generates each shard where it lives. Inside a trace on an
  Auto mesh nothing is needed: the box's constraint propagates back into the
  initializer.

  Values, eagerly: those of the initializer run unsharded under ``jit``, bit
  for bit. A sharded parameter of at most a chunk is computed whole on every
  device, which keeps its shard; a larger elementwise one in loops shaped as
  the unsharded one's (the exceptions are ``sharded_init``'s). Inside the
  caller's own trace, XLA partitions the initializer with the rest of the
  program, and the last bit can differ.
  """
  mesh = mesh if mesh is not None else context_mesh()
  if mesh is None or manual_axes(mesh):
    return init_fn(*args, **kwargs)
  kinds = set(mesh.axis_types)
  call, arrays = ArrayCall.split(init_fn, args, kwargs)
  tracing = any(isinstance(x, jax.core.Tracer) for x in arrays)
  explicit = kinds == {AxisType.Explicit}
  if (tracing and not explicit) or len(kinds) != 1:
    return init_fn(*args, **kwargs)
  names = tuple(names)
  if logical:
    all_rules = composite_rules(get_logical_axis_rules(), rules)
    if not all_rules:
      return init_fn(*args, **kwargs)
    entries = unassigned_to_none(resolve(names, all_rules))
  else:
    entries = names
  try:
    out = jax.eval_shape(lambda: init_fn(*args, **kwargs))
  except TypeError:  # returns something that is not arrays: nothing to place
    return init_fn(*args, **kwargs)
  shape = getattr(out, 'shape', None)
  if (
    shape is None
    or len(shape) != len(entries)
    or check_spec(tuple(shape), entries, mesh)
  ):
    # Invalid layouts are reported, with the parameter path, by
    # get_sharding / plan; here the value is just created as usual.
    return init_fn(*args, **kwargs)
  spec = PartitionSpec(*entries)
  if tracing:
    # Arrays (the key) enter auto_axes as arguments so their types become
    # Auto; shapes and dtypes stay static.
    return jax.sharding.auto_axes(call, out_sharding=spec)(*arrays)
  avals = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays)
  try:
    generator = _eager_generator(call, avals, mesh, spec, explicit)
  except TypeError:  # unhashable static arguments: no cached program
    return apply_spec(init_fn(*args, **kwargs), entries, mesh, names=names)
  return generator(*arrays)


class ArrayCall:
  """``init_fn`` with its non-array arguments fixed, called on the arrays.

  jax transformations take arrays; initializers also take shapes and dtypes.
  """

  @classmethod
  def split(
    cls, init_fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
  ) -> tuple[ArrayCall, list[Any]]:
    """The call with the non-arrays fixed, and the arrays to call it on."""
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    is_array = tuple(isinstance(x, jax.Array) for x in leaves)
    static = tuple(x for x, a in zip(leaves, is_array) if not a)
    return (
      cls(init_fn, treedef, static, is_array),
      [x for x, a in zip(leaves, is_array) if a],
    )

  def __init__(
    self,
    init_fn: Any,
    treedef: Any,
    static: tuple[Any, ...],
    is_array: tuple[bool, ...],
  ):
    self.init_fn, self.treedef = init_fn, treedef
    self.static, self.is_array = static, is_array

  def _key(self) -> tuple[Any, ...]:
    return (self.init_fn, self.treedef, self.static, self.is_array)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, ArrayCall) and self._key() == other._key()

  def __hash__(self) -> int:  # TypeError for unhashable static arguments
    return hash(self._key())

  def __call__(self, *arrays: Any) -> Any:
    arr, st = iter(arrays), iter(self.static)
    full = [next(arr) if a else next(st) for a in self.is_array]
    args, kwargs = jax.tree_util.tree_unflatten(self.treedef, full)
    return self.init_fn(*args, **kwargs)


@functools.lru_cache(maxsize=1024)
def _eager_generator(call, avals, mesh, spec, explicit):
  sharding = NamedSharding(mesh, spec)
  closed = jax.make_jaxpr(lambda *a: [call(*a)])(*avals)
  out = closed.out_avals[0]
  plan = _windowed_plan(closed, sharding)
  if plan is not None:
    w, how = plan
    generator = jax.jit(
      lambda *a: fill.generate_sharded(w, list(a), sharding, out.dtype, how=how),
      out_shardings=sharding,
    )
    return generator
  if explicit:
    call = jax.sharding.auto_axes(call, out_sharding=spec)
  return jax.jit(call, out_shardings=sharding)


def _windowed_plan(
  closed: Any, sharding: NamedSharding
) -> tuple[windowed.WindowedOutput, fill.Generation] | None:
  """How an initializer's output is made from its windows; None: as XLA
  partitions it."""
  out = closed.out_avals[0]
  shape = tuple(out.shape)
  local = math.prod(sharding.shard_shape(shape)) * out.dtype.itemsize
  if local > windowed.CHUNK_BYTES:
    w = windowed.analyse(closed, None, 0)
    # Large: each device fills its shard chunk by chunk.
    return None if w is None else (w, 'chunks')
  if sharding.shard_shape(shape) == shape:
    return None
  # Small and sharded: partitioned by XLA, its loops might not compute the
  # unsharded values (see fill.in_one_piece). Each way is dry-run: made
  # whole, an initializer need not be elementwise.
  w = windowed.analyse(closed, None, 0, check=False)
  if w is None:
    return None
  how = fill.in_one_piece(w, sharding, out.dtype.itemsize, windowed.CHUNK_BYTES)
  if how == 'whole' and windowed.can_be_made_whole(w):
    return w, how
  if how == 'shard' and (w := windowed.analyse(closed, None, 0)) is not None:
    return w, how
  return None
