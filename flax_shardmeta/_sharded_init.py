"""Sharded initialization that never materializes more than a chunk of a shard.

``jax.jit(init, out_shardings=...)`` already generates every parameter on its
own shards (jax's partitionable threefry), but on CPU each generator keeps
about three shard-sized temporaries (the threefry loop state), and XLA runs
the generators of independent parameters side by side; on a model of a few
large matrices peak memory more than doubles. :func:`sharded_init` builds one
program in which each large parameter is filled chunk by chunk on each device
(see :mod:`flax_shardmeta.windowed`), so temporaries stay a small, fixed size.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.core
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding

from flax_shardmeta import _windowed as windowed
from flax_shardmeta._errors import NoMeshError
from flax_shardmeta._explicit import explain_sharding_type_errors
from flax_shardmeta._generate import ArrayCall
from flax_shardmeta._rules import logical_axis_rules
from flax_shardmeta._sharding import get_sharding, layout_tree
from flax_shardmeta._typing import AnyMesh, LogicalRules, PyTree

CHUNK_BYTES = windowed.CHUNK_BYTES


class ShardedInit:
  """``init_fn`` as one jitted program producing its output already sharded.

  Call it like ``init_fn``; ``lower(*args)`` gives the ``jax.stages.Lowered``
  program (e.g. for ``.compile().memory_analysis()``).
  """

  def __init__(
    self,
    init_fn: Callable[..., PyTree],
    mesh: Mesh,
    rules: LogicalRules | None = None,
    chunk_bytes: int = CHUNK_BYTES,
  ):
    if not isinstance(mesh, Mesh):
      raise NoMeshError(
        f'sharded_init needs a concrete jax.sharding.Mesh (devices to '
        f'generate on), got {type(mesh).__name__} {dict(mesh.shape)}. Make '
        'one with jax.make_mesh(...); to lay a model out on an AbstractMesh '
        'without devices, use fsm.plan(...).'
      )
    self.init_fn = init_fn
    self.mesh = mesh
    self.rules = rules
    self.chunk_bytes = chunk_bytes
    functools.update_wrapper(self, init_fn)

  def _rules(self) -> contextlib.AbstractContextManager[None]:
    if self.rules is None:
      return contextlib.nullcontext()
    return logical_axis_rules(self.rules)

  def _context(self) -> contextlib.ExitStack:
    # The program is traced with every axis Auto: values do not depend on
    # axis types, and under Explicit axes the random generators would be
    # typed replicated. Outputs are placed on the caller's mesh at the end.
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(_all_auto(self.mesh)))
    stack.enter_context(self._rules())
    return stack

  def _build(self, args: tuple[Any, ...], kwargs: dict[str, Any]):
    call, arrays = ArrayCall.split(self.init_fn, args, kwargs)
    arrays = [_to_auto(x) for x in arrays]

    def traced(*a: Any) -> Any:
      # Inside the trace, where jax's frames still name the operation.
      with explain_sharding_type_errors('fsm.sharded_init'):
        return call(*a)

    # Validate outside the mesh first, so every problem is reported with its
    # path (under the mesh the first constraint would fail without one).
    with self._rules():
      init_out = jax.eval_shape(traced, *arrays)
      get_sharding(init_out, self.mesh, self.rules)
    with self._context():
      closed, out_tree = jax.make_jaxpr(
        lambda *a: jax.tree_util.tree_leaves(traced(*a)), return_shape=True
      )(*arrays)
    out_treedef = jax.tree_util.tree_structure(init_out)
    shardings = _per_array_leaf(init_out, _all_auto(self.mesh), self.rules)
    graph = windowed._Graph(closed)
    plans: dict[int, windowed.WindowedOutput] = {}
    for i, (aval, sharding) in enumerate(zip(out_tree, shardings)):
      local = (
        math.prod(sharding.shard_shape(aval.shape)) * np.dtype(aval.dtype).itemsize
      )
      if local > self.chunk_bytes:
        w = windowed.analyse(closed, graph, i)
        if w is not None:
          plans[i] = w
    dtypes = [a.dtype for a in out_tree]

    def program(*arrays: Any) -> list[Any]:
      outs = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *arrays)
      for i, w in plans.items():
        # The plain result of output i goes unused, so XLA drops it.
        outs[i] = windowed.generate_sharded(
          w, list(arrays), shardings[i], dtypes[i], self.chunk_bytes
        )
      return outs

    jitted = jax.jit(program, out_shardings=shardings)
    return jitted, arrays, out_treedef

  def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
    """The lowered single program for these arguments."""
    jitted, arrays, _ = self._build(args, kwargs)
    with self._context():
      return jitted.lower(*arrays)

  def __call__(self, *args: Any, **kwargs: Any) -> PyTree:
    jitted, arrays, out_treedef = self._build(args, kwargs)
    with self._context():
      outs = jitted(*arrays)
    if _all_auto(self.mesh) is not self.mesh:
      outs = [_retype(x, self.mesh) for x in outs]
    return jax.tree_util.tree_unflatten(out_treedef, outs)


def sharded_init(
  init_fn: Callable[..., PyTree],
  mesh: Mesh,
  rules: LogicalRules | None = None,
  *,
  chunk_bytes: int = CHUNK_BYTES,
) -> ShardedInit:
  """Returns a function that runs ``init_fn`` and returns its output sharded.

  Each array leaf is laid out as ``fsm.get_sharding`` plans it (problems raise
  :class:`fsm.ShardingError` before anything runs) and generated where it
  lives; large parameters are filled chunk by chunk on each device, so no
  device ever holds more than its shards plus a few chunk-sized
  temporaries. Values equal ``init_fn``'s (up to floating-point rounding of
  the last bit in a few initializers).

  Args:
    init_fn: e.g. ``model.init`` or a function building a TrainState.
    mesh: the device mesh (a concrete ``Mesh``: devices generate the values).
    rules: logical axis rules; None uses the context rules.
    chunk_bytes: per-device bytes of a parameter generated at once; larger
      per-device shards are filled chunk by chunk.

  Returns:
    A :class:`ShardedInit` with ``init_fn``'s signature (and ``.lower``).

  Raises:
    NoMeshError: ``mesh`` is an ``AbstractMesh``.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, flax_shardmeta as fsm
    >>> mesh = jax.make_mesh((1,), ('model',))
    >>> model = nn.Dense(4, kernel_init=fsm.with_partitioning(
    ...     nn.initializers.lecun_normal(), (None, 'model')))
    >>> v = fsm.sharded_init(model.init, mesh)(jax.random.key(0), jnp.ones((1, 2)))
    >>> v['params']['kernel'].value.sharding.spec
    P(None, 'model')
  """
  return ShardedInit(init_fn, mesh, rules, chunk_bytes)


def _per_array_leaf(
  abstract: PyTree, mesh: AnyMesh, rules: LogicalRules | None
) -> list[Any]:
  """The sharding of each array leaf of ``abstract``, in flatten order."""
  leaves, layouts, _ = layout_tree(abstract, mesh, rules)
  out = []
  for lf, layout in zip(leaves, layouts):
    n = len(jax.tree_util.tree_leaves(lf.leaf))  # a box holds one array
    out.extend([layout.sharding] * n)
  return out


@functools.lru_cache(maxsize=64)
def _all_auto(mesh: Mesh) -> Mesh:
  if all(t == AxisType.Auto for t in mesh.axis_types):
    return mesh
  return jax.sharding.Mesh(
    mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names)
  )


def _to_auto(x: jax.Array) -> jax.Array:
  """An input placed on an Explicit mesh, moved to its all-Auto twin."""
  sharding = getattr(x, 'sharding', None)
  if isinstance(sharding, NamedSharding):
    auto = _all_auto(sharding.mesh)
    if auto is not sharding.mesh:
      return jax.device_put(x, NamedSharding(auto, sharding.spec))
  return x


def _retype(x: jax.Array, mesh: AnyMesh) -> jax.Array:
  """The same buffers, with the sharding expressed on ``mesh`` (no copy)."""
  sharding = NamedSharding(mesh, cast(NamedSharding, x.sharding).spec)
  return jax.make_array_from_single_device_arrays(
    x.shape, sharding, [s.data for s in x.addressable_shards]
  )
