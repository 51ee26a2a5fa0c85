"""Generating a parameter window by window, each device only its own shard.

On CPU, XLA runs jax's threefry generator as a loop whose state is two
shard-sized ``uint32`` arrays plus a copy, so generating a parameter needs
about three times its shard in temporaries, however it is sharded. Peak memory
of a sharded init is then the model plus three times its largest parameter.

Most initializers (normal, truncated normal, uniform, variance scaling, zeros,
constants) compute each element from the random bits at that element's flat
index alone. For those, a window of the parameter can be computed on its own:
the bits of a window are threefry applied to the window's flat indices, exactly
the bits jax's partitionable threefry gives those elements. Each device then
fills its shard in chunks, so temporaries scale with a chunk. Anything else
(an orthogonal init, a non-threefry key, a parameter over 2**32 elements) falls
back to ordinary generation.

Each window is computed in a loop whose minor dimension is the parameter's
own, as the unsharded initializer computes it (:mod:`flax_shardmeta._loops`):
its values are then that initializer's, bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p
from jax.sharding import NamedSharding, PartitionSpec

from flax_shardmeta._loops import (
  Loop,
  Span,
  Unsupported,
  chunk_plan,
  rows_plan,
)
from flax_shardmeta._specs import mesh_axes_of

# Primitives computing each output element from the same element of their
# inputs (inputs of size-1 dimensions broadcast).
_ELEMENTWISE = frozenset(
  """
