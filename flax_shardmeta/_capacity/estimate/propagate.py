"""Layouts of the values inside a traced step, where the mesh has no compiler.

Exact under Explicit mesh axes (the traced types carry them). Under Auto axes
they are propagated as XLA would: forward from the arguments' layouts and the
constraints inside the step (elementwise ops keep their most sharded
operand's, a matmul takes its operands' free dimensions', reductions drop
theirs), and back from the step's output layouts through elementwise ops (a
gradient flowing into the updated parameters is laid out like them). A value
nothing tells about has no layout (``None``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from jax.extend import core as jex_core

from flax_shardmeta._programs.jaxprs import UnknownParameters, scan_parts, sub_jaxprs
from flax_shardmeta._specs import mesh_axes_of

Spec = tuple[Any, ...] | None
"""A value's layout: one mesh-axis entry per dimension; None when unknown."""


def aval_spec(aval: Any) -> Spec:
  """The sharding a traced type carries (Explicit axes), else None."""
  sharding = getattr(aval, 'sharding', None)
  spec = getattr(sharding, 'spec', None)
  if spec is None or not getattr(aval, 'shape', None):
    return None
  entries = tuple(spec) + (None,) * (len(aval.shape) - len(spec))
  if all(e is None for e in entries):
    return None  # Auto axes: the type says nothing
  return entries


def _unique(entries: Sequence[Any]) -> tuple[Any, ...]:
  """Drops mesh axes used by an earlier dimension (a spec uses each once)."""
  used: set[str] = set()
  out = []
  for e in entries:
    axes = [a for a in mesh_axes_of(e) if a not in used]
    used.update(axes)
    out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  return tuple(out)


def ways(spec: Spec, sizes: dict[str, int]) -> int:
  """Into how many shards a layout splits its array."""
  if spec is None:
    return 1
  return math.prod(sizes.get(a, 1) for e in spec for a in mesh_axes_of(e))


def propagate(eqn: Any, ins: list[Spec], sizes: dict[str, int]) -> list[Spec]:
  """Output specs of one equation from its operands' (Auto axes)."""
  name = eqn.primitive.name
  outs: Any = eqn.outvars
  if name == 'sharding_constraint':
    spec = getattr(eqn.params.get('sharding'), 'spec', None)
    if spec is not None:
      rank = len(outs[0].aval.shape)
      return [_unique(tuple(spec) + (None,) * (rank - len(spec)))]
  if name == 'dot_general' and len(ins) == 2:
    (lc, rc), (lb, rb) = eqn.params['dimension_numbers']
    lhs, rhs = ins
    if lhs is None and rhs is None:
      # Nothing tells either operand's layout, so nothing tells the product's:
      # it stays unknown (counted replicated all the same, and reported).
      return [None]
    lrank, rrank = len(eqn.invars[0].aval.shape), len(eqn.invars[1].aval.shape)
    lhs = lhs or (None,) * lrank
    rhs = rhs or (None,) * rrank
    batch = [lhs[d] for d in lb]
    lfree = [lhs[d] for d in range(lrank) if d not in lc and d not in lb]
    rfree = [rhs[d] for d in range(rrank) if d not in rc and d not in rb]
    return [_unique(batch + lfree + rfree)]
  if name == 'transpose' and ins and ins[0] is not None:
    return [tuple(ins[0][d] for d in eqn.params['permutation'])]
  if name == 'broadcast_in_dim' and ins and ins[0] is not None:
    rank = len(outs[0].aval.shape)
    placed: list[Any] = [None] * rank
    for src, dst in enumerate(eqn.params['broadcast_dimensions']):
      if eqn.invars[0].aval.shape[src] == outs[0].aval.shape[dst]:
        placed[dst] = ins[0][src]
    return [tuple(placed)]
  if name == 'reshape' and ins and ins[0] is not None:
    shapes = (eqn.invars[0].aval.shape, outs[0].aval.shape)
    return [_reshape_spec(*shapes, ins[0], sizes)]
  if name.startswith('reduce_') or name in ('argmax', 'argmin'):
    axes = set(eqn.params.get('axes', ()))
    if ins and ins[0] is not None:
      kept = tuple(e for d, e in enumerate(ins[0]) if d not in axes)
      return [kept] * len(outs)
  # Same rank as an operand with a known layout: elementwise, slicing,
  # casts, concatenation, padding... keep the most sharded such operand's
  # layout, as XLA's propagation does.
  result: list[Spec] = []
  for v in outs:
    rank = len(getattr(v.aval, 'shape', ()))
    known = [
      s
      for s, iv in zip(ins, eqn.invars)
      if s is not None and len(getattr(iv.aval, 'shape', ())) == rank
    ]
    result.append(max(known, key=lambda s: ways(s, sizes)) if known else None)
  return result


