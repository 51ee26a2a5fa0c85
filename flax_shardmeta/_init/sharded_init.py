"""Sharded initialization that never materializes more than a few chunks beyond
the shards.

``jax.jit(init, out_shardings=...)`` already generates every parameter on its
own shards (jax's partitionable threefry), but on CPU each generator keeps
about three shard-sized temporaries (the threefry loop state), and XLA runs
the generators of independent parameters side by side: peak memory more than
doubles, whether the model is a few large matrices or many small ones.
:func:`sharded_init` keeps a program only when XLA's memory analysis says it
holds at most a few chunks: plain generation for a small model, otherwise one
program in which every parameter that allows it is filled chunk by chunk on
each device (see :mod:`flax_shardmeta._generate.windowed`), so temporaries stay a small,
fixed size. Either way, sharded parameters are made so that their values
are the unsharded init's, bit for bit (see :func:`sharded_init`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.core
from jax.sharding import AxisType, Mesh, NamedSharding

from flax_shardmeta._errors import NoMeshError
from flax_shardmeta._explicit import explain_sharding_type_errors
from flax_shardmeta._generate import fill, windowed
from flax_shardmeta._generate.generate import ArrayCall
from flax_shardmeta._generate.jaxpr_graph import Graph
from flax_shardmeta._jit_key import own_trace
from flax_shardmeta._placement import check_mesh
from flax_shardmeta._programs.memory import program_memory
from flax_shardmeta._rules import logical_axis_rules
from flax_shardmeta._sharding import get_sharding, layout_tree
from flax_shardmeta._typing import AnyMesh, LogicalRules, PyTree

CHUNK_BYTES = windowed.CHUNK_BYTES
Program = tuple[jax.stages.Lowered, jax.stages.Compiled]
"""A program of the init, lowered and compiled."""
Plans = dict[int, windowed.WindowedOutput]
"""Outputs (by flat index) that can be generated from their windows, with
their evaluators."""
Plan = tuple[windowed.WindowedOutput, fill.Generation]
"""An output's evaluator and how each device makes its shard from it."""
_WORST_BYTES_PER_ELEMENT = 16
"""Temporaries of plain generation per element when every generator runs at
once: jax's threefry holds two 32-bit words per element, its bits and the
value (measured on CPU: 12 bytes for float32, 16 for bfloat16)."""
FEW_CHUNKS = 5
"""Temporaries plain generation may hold, in chunks, before parameters are
generated chunk by chunk instead: what chunked generation itself holds (about
four chunks: the random bits, threefry's two words and the piece written)."""


class ShardedInit:
  """``init_fn`` as one jitted program producing its output already sharded.

  Call it like ``init_fn``; ``lower(*args)`` gives the ``jax.stages.Lowered``
  program a call runs (e.g. for ``.compile().memory_analysis()``).
  """

  def __init__(
    self,
    init_fn: Callable[..., PyTree],
    mesh: Mesh,
    rules: LogicalRules | None = None,
    chunk_bytes: int = CHUNK_BYTES,
  ):
    # None, a string or rules where the mesh goes: check_mesh names them.
    check_mesh(mesh, 'sharded_init')
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

  def _build(
    self, args: tuple[Any, ...], kwargs: dict[str, Any]
  ) -> tuple[jax.stages.Lowered, jax.stages.Compiled, list[Any], Any]:
    """The program to run: (lowered, compiled, its arguments, output treedef)."""
    call, arrays = ArrayCall.split(self.init_fn, args, kwargs)
    arrays = [_to_auto(x) for x in arrays]

    def traced(*a: Any) -> Any:
      # Inside the trace, where jax's frames still name the operation.
      # Traced afresh by each call (a new closure): no trace of it is reused
      # under other rules, whatever jax's cache key says.
      with explain_sharding_type_errors('fsm.sharded_init'), own_trace():
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
    programs = _Programs(
      closed, out_tree, shardings, arrays, self._context, self.chunk_bytes
    )
    return (*programs.choose(), arrays, out_treedef)

  def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
    """The lowered single program for these arguments (the one a call runs)."""
    return self._build(args, kwargs)[0]

  def __call__(self, *args: Any, **kwargs: Any) -> PyTree:
    _, compiled, arrays, out_treedef = self._build(args, kwargs)
    outs = compiled(*arrays)
    if _all_auto(self.mesh) is not self.mesh:
      outs = [_retype(x, self.mesh) for x in outs]
    return jax.tree_util.tree_unflatten(out_treedef, outs)