abs add and atan2 bitcast_convert_type cbrt ceil clamp convert_element_type
copy copy_p cos cosh div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag
integer_pow is_finite le log log1p logistic lt max min mul ne neg nextafter not
or pow real reduce_precision rem round rsqrt select_n shift_left
shift_right_arithmetic shift_right_logical sign sin sinh sqrt square
stop_gradient sub tan tanh xor
""".split()
)

# Layout-only primitives: on a window they are the identity (the window
# program places its result itself).
_LAYOUT = frozenset({'sharding_constraint', 'reshard', 'mesh_cast', 'pvary', 'pcast'})

CHUNK_BYTES = 4 * 2**20
"""Per-device bytes of a parameter generated at once."""

_INLINE_PARAMS = ('jaxpr', 'call_jaxpr', 'fun_jaxpr')


@dataclasses.dataclass
class _Node:
  prim: Any  # None for inputs and constants
  inputs: list[int]
  params: dict[str, Any]
  aval: Any
  value: Any = None  # constants and literals


class _Graph:
  """A jaxpr with nested calls inlined, as a flat list of nodes."""

  def __init__(self, closed: jex.ClosedJaxpr):
    self.nodes: list[_Node] = []
    self.inputs = [self._add(_Node(None, [], {}, v.aval)) for v in closed.jaxpr.invars]
    self.outputs = self._flatten(closed.jaxpr, closed.consts, self.inputs)

  def _add(self, node: _Node) -> int:
    self.nodes.append(node)
    return len(self.nodes) - 1

  def _const(self, value: Any, aval: Any) -> int:
    return self._add(_Node(None, [], {}, aval, value))

  def _flatten(self, jaxpr: Any, consts: Any, ins: list[int]) -> list[int]:
    env: dict[Any, int] = {}
    for v, c in zip(jaxpr.constvars, consts):
      env[v] = self._const(c, v.aval)
    env.update(zip(jaxpr.invars, ins))

    def read(x: Any) -> int:
      if isinstance(x, jex.Literal):
        return self._const(x.val, x.aval)
      return env[x]

    for eqn in jaxpr.eqns:
      args = [read(x) for x in eqn.invars]
      inner = next((eqn.params[k] for k in _INLINE_PARAMS if k in eqn.params), None)
      if inner is not None and eqn.primitive.name in (
        'jit',
        'pjit',
        'closed_call',
        'core_call',
        'custom_jvp_call',
        'custom_vjp_call',
        'remat',
        'checkpoint',
      ):
        if isinstance(inner, jex.ClosedJaxpr):
          outs = self._flatten(inner.jaxpr, inner.consts, args)
        else:
          outs = self._flatten(inner, (), args)
      else:
        outs = []
        for i, v in enumerate(eqn.outvars):
          node = _Node(eqn.primitive, args, dict(eqn.params), v.aval)
          node.params['_index'] = i
          outs.append(self._add(node))
      for v, o in zip(eqn.outvars, outs):
        if not isinstance(v, jex.DropVar):
          env[v] = o
    return [read(v) for v in jaxpr.outvars]

  def needed(self, out: int) -> list[int]:
    """Nodes ``out`` depends on, in evaluation order."""
    seen: set[int] = set()
    stack = [out]
    while stack:
      n = stack.pop()
      if n not in seen:
        seen.add(n)
        stack.extend(self.nodes[n].inputs)
    return sorted(seen)


@dataclasses.dataclass
class WindowedOutput:
  """One output of a jaxpr, computable for any window of its full shape."""

  graph: _Graph
  order: list[int]
  out: int
  shape: tuple[int, ...]
  used_inputs: list[int]
  random: bool = True  # False: no random bits (a constant), exact however made
  _inner: dict[int, WindowedOutput] = dataclasses.field(default_factory=dict)

  def evaluate(
    self,
    inputs: list[Any],
    offsets: list[Any],
    wshape: tuple[int, ...],
    limit: int = 0,
    rows: bool = False,
    span: Span | None = None,
  ) -> Any:
    """The output's values at ``[offsets : offsets + wshape]``.

    Args:
      inputs: the jaxpr's inputs.
      offsets: the window's start in each dimension (uint32 scalars).
      wshape: the window's shape.
      limit: elements a window may be padded to so that it is computed in
        rows of the parameter's last dimension (see :class:`Loop`).
      rows: return the window's values, in row-major order, as rows of the
        parameter's last dimension, ``(n // minor, minor)``, straight from
        the loop that computes them; the window must hold whole rows.
      span: the window as a flat range of a block, when it is one.
    """
    loop = Loop(self.shape, offsets, tuple(wshape), limit, span)
    env: dict[int, Any] = dict(zip(self.graph.inputs, inputs))
    # Nodes of the parameter's shape, computed for the window only; True when
    # laid out as the loop, False when in the window's shape.
    spatial: dict[int, bool] = {}
    for n in self.order:
      if n in env:
        continue
      node = self.graph.nodes[n]
      if node.prim is None:
        env[n] = node.value
        continue
      if tuple(node.aval.shape) == self.shape and self.shape:
        env[n], spatial[n] = self._window_op(node, env, spatial, loop, rows)
      else:
        if any(i in spatial for i in node.inputs):
          raise Unsupported(f'{node.prim.name} reduces the parameter')
        env[n] = _bind(node, [env[i] for i in node.inputs])
    if self.out not in spatial:
      raise Unsupported('the output is not computed element by element')
    out, in_loop = env[self.out], spatial[self.out]
    if rows:
      return loop.rows(out, in_loop)
    return loop.unpack(out) if in_loop else out

  def evaluate_whole(self, inputs: list[Any]) -> Any:
    """The whole output, by the unsharded initializer's own operations (any,
    not only elementwise ones), without its layout constraints: inside
    ``shard_map``, each device computes its own copy."""
    env: dict[int, Any] = dict(zip(self.graph.inputs, inputs))
    everything = Loop(self.shape, [np.uint32(0)] * len(self.shape), self.shape)
    for n in self.order:
      if n in env:
        continue
      node = self.graph.nodes[n]
      ins = [env[i] for i in node.inputs]
      if node.prim is None:
        env[n] = node.value
      elif node.prim.name in _LAYOUT:
        env[n] = ins[0]
      elif node.prim.name == 'scan' and tuple(node.aval.shape) == self.shape:
        env[n], _ = self._window_scan(node, ins, everything, False)
      else:
        env[n] = _bind(node, ins, drop_sharding=True)
    return env[self.out]

  def _window_op(
    self,
    node: _Node,
    env: dict[int, Any],
    spatial: dict[int, bool],
    loop: Loop,
    rows: bool,
  ) -> tuple[Any, bool]:
    """A node of the parameter's shape on the window: (value, laid out as loop)."""
    name = node.prim.name
    ins = [env[i] for i in node.inputs]
    if name == 'random_bits':
      return _window_bits(ins[0], node.params['bit_width'], loop.flat_index()), True
    if name == 'broadcast_in_dim':
      if node.inputs[0] in spatial:
        return ins[0], spatial[node.inputs[0]]
      if not np.shape(ins[0]):
        return lax.broadcast(ins[0], loop.loop), True
      dims = node.params['broadcast_dimensions']
      window = _window_broadcast(ins[0], dims, self.shape, loop.offsets, loop.window)
      return loop.pack(window), True
    if name == 'iota':
      return loop.coords()[node.params['dimension']].astype(node.aval.dtype), True
    if name in _LAYOUT and node.inputs[0] in spatial:
      return ins[0], spatial[node.inputs[0]]
    if name == 'scan':
      return self._window_scan(node, ins, loop, rows)
    if name in _ELEMENTWISE:
      args = []
      for i, x in zip(node.inputs, ins):
        if i in spatial:
          args.append(x if spatial[i] else loop.pack(x))
        elif not np.shape(x):
          args.append(x)
        else:
          window = _window_operand(x, self.shape, loop.offsets, loop.window)
          args.append(loop.pack(jnp.broadcast_to(window, loop.window)))
      return _bind(node, args, drop_sharding=True), True
    raise Unsupported(f'{name} is not elementwise')

  def _window_scan(
    self, node: _Node, ins: list[Any], loop: Loop, rows: bool
  ) -> tuple[Any, bool]:
    # A stacked output of a scan (e.g. nn.scan's per-layer parameters): each
    # layer in the window is the body's output for that iteration, computed
    # window by window, provided it does not depend on the loop carry.
    p = node.params
    body, n_consts, n_carry = _scan_parts(p)
    y = p['_index'] - n_carry
    if p.get('reverse') or y < 0 or not self.shape:
      raise Unsupported('scan carry or reversed scan')
    key = id(node)
    inner = self._inner.get(key)
    if inner is None:
      inner = analyse(body, None, n_carry + y, check=False)
      if inner is None or any(
        n_consts <= i < n_consts + n_carry for i in inner.used_inputs
      ):
        raise Unsupported('scan output depends on the carry')
      self._inner[key] = inner
    consts, xs = ins[:n_consts], ins[n_consts + n_carry :]
    offsets, wshape = loop.offsets, loop.window
    # Each layer is computed in a loop of its own, as the unsharded scan
    # computes it. When the caller takes rows and each layer's window is whole
    # rows, the layers' rows, one after the other, are the window's.
    layer_rows = (
      rows and len(self.shape) >= 3 and math.prod(wshape[1:]) % self.shape[-1] == 0
    )
    span = loop.span
    layer = math.prod(span.shape[1:]) if span is not None else 0
    pieces = []
    for i in range(wshape[0]):
      step = offsets[0] + np.uint32(i)
      body_in = (
        list(consts)
        + [None] * n_carry
        + [lax.dynamic_index_in_dim(x, step, keepdims=False) for x in xs]
      )
      inner_span = None
      if span is not None:  # a window never straddles two layers of a span
        start = span.start.astype(jnp.uint32) + np.uint32(i * math.prod(wshape[1:]))
        inner_span = Span(span.offsets[1:], span.shape[1:], start % np.uint32(layer))
      pieces.append(
        inner.evaluate(
          body_in, list(offsets[1:]), wshape[1:], loop.limit, layer_rows, inner_span
        )
      )
    if layer_rows:
      return jnp.concatenate(pieces).reshape(loop.loop), True
    return jnp.stack(pieces), False