def _reshape_spec(
  shape_in: tuple[int, ...],
  shape_out: tuple[int, ...],
  spec: tuple[Any, ...],
  sizes: dict[str, int],
) -> tuple[Any, ...]:
  """A reshape's output layout: dimensions grouped into blocks of equal size;
  a block keeps the layout of its major input dimension on its major output
  dimension when the mesh axes divide that (``(b, t, heads * d)`` split into
  ``(b, t, heads, d)`` keeps ``heads`` sharded), and is replicated otherwise.

  Example:
    >>> _reshape_spec((8, 512), (8, 8, 64), ('data', 'model'), {'data': 2, 'model': 4})
    ('data', 'model', None)
  """
  out: list[Any] = [None] * len(shape_out)
  i = j = 0
  while i < len(shape_in) and j < len(shape_out):
    i1, j1 = i + 1, j + 1
    pin, pout = shape_in[i], shape_out[j]
    while pin != pout:
      if pin < pout and i1 < len(shape_in):
        pin *= shape_in[i1]
        i1 += 1
      elif j1 < len(shape_out):
        pout *= shape_out[j1]
        j1 += 1
      else:
        return tuple(out)
    major = spec[i]
    rest_sharded = any(e is not None for e in spec[i + 1 : i1])
    if (
      major is not None
      and not rest_sharded
      and shape_out[j] % ways((major,), sizes) == 0
    ):
      out[j] = major
    elif i1 - i == 1 and j1 - j == 1:
      out[j] = spec[i]
    i, j = i1, j1
  return tuple(out)


# Elementwise work XLA fuses with its producer: a value whose only use is one
# of these (or a reduction) never gets a buffer of its own.
ELEMENTWISE = frozenset(
  'abs add and atan2 ceil clamp convert_element_type cos div eq erf erf_inv exp '
  'exp2 expm1 floor ge gt integer_pow is_finite le log log1p logistic lt max min '
  'mul ne neg not or pow rem round rsqrt select_n sign sin sqrt square stop_gradient '
  'sub tan tanh xor copy reduce_precision'.split()
)


def scan_split(params: dict[str, Any]) -> tuple[int, int]:
  """A scan's number of constant and carried operands (the rest are scanned);
  (0, 0) for parameters of no known jax release (nothing is held constant)."""
  try:
    _, consts, carry = scan_parts(params)
  except UnknownParameters:
    return 0, 0
  return consts, carry


def inner_specs(eqn: Any, how: str, ins: list[Spec], inner: Any) -> list[Spec]:
  n = len(inner.invars)
  if how == 'local':
    return [tuple([None] * len(getattr(v.aval, 'shape', ()))) for v in inner.invars]
  if how == 'scan':
    n_consts, n_carry = scan_split(eqn.params)
    consts = n_consts + n_carry
    return [s if i < consts or s is None else s[1:] for i, s in enumerate(ins)][:n]
  if how == 'while':
    skip = eqn.params.get('cond_nconsts', 0)
    return ins[skip : skip + n] if len(ins) >= skip + n else [None] * n
  if how == 'cond':
    return ins[1 : 1 + n]
  return ins[:n] if len(ins) == n else [None] * n


def outer_specs(
  eqn: Any, how: str, outs: list[Spec], inner_outs: Sequence[Spec]
) -> list[Spec]:
  """An equation's output layouts, where its own are unknown, from its
  sub-program's (``how`` as :func:`sub_jaxprs` says): a call's and a loop's
  as they are, a scan's stacked outputs with the stacking dimension whole."""
  if how in ('call', 'while') and len(inner_outs) == len(outs):
    return [o or s for o, s in zip(outs, inner_outs)]
  if how == 'scan':
    carry = scan_split(eqn.params)[1]
    return [
      o or (s if j < carry or s is None else (None, *s))
      for j, (o, s) in enumerate(zip(outs, inner_outs))
    ]
  return outs


def backward(
  jaxpr: Any,
  spec_of: dict[Any, Spec],
  out_hints: Sequence[Spec],
  sizes: dict[str, int],
) -> None:
  """Layouts from the outputs back through elementwise ops, where sharper."""

  def offer(v: Any, spec: Spec) -> None:
    if not isinstance(v, jex_core.Var) or spec is None:
      return
    if len(spec) != len(getattr(v.aval, 'shape', ())):
      return
    if ways(spec, sizes) > ways(spec_of.get(v), sizes):
      spec_of[v] = spec

  for v, hint in zip(jaxpr.outvars, out_hints):
    offer(v, hint)
  for eqn in reversed(jaxpr.eqns):
    name = eqn.primitive.name
    if name == 'transpose':
      spec = spec_of.get(eqn.outvars[0])
      if spec is not None:
        inverse = [0] * len(spec)
        for dst, src in enumerate(eqn.params['permutation']):
          inverse[src] = dst
        offer(eqn.invars[0], tuple(spec[d] for d in inverse))
      continue
    calls = any(how == 'call' for _, how in sub_jaxprs(eqn))
    passes = name in ELEMENTWISE or name in ('add_any', 'sharding_constraint')
    if not passes and not calls:
      continue
    for out in eqn.outvars:
      spec = spec_of.get(out)
      for v in eqn.invars:
        if getattr(v, 'aval', None) is not None and v.aval.shape == out.aval.shape:
          offer(v, spec)
