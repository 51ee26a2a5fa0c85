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
fills its shard in chunks, so temporaries scale with a chunk. Values are
bit-identical to the unchunked initializer. Anything else (an orthogonal init,
a non-threefry key, a parameter over 2**32 elements) falls back to ordinary
generation.
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
from jax.sharding import NamedSharding, PartitionSpec

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


class Unsupported(Exception):
  """The output cannot be computed window by window."""


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
  _inner: dict[int, WindowedOutput] = dataclasses.field(default_factory=dict)

  def evaluate(
    self, inputs: list[Any], offsets: list[Any], wshape: tuple[int, ...]
  ) -> Any:
    """The output's values at ``[offsets : offsets + wshape]``."""
    env: dict[int, Any] = dict(zip(self.graph.inputs, inputs))
    spatial: set[int] = set()
    for n in self.order:
      if n in env:
        continue
      node = self.graph.nodes[n]
      if node.prim is None:
        env[n] = node.value
        continue
      if tuple(node.aval.shape) == self.shape and self.shape:
        env[n] = self._window_op(node, env, spatial, offsets, wshape)
        spatial.add(n)
      else:
        if any(i in spatial for i in node.inputs):
          raise Unsupported(f'{node.prim.name} reduces the parameter')
        env[n] = _bind(node, [env[i] for i in node.inputs])
    return env[self.out]

  def _window_op(self, node, env, spatial, offsets, wshape):
    name = node.prim.name
    ins = [env[i] for i in node.inputs]
    if name == 'random_bits':
      return _window_bits(ins[0], node.params['bit_width'], self.shape, offsets, wshape)
    if name == 'broadcast_in_dim':
      x = ins[0]
      if node.inputs[0] in spatial:
        return x
      return _window_broadcast(
        x, node.params['broadcast_dimensions'], self.shape, offsets, wshape
      )
    if name == 'iota':
      d = node.params['dimension']
      return lax.broadcasted_iota(node.aval.dtype, wshape, d) + offsets[d].astype(
        node.aval.dtype
      )
    if name in _LAYOUT and node.inputs[0] in spatial:
      return ins[0]
    if name == 'scan':
      return self._window_scan(node, ins, offsets, wshape)
    if name in _ELEMENTWISE:
      args = []
      for i, x in zip(node.inputs, ins):
        args.append(
          x if i in spatial else _window_operand(x, self.shape, offsets, wshape)
        )
      return _bind(node, args, drop_sharding=True)
    raise Unsupported(f'{name} is not elementwise')

  def _window_scan(self, node, ins, offsets, wshape):
    # A stacked output of a scan (e.g. nn.scan's per-layer parameters): each
    # layer in the window is the body's output for that iteration, computed
    # window by window, provided it does not depend on the loop carry.
    p = node.params
    n_consts, n_carry = p['num_consts'], p['num_carry']
    y = p['_index'] - n_carry
    if p.get('reverse') or y < 0 or not self.shape:
      raise Unsupported('scan carry or reversed scan')
    key = id(node)
    inner = self._inner.get(key)
    if inner is None:
      inner = analyse(p['jaxpr'], None, n_carry + y, check=False)
      if inner is None or any(
        n_consts <= i < n_consts + n_carry for i in inner.used_inputs
      ):
        raise Unsupported('scan output depends on the carry')
      self._inner[key] = inner
    consts, xs = ins[:n_consts], ins[n_consts + n_carry :]
    pieces = []
    for i in range(wshape[0]):
      step = offsets[0] + np.uint32(i)
      body_in = (
        list(consts)
        + [None] * n_carry
        + [lax.dynamic_index_in_dim(x, step, keepdims=False) for x in xs]
      )
      pieces.append(inner.evaluate(body_in, list(offsets[1:]), wshape[1:]))
    return jnp.stack(pieces)


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


def _window_bits(key: Any, bit_width: int, shape, offsets, wshape) -> Any:
  # jax's partitionable threefry: the bits of element i are
  # threefry2x32(key, (hi(i), lo(i))) with i its row-major flat index; here
  # every flat index fits in 32 bits (checked by the caller), so hi is 0.
  data = jax.random.key_data(key)
  flat = jnp.zeros(wshape, jnp.uint32)
  for d in range(len(shape)):
    stride = math.prod(shape[d + 1 :])
    g = lax.broadcasted_iota(jnp.uint32, wshape, d) + offsets[d].astype(jnp.uint32)
    flat = flat + g * np.uint32(stride)
  # The high words are all zero; derive them from `flat` so that inside
  # shard_map they vary across devices exactly as the low words do.
  b1, b2 = threefry2x32_p.bind(data[0], data[1], flat & np.uint32(0), flat)
  bits = b1 ^ b2
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
  w = WindowedOutput(graph, order, out, shape, used)
  if not check:
    return w
  try:
    # Dry run on a one-element window validates every primitive on the path.
    probe = [
      jax.ShapeDtypeStruct(graph.nodes[n].aval.shape, graph.nodes[n].aval.dtype)
      for n in graph.inputs
    ]
    jax.eval_shape(
      lambda *a: w.evaluate(list(a), [jnp.uint32(0)] * len(shape), (1,) * len(shape)),
      *probe,
    )
  except Exception:  # noqa: BLE001 - anything unexpected: generate as usual
    # Falling back is always correct; chunking is only an optimization.
    return None
  return w


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


def generate_sharded(
  w: WindowedOutput,
  inputs: list[Any],
  sharding: NamedSharding,
  dtype: Any,
  target_bytes: int = CHUNK_BYTES,
  buffer_fill: int = 0,
) -> Any:
  """The output, laid out as ``sharding``, each device filling its own shard
  chunk by chunk. Call inside ``jit``.

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
  dim, chunk = chunk_plan(local, np.dtype(dtype).itemsize, target_bytes)
  used = [inputs[i] for i in w.used_inputs]

  def fill(*used_inputs: Any) -> Any:
    full_inputs = [None] * len(inputs)
    for i, x in zip(w.used_inputs, used_inputs):
      full_inputs[i] = x
    base = []
    for d, entry in enumerate(spec):
      idx = jnp.uint32(0)
      for a in mesh_axes_of(entry):
        idx = idx * np.uint32(sizes[a]) + lax.axis_index(a).astype(jnp.uint32)
      base.append(idx * np.uint32(local[d]))
    wshape = tuple(chunk if d == dim else n for d, n in enumerate(local))

    def body(c, buf):
      offsets = list(base)
      offsets[dim] = base[dim] + (c * chunk).astype(jnp.uint32)
      piece = w.evaluate(full_inputs, offsets, wshape).astype(dtype)
      start = [0] * len(local)
      start[dim] = c * chunk
      return lax.dynamic_update_slice(buf, piece, start)

    # Cast as numpy does (wrapping): equal fills only cost that copy.
    buf = jnp.full(local, np.asarray(buffer_fill).astype(np.dtype(dtype)), dtype)
    varying = tuple(a for e in spec for a in mesh_axes_of(e))
    if varying:  # the loop writes per-device data into it
      buf = lax.pcast(buf, varying, to='varying')
    return lax.fori_loop(0, local[dim] // chunk, body, buf)

  return jax.shard_map(
    fill,
    mesh=mesh,
    in_specs=tuple(PartitionSpec() for _ in used),
    out_specs=PartitionSpec(*spec),
  )(*used)