def _scan_parts(params: dict[str, Any]) -> tuple[jex.ClosedJaxpr, int, int]:
  """A scan's body, closed, with its numbers of constants and of carries.

  The one place that reads the scan primitive's parameters: jax 0.12 gives
  the numbers as flat trees (``ft_in``: constants, carries, scanned inputs)
  and an open body; earlier versions ``num_consts`` / ``num_carry`` and a
  closed body. Anything else is Unsupported (the output is then generated
  whole), which tests/test_bit_identity.py's stacked layers notice.
  """
  body = params['jaxpr']
  if not isinstance(body, jex.ClosedJaxpr):
    body = jex.ClosedJaxpr(body, ())
  if 'num_consts' in params:
    return body, params['num_consts'], params['num_carry']
  if 'ft_in' in params:
    consts, carry, _ = params['ft_in'].unpack()
    return body, len(consts), len(carry)
  raise Unsupported(f'scan parameters {sorted(params)} are not known')


def _bind(node: _Node, args: list[Any], drop_sharding: bool = False) -> Any:
  params = {k: v for k, v in node.params.items() if k != '_index'}
  if drop_sharding and params.get('sharding') is not None:
    params['sharding'] = None  # the full-shape layout does not fit a window
  out = node.prim.bind(*args, **params)
  return out[node.params['_index']] if node.prim.multiple_results else out


