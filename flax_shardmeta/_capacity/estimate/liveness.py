"""Peak bytes of a traced step, walking its values in program order.

Each value's bytes per chip follow its layout (``_capacity.estimate.propagate``); it is
live from the equation that makes it to its last use. Broadcasts, and
elementwise results used once, are fused into their consumers as XLA does;
donated arguments count from the start and are freed after their last use.
The peak of the live bytes is what the chip must hold besides the arguments.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from jax.extend import core as jex_core

from flax_shardmeta._arrays import array_bytes
from flax_shardmeta._capacity.estimate.propagate import (
  ELEMENTWISE,
  Spec,
  aval_spec,
  backward,
  inner_specs,
  outer_specs,
  propagate,
)
from flax_shardmeta._capacity.estimate.unplaced import Found, Key
from flax_shardmeta._programs.jaxprs import sub_jaxprs
from flax_shardmeta._specs import mesh_axes_of


@dataclasses.dataclass
class Walk:
  """Running totals of one liveness walk.

  Attributes:
    sizes: mesh axis -> size.
    found: the values counted replicated for want of a layout.
    at_peak: ``(bytes, what)`` of the largest values live at the peak.
  """

  sizes: dict[str, int]
  found: Found = dataclasses.field(default_factory=Found)
  at_peak: list[tuple[int, str]] = dataclasses.field(default_factory=list)

  def nbytes(self, aval: Any, spec: Spec) -> int:
    shape = getattr(aval, 'shape', None)
    dtype = getattr(aval, 'dtype', None)
    if shape is None or dtype is None:
      return 0
    if spec is None:
      return array_bytes(tuple(shape), dtype)
    shard = [
      -(-n // math.prod(self.sizes.get(a, 1) for a in mesh_axes_of(e)))
      for n, e in zip(shape, spec)
    ]
    return array_bytes(tuple(shard), dtype)


# XLA fuses these into their consumers: their results are never materialised.
_FUSED = frozenset({'broadcast_in_dim', 'iota'})


def _fused_uses(jaxpr: Any) -> set[Any]:
  """Values used exactly once, by an elementwise op or a reduction."""
  uses: dict[Any, int] = {}
  fusing: dict[Any, bool] = {}
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    fuses = name in ELEMENTWISE or name.startswith('reduce_')
    for v in eqn.invars:
      if isinstance(v, jex_core.Var):
        uses[v] = uses.get(v, 0) + 1
        fusing[v] = fuses
  outputs = {v for v in jaxpr.outvars if isinstance(v, jex_core.Var)}
  return {v for v, n in uses.items() if n == 1 and fusing[v] and v not in outputs}


class Walked(NamedTuple):
  """What one walk over a program found."""

  specs: list[Spec]  # the outputs' layouts
  peak: int  # the peak bytes of values live inside it
  virtual: list[bool]  # which outputs are fused broadcasts, never materialised
  unplaced: collections.Counter[Key]  # values without a layout live at the peak


def walk(
  jaxpr: Any,
  in_specs: list[Spec],
  w: Walk,
  counted: frozenset[Any] = frozenset(),
  in_virtual: Sequence[bool] = (),
  top: bool = False,
  out_hints: Sequence[Spec] = (),
) -> Walked:
  """Output specs, the peak bytes of values live inside ``jaxpr``, which
  outputs are virtual (fused broadcasts XLA never materialises), and which
  values without a layout are live at the peak.

  Layouts go forward from the inputs, then backward from ``out_hints`` (the
  step's out_shardings) through elementwise ops, as XLA's own propagation
  goes both ways: a gradient flowing into the updated parameters is laid out
  like them. Inputs in ``counted`` (donated arguments) count from the start
  and are freed after their last use; the others belong to the caller.
  """
  virtual: set[Any] = {v for v, flag in zip(jaxpr.invars, in_virtual) if flag}
  spec_of: dict[Any, Spec] = {}
  for v, s in zip(jaxpr.invars, in_specs):
    spec_of[v] = aval_spec(v.aval) or s
  for v in jaxpr.constvars:
    spec_of[v] = aval_spec(v.aval)
  inner: list[tuple[int, collections.Counter[Key]]] = []
  for eqn in jaxpr.eqns:  # forward: layouts and what is virtual
    peak_here, unplaced_here, fused = _forward(eqn, spec_of, virtual, w)
    inner.append((peak_here, unplaced_here))
    virtual.update(v for v, f in zip(eqn.outvars, fused) if f)
  backward(jaxpr, spec_of, out_hints, w.sizes)
  # Layouts are final only now: liveness, and what has none, come after.
  peak, unplaced = _liveness(jaxpr, spec_of, virtual, inner, counted, w, top)
  out_specs = [
    spec_of.get(v) if isinstance(v, jex_core.Var) else None for v in jaxpr.outvars
  ]
  out_virtual = [isinstance(v, jex_core.Var) and v in virtual for v in jaxpr.outvars]
  return Walked(out_specs, peak, out_virtual, unplaced)


def _last_uses(jaxpr: Any) -> dict[Any, int]:
  """The index of the equation that uses each value last (outputs: the end)."""
  last: dict[Any, int] = {}
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if isinstance(v, jex_core.Var):
        last[v] = i
  for v in jaxpr.outvars:
    if isinstance(v, jex_core.Var):
      last[v] = len(jaxpr.eqns)
  return last


def _liveness(
  jaxpr: Any,
  spec_of: dict[Any, Spec],
  virtual: set[Any],
  inner: list[tuple[int, collections.Counter[Key]]],
  counted: frozenset[Any],
  w: Walk,
  top: bool,
) -> tuple[int, collections.Counter[Key]]:
  """The peak of live bytes in program order, and the values without a
  layout live at it (``inner``: each equation's own peak inside it)."""
  fused_away = _fused_uses(jaxpr)
  last = _last_uses(jaxpr)
  size: dict[Any, int] = {}
  keys: dict[Any, Key] = {}  # the live values without a layout
  live_unplaced: collections.Counter[Key] = collections.Counter()
  live = 0
  for v in jaxpr.invars:
    if v in counted:
      size[v] = w.nbytes(v.aval, spec_of.get(v))
      live += size[v]
  peak, at_peak = live, collections.Counter[Key]()
  for i, eqn in enumerate(jaxpr.eqns):
    out_bytes = 0
    for v in eqn.outvars:
      s = spec_of.get(v)
      free = v in virtual or (
        v in fused_away and eqn.primitive.name in ELEMENTWISE  # its consumer's buffer
      )
      size[v] = 0 if free else w.nbytes(v.aval, s)
      if s is None and getattr(v.aval, 'shape', ()) and size[v]:
        keys[v] = w.found.add(eqn, v.aval)
        live_unplaced[keys[v]] += 1
      out_bytes += size[v]
    during = live + inner[i][0] + out_bytes
    if during > peak:
      at_peak = live_unplaced + inner[i][1]
      if top:
        largest = sorted(size.items(), key=lambda kv: -kv[1])[:6]
        w.at_peak = [(b, f'{v.aval.str_short()} ({_where(eqn)})') for v, b in largest]
      peak = during
    live += out_bytes
    for v in list(eqn.invars) + list(eqn.outvars):
      if isinstance(v, jex_core.Var) and last.get(v, -1) <= i and v in size:
        live -= size.pop(v)
        if v in keys:
          live_unplaced[keys.pop(v)] -= 1
  return peak, at_peak


def _forward(
  eqn: Any, spec_of: dict[Any, Spec], virtual: set[Any], w: Walk
) -> tuple[int, collections.Counter[Key], list[bool]]:
  """Sets the layouts of ``eqn``'s outputs; returns the peak inside it (its
  sub-programs'), the values without a layout live there, and which outputs
  are virtual."""
  ins = [spec_of.get(v) if isinstance(v, jex_core.Var) else None for v in eqn.invars]
  outs = [aval_spec(v.aval) for v in eqn.outvars]
  inner_peak, inner_unplaced = 0, collections.Counter[Key]()
  subs = sub_jaxprs(eqn)
  in_flags = [isinstance(v, jex_core.Var) and v in virtual for v in eqn.invars]
  out_virtual = [False] * len(eqn.outvars)
  for inner, how in subs:
    specs = inner_specs(eqn, how, ins, inner)
    flags = in_flags if how == 'call' else []
    with w.found.inside(eqn):
      inner_outs, inner_live, inner_virtual, unplaced = walk(
        inner, specs, w, in_virtual=flags
      )
    if inner_live > inner_peak:
      inner_peak, inner_unplaced = inner_live, unplaced
    if how == 'call' and len(inner_virtual) == len(out_virtual):
      out_virtual = inner_virtual
    outs = outer_specs(eqn, how, outs, inner_outs)
  if not subs:
    outs = [o or d for o, d in zip(outs, propagate(eqn, ins, w.sizes))]
    if eqn.primitive.name in _FUSED or (
      eqn.invars and all(_scalar_or(v, virtual) for v in eqn.invars)
    ):
      out_virtual = [True] * len(eqn.outvars)
  for v, s in zip(eqn.outvars, outs):
    spec_of[v] = s
  return inner_peak, inner_unplaced, out_virtual


def _where(eqn: Any) -> str:
  """Where in the step the peak is: the op and its name stack."""
  names = str(getattr(eqn.source_info, 'name_stack', '') or '')
  return f'at {eqn.primitive.name} in {names}' if names else f'at {eqn.primitive.name}'


def _scalar_or(v: Any, virtual: set[Any]) -> bool:
  """A literal, a scalar, or a virtual value: nothing that forces a buffer."""
  if not isinstance(v, jex_core.Var):
    return True
  return v in virtual or not getattr(v.aval, 'shape', ())