class _Programs:
  """The programs an init can run as, compiled when asked for, and the choice
  between them by what XLA's memory analysis says they hold."""

  def __init__(
    self,
    closed: Any,
    out_tree: list[Any],
    shardings: list[Any],
    arrays: list[Any],
    context: Callable[[], contextlib.ExitStack],
    chunk_bytes: int,
  ):
    self.closed, self.out_tree, self.shardings = closed, out_tree, shardings
    self.arrays, self.context, self.chunk_bytes = arrays, context, chunk_bytes
    self.dtypes = [a.dtype for a in out_tree]
    self._graph: Graph | None = None  # built once, when first needed
    self._analysed: dict[tuple[int, bool], windowed.WindowedOutput | None] = {}

  def choose(self) -> Program:
    """The program to run.

    The programs decide, not the parameters' sizes: XLA runs the generators
    of independent parameters side by side, so many small shards can hold as
    much as one large one. A program is kept when XLA's memory analysis says
    it holds at most a few chunks. Tried first is plain generation when even
    every generator running at once would hold no more (a tiny model compiles
    once and pays nothing), chunked generation otherwise.
    """
    budget = FEW_CHUNKS * self.chunk_bytes
    worst = sum(
      _WORST_BYTES_PER_ELEMENT * math.prod(s.shard_shape(a.shape))
      for a, s in zip(self.out_tree, self.shardings)
    )
    plain_first = worst <= budget
    chosen = self.plain() if plain_first else self.chunked()
    if chosen is None:
      return self.plain()
    held = program_memory(chosen[1])
    if held is not None and held.temporaries > budget:
      # More than a few chunks: the other program may hold less.
      other = self.chunked() if plain_first else self.plain()
      other_held = None if other is None else program_memory(other[1])
      if other is not None and other_held is not None:
        if other_held.temporaries < held.temporaries:
          chosen = other
    return chosen

  def plain(self) -> Program:
    """Plain generation, except sharded parameters XLA's partitioning would
    not give the unsharded values of: those are made on each device from
    their windows, in one piece (see fill.in_one_piece). No dry run: the
    program's own trace is one (see _program)."""
    shardings = self.shardings
    sharded = [i for i, s in enumerate(shardings) if not s.is_fully_replicated]
    plans = {}
    for i, w in self._windowable(sharded, checked=False).items():
      itemsize = self.dtypes[i].itemsize
      how = fill.in_one_piece(w, shardings[i], itemsize, self.chunk_bytes)
      if how is not None:
        plans[i] = (w, how)
    return self._compile(plans)

  def chunked(self) -> Program | None:
    """Every output that can be, generated chunk by chunk; None: none can."""
    plans = self._windowable(list(range(len(self.out_tree))))
    if not plans:
      return None
    return self._compile({i: (w, 'chunks') for i, w in plans.items()})

  def _compile(self, plans: dict[int, Plan]) -> Program:
    program = _program(
      self.closed, plans, self.shardings, self.dtypes, self.chunk_bytes
    )
    with self.context():
      jitted = jax.jit(program, out_shardings=self.shardings)
      lowered = jitted.lower(*self.arrays)
    return lowered, lowered.compile()

  def _windowable(self, indices: list[int], checked: bool = True) -> Plans:
    """Those of the outputs ``indices`` that can be computed window by window,
    with their evaluators, each analysed once; ``checked``: after a dry run."""
    if indices and self._graph is None:
      self._graph = Graph(self.closed)
    analysed = self._analysed
    plans = {}
    for i in indices:
      key = (i, True) if (i, True) in analysed else (i, checked)
      if key not in analysed:
        analysed[key] = windowed.analyse(self.closed, self._graph, i, checked)
      if (w := analysed[key]) is not None:
        plans[i] = w
    return plans


def _program(
  closed: Any,
  plans: dict[int, Plan],
  shardings: list[Any],
  dtypes: list[Any],
  chunk_bytes: int,
) -> Callable[..., list[Any]]:
  """The init as one function; the outputs in ``plans`` are made on each
  device from their windows, as their plans say."""

  def program(*arrays: Any) -> list[Any]:
    outs = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *arrays)
    for i, (w, how) in plans.items():
      try:
        # The plain result of output i goes unused, so XLA drops it.
        outs[i] = fill.generate_sharded(
          w,
          list(arrays),
          shardings[i],
          dtypes[i],
          chunk_bytes,
          buffer_fill=i + 1,
          how=how,
        )
      except Exception:  # noqa: BLE001
        if how == 'chunks':
          raise  # dry-run already (windowed.analyse)
        # Not dry-run (a small model's program, where a dry run per output
        # costs as much host memory as the rest): XLA partitions it instead.
    return outs

  return program


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
  lives. The program is chosen by what XLA's memory analysis says it holds:
  plain generation when its temporaries are at most :data:`FEW_CHUNKS` chunks,
  otherwise one in which parameters are filled chunk by chunk on each device,
  whatever their size. So no device holds more than its shards plus a few
  chunk-sized temporaries (initializers that cannot be computed chunk by
  chunk, such as orthogonal, are generated whole).

  Values are bit-identical to those of ``jax.jit(init_fn)`` run unsharded on
  the same arguments, whatever the mesh or layout. XLA may round an element's
  last bit according to the shape of the loop computing it, so sharded
  parameters are not left to XLA's partitioning: in a program without chunks,
  each device computes every sharded parameter of at most ``chunk_bytes``
  whole, by the init's own operations, and keeps its shard; any other
  parameter whose initializer is elementwise in its random bits (normal,
  truncated normal, uniform, variance scaling; stacked ``nn.scan`` layers
  too) is computed in loops whose last dimension is the parameter's, as in
  the unsharded program. Not bit-identical, in the last bit only: in a
  program with chunks, a parameter whose last dimension has only a few
  elements (3 to 6 on XLA:CPU today, where the loop's number of rows matters
  too); and a parameter neither made whole nor elementwise (orthogonal in a
  program with chunks or beyond ``chunk_bytes``; a non-threefry key), which
  has the values of ``jax.jit(init_fn, out_shardings=...)``.

  Args:
    init_fn: e.g. ``model.init`` or a function building a TrainState.
    mesh: the device mesh (a concrete ``Mesh``: devices generate the values).
    rules: logical axis rules; None uses the context rules.
    chunk_bytes: per-device bytes of a parameter generated at once when
      generating chunk by chunk.

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