def _window_operand(x: Any, shape, offsets, wshape) -> Any:
  """A non-parameter-shaped operand, cut to the window where it spans a dim."""
  xs = tuple(np.shape(x))
  if not xs or all(d == 1 for d in xs):
    return x
  if len(xs) != len(shape) or any(a not in (1, b) for a, b in zip(xs, shape)):
    raise Unsupported(f'operand of shape {xs} does not broadcast to {shape}')
  starts = [offsets[d] if xs[d] != 1 else 0 for d in range(len(xs))]
  sizes = [wshape[d] if xs[d] != 1 else 1 for d in range(len(xs))]
  return lax.dynamic_slice(x, starts, sizes)


def _window_broadcast(x, dims, shape, offsets, wshape):
  """``broadcast_in_dim(x, shape, dims)`` restricted to the window."""
  xs = tuple(np.shape(x))
  starts, sizes = [], []
  for i, d in enumerate(dims):
    if xs[i] == 1:
      starts.append(0)
      sizes.append(1)
    elif xs[i] == shape[d]:
      starts.append(offsets[d])
      sizes.append(wshape[d])
    else:
      raise Unsupported('broadcast of a partial dimension')
  if xs:
    x = lax.dynamic_slice(x, starts, sizes)
  return lax.broadcast_in_dim(x, wshape, tuple(dims))


def _window_bits(key: Any, bit_width: int, flat: Any) -> Any:
  # jax's partitionable threefry: the bits of element i are
  # threefry2x32(key, (hi(i), lo(i))) with i its row-major flat index; here
  # every flat index fits in 32 bits (checked by the caller), so hi is 0.
  data = jax.random.key_data(key)
  # The high words are all zero; derive them from `flat` so that inside
  # shard_map they vary across devices exactly as the low words do.
  zeros = lax.bitwise_and(flat, np.uint32(0))
  b1, b2 = threefry2x32_p.bind(data[0], data[1], zeros, flat)
  bits = lax.bitwise_xor(b1, b2)
  if bit_width == 32:
    return bits
  if bit_width in (8, 16):
    return bits.astype(np.dtype(f'uint{bit_width}'))
  raise Unsupported(f'{bit_width}-bit random bits')


def analyse(
  closed: jex.ClosedJaxpr, graph: _Graph | None, index: int, check: bool = True
) -> WindowedOutput | None:
  """A window evaluator for output ``index``, or None when not possible."""
  graph = graph or _Graph(closed)
  out = graph.outputs[index]
  aval = graph.nodes[out].aval
  shape = tuple(aval.shape)
  if math.prod(shape) >= 2**32 or (check and not shape):
    return None
  if not jax.config.values['jax_threefry_partitionable']:
    return None
  order = graph.needed(out)
  for n in order:
    node = graph.nodes[n]
    if node.prim is not None and node.prim.name == 'random_bits':
      key_aval = graph.nodes[node.inputs[0]].aval
      if 'fry' not in str(key_aval.dtype):
        return None  # only jax's default threefry keys have windowed bits
  used = [i for i, n in enumerate(graph.inputs) if n in set(order)]
  random = any(
    graph.nodes[n].prim is not None
    and graph.nodes[n].prim.name in ('random_bits', 'scan')
    for n in order
  )
  w = WindowedOutput(graph, order, out, shape, used, random)
  if not check:
    return w
  try:
    # Dry run on a one-element window validates every primitive on the path,
    # laid out in a row of the parameter's last dimension as a shard cut
    # along it would be.
    probe = [
      jax.ShapeDtypeStruct(graph.nodes[n].aval.shape, graph.nodes[n].aval.dtype)
      for n in graph.inputs
    ]
    window = (1,) * len(shape)
    out_aval = jax.eval_shape(
      lambda *a: w.evaluate(
        list(a), [jnp.uint32(0)] * len(shape), window, limit=shape[-1]
      ),
      *probe,
    )
    if tuple(out_aval.shape) != window:
      return None
  except Exception:  # noqa: BLE001 - anything unexpected: generate as usual
    # Falling back is always correct; chunking is only an optimization.
    return None
  return w


