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
fills its shard in chunks (:mod:`flax_shardmeta._generate.fill`), so temporaries
scale with a chunk; the init's jaxpr is read as one flat graph
(:mod:`flax_shardmeta._generate.jaxpr_graph`). Anything else
(an orthogonal init, a non-threefry key, a parameter over 2**32 elements) falls
back to ordinary generation.

Each window is computed in a loop whose minor dimension is the parameter's
own, as the unsharded initializer computes it (:mod:`flax_shardmeta._generate.loops`):
its values are then that initializer's, bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p

from flax_shardmeta._generate.jaxpr_graph import Graph, Node, bind, scan_parts
from flax_shardmeta._generate.loops import (
  Loop,
  Span,
  Unsupported,
)

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


@dataclasses.dataclass
class WindowedOutput:
  """One output of a jaxpr, computable for any window of its full shape."""

  graph: Graph
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
        env[n] = bind(node, [env[i] for i in node.inputs])
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
        env[n] = bind(node, ins, drop_sharding=True)
    return env[self.out]

  def _window_op(
    self,
    node: Node,
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
      return bind(node, args, drop_sharding=True), True
    raise Unsupported(f'{name} is not elementwise')

  def _window_scan(
    self, node: Node, ins: list[Any], loop: Loop, rows: bool
  ) -> tuple[Any, bool]:
    # A stacked output of a scan (e.g. nn.scan's per-layer parameters): each
    # layer in the window is the body's output for that iteration, computed
    # window by window, provided it does not depend on the loop carry.
    p = node.params
    body, n_consts, n_carry = scan_parts(p)
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
  closed: jex.ClosedJaxpr, graph: Graph | None, index: int, check: bool = True
) -> WindowedOutput | None:
  """A window evaluator for output ``index``, or None when not possible."""
  graph = graph or Graph(closed)
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
