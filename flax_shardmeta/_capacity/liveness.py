"""Peak bytes of a traced step, walking its values in program order.

Each value's bytes per chip follow its layout (``_capacity.propagate``); it is
live from the equation that makes it to its last use. Broadcasts, and
elementwise results used once, are fused into their consumers as XLA does;
donated arguments count from the start and are freed after their last use.
The peak of the live bytes is what the chip must hold besides the arguments.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from jax.extend import core as jex_core

from flax_shardmeta._arrays import array_bytes
from flax_shardmeta._capacity.propagate import (
  ELEMENTWISE,
  Spec,
  aval_spec,
  backward,
  inner_specs,
  propagate,
  scan_split,
  sub_jaxprs,
)
from flax_shardmeta._specs import mesh_axes_of


@dataclasses.dataclass
class Walk:
  """Running totals of one liveness walk.

  Attributes:
    sizes: mesh axis -> size.
    unknown_bytes: the largest value counted replicated for want of a layout.
    at_peak: ``(bytes, what)`` of the largest values live at the peak.
  """

  sizes: dict[str, int]
  unknown_bytes: float = 0.0
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


def walk(
  jaxpr: Any,
  in_specs: list[Spec],
  w: Walk,
  counted: frozenset[Any] = frozenset(),
  in_virtual: Sequence[bool] = (),
  top: bool = False,
  out_hints: Sequence[Spec] = (),
) -> tuple[list[Spec], int, list[bool]]:
  """Output specs, the peak bytes of values live inside ``jaxpr``, and which
  outputs are virtual (fused broadcasts XLA never materialises).

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
  inner_peaks: list[int] = []
  for eqn in jaxpr.eqns:  # forward: layouts and what is virtual
    peak_here, fused = _forward(eqn, spec_of, virtual, w)
    inner_peaks.append(peak_here)
    virtual.update(v for v, f in zip(eqn.outvars, fused) if f)
  backward(jaxpr, spec_of, out_hints, w.sizes)
  fused_away = _fused_uses(jaxpr)
  last: dict[Any, int] = {}
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if isinstance(v, jex_core.Var):
        last[v] = i
  for v in jaxpr.outvars:
    if isinstance(v, jex_core.Var):
      last[v] = len(jaxpr.eqns)
  size: dict[Any, int] = {}
  live = 0
  for v in jaxpr.invars:
    if v in counted:
      size[v] = w.nbytes(v.aval, spec_of.get(v))
      live += size[v]
  peak = live
  for i, eqn in enumerate(jaxpr.eqns):  # liveness
    out_bytes = 0
    for v in eqn.outvars:
      s = spec_of.get(v)
      free = v in virtual or (
        v in fused_away and eqn.primitive.name in ELEMENTWISE  # its consumer's buffer
      )
      size[v] = 0 if free else w.nbytes(v.aval, s)
      if s is None and getattr(v.aval, 'shape', ()) and not free:
        w.unknown_bytes = max(w.unknown_bytes, size[v])
      out_bytes += size[v]
    during = live + inner_peaks[i] + out_bytes
    if top and during > peak:
      largest = sorted(size.items(), key=lambda kv: -kv[1])[:6]
      w.at_peak = [(b, f'{v.aval.str_short()} ({_where(eqn)})') for v, b in largest]
    peak = max(peak, during)
    live += out_bytes
    for v in list(eqn.invars) + list(eqn.outvars):
      if isinstance(v, jex_core.Var) and last.get(v, -1) <= i and v in size:
        live -= size.pop(v)
  out_specs = [
    spec_of.get(v) if isinstance(v, jex_core.Var) else None for v in jaxpr.outvars
  ]
  out_virtual = [isinstance(v, jex_core.Var) and v in virtual for v in jaxpr.outvars]
  return out_specs, peak, out_virtual


def _forward(
  eqn: Any, spec_of: dict[Any, Spec], virtual: set[Any], w: Walk
) -> tuple[int, list[bool]]:
  """Sets the layouts of ``eqn``'s outputs; returns the peak inside it (its
  sub-programs') and which outputs are virtual."""
  ins = [spec_of.get(v) if isinstance(v, jex_core.Var) else None for v in eqn.invars]
  outs = [aval_spec(v.aval) for v in eqn.outvars]
  inner_peak = 0
  subs = sub_jaxprs(eqn)
  in_flags = [isinstance(v, jex_core.Var) and v in virtual for v in eqn.invars]
  out_virtual = [False] * len(eqn.outvars)
  for inner, how in subs:
    specs = inner_specs(eqn, how, ins, inner)
    flags = in_flags if how == 'call' else []
    inner_outs, inner_live, inner_virtual = walk(inner, specs, w, in_virtual=flags)
    inner_peak = max(inner_peak, inner_live)
    if how == 'call' and len(inner_virtual) == len(out_virtual):
      out_virtual = inner_virtual
    if how in ('call', 'while') and len(inner_outs) == len(outs):
      outs = [o or s for o, s in zip(outs, inner_outs)]
    elif how == 'scan':
      carry = scan_split(eqn.params)[1]
      outs = [
        o or (s if j < carry or s is None else (None, *s))
        for j, (o, s) in enumerate(zip(outs, inner_outs))
      ]
  if not subs:
    outs = [o or d for o, d in zip(outs, propagate(eqn, ins, w.sizes))]
    if eqn.primitive.name in _FUSED or (
      eqn.invars and all(_scalar_or(v, virtual) for v in eqn.invars)
    ):
      out_virtual = [True] * len(eqn.outvars)
  for v, s in zip(eqn.outvars, outs):
    spec_of[v] = s
  return inner_peak, out_virtual


def _where(eqn: Any) -> str:
  """Where in the step the peak is: the op and its name stack."""
  names = str(getattr(eqn.source_info, 'name_stack', '') or '')
  return f'at {eqn.primitive.name} in {names}' if names else f'at {eqn.primitive.name}'


def _scalar_or(v: Any, virtual: set[Any]) -> bool:
  """A literal, a scalar, or a virtual value: nothing that forces a buffer."""
  if not isinstance(v, jex_core.Var):
    return True
  return v in virtual or not getattr(v.aval, 'shape', ())