def can_be_made_whole(w: WindowedOutput) -> bool:
  """Whether :meth:`WindowedOutput.evaluate_whole` traces (a dry run)."""
  probe = [
    jax.ShapeDtypeStruct(w.graph.nodes[n].aval.shape, w.graph.nodes[n].aval.dtype)
    for n in w.graph.inputs
  ]
  try:
    jax.eval_shape(lambda *a: w.evaluate_whole(list(a)), *probe)
  except Exception:  # noqa: BLE001 - anything unexpected: generate as usual
    return False
  return True


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
  mesh = sharding.mesh
  spec = tuple(sharding.spec) + (None,) * (len(w.shape) - len(sharding.spec))
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  parts = [math.prod(sizes[a] for a in mesh_axes_of(e)) for e in spec]
  local = tuple(s // p for s, p in zip(w.shape, parts))
  itemsize = np.dtype(dtype).itemsize
  minor = w.shape[-1] if len(w.shape) >= 2 else 0
  chunked = how == 'chunks'
  by_rows = None
  if chunked and minor:
    by_rows = rows_plan(local, minor, itemsize, target_bytes)
  if by_rows is not None:
    dim, chunk = by_rows
    wshape = (1,) * dim + (chunk,) + local[dim + 1 :]
  else:
    dim, chunk = chunk_plan(local, itemsize, target_bytes) if chunked else (0, local[0])
    wshape = tuple(chunk if d == dim else n for d, n in enumerate(local))
  steps = math.prod(local) // math.prod(wshape)
  limit = target_bytes // itemsize
  used = [inputs[i] for i in w.used_inputs]

  def shard_offsets() -> list[Any]:
    # Where this device's shard starts, per dimension.
    base = []
    for d, entry in enumerate(spec):
      idx = jnp.uint32(0)
      for a in mesh_axes_of(entry):
        idx = idx * np.uint32(sizes[a]) + lax.axis_index(a).astype(jnp.uint32)
      base.append(idx * np.uint32(local[d]))
    return base

  def all_inputs(used_inputs: tuple[Any, ...]) -> list[Any]:
    full = [None] * len(inputs)
    for i, x in zip(w.used_inputs, used_inputs):
      full[i] = x
    return full

  def fill(*used_inputs: Any) -> Any:
    full_inputs = all_inputs(used_inputs)
    base = shard_offsets()

    def window_start(c: Any) -> list[Any]:
      # Chunk c's first element, per dimension, within the shard.
      start = [jnp.uint32(0)] * len(local)
      c = c.astype(jnp.uint32)
      start[dim] = (c % np.uint32(local[dim] // chunk)) * np.uint32(chunk)
      if by_rows:  # chunks run over the dimensions before `dim` too
        c = c // np.uint32(local[dim] // chunk)
        for d in reversed(range(dim)):
          start[d] = c % np.uint32(local[d])
          c = c // np.uint32(local[d])
      return start

    def body(c, buf):
      start = window_start(c)
      offsets = [b + s for b, s in zip(base, start)]
      if by_rows:
        size = math.prod(wshape)
        span = Span(base, local, c.astype(jnp.uint32) * np.uint32(size))
        piece = w.evaluate(full_inputs, offsets, wshape, limit, True, span)
        row = c * (size // minor)
        return lax.dynamic_update_slice(buf, piece.astype(dtype), (row, 0))
      piece = w.evaluate(full_inputs, offsets, wshape, limit).astype(dtype)
      return lax.dynamic_update_slice(buf, piece, [s.astype(jnp.int32) for s in start])

    shape = (math.prod(local) // minor, minor) if by_rows else local
    # Cast as numpy does (wrapping): equal fills only cost that copy.
    buf = jnp.full(shape, np.asarray(buffer_fill).astype(np.dtype(dtype)), dtype)
    varying = tuple(a for e in spec for a in mesh_axes_of(e))
    if varying:  # the loop writes per-device data into it
      buf = lax.pcast(buf, varying, to='varying')
    return lax.fori_loop(0, steps, body, buf).reshape(local)

  def fill_one(*used_inputs: Any) -> Any:
    if how == 'whole':
      whole = w.evaluate_whole(all_inputs(used_inputs))
      # Not fused into the loop: the slice would give it the shard's shape.
      (whole,) = lax.optimization_barrier((whole,))
      piece = lax.dynamic_slice(whole, shard_offsets(), local)
    else:  # the shard as one window
      piece = w.evaluate(all_inputs(used_inputs), shard_offsets(), local, limit)
    return lax.convert_element_type(piece, dtype)

  return jax.shard_map(
    fill if steps > 1 else fill_one,
    mesh=mesh,
    in_specs=tuple(PartitionSpec() for _ in used),
    out_specs=PartitionSpec(*spec),
    # One window needs no buffer made to vary over the axes of `spec` (its
    # values do through axis_index, a constant's do not): not checked.
    check_vma=steps > 1,
  )(*used)
