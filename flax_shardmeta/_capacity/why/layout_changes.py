"""Which sharding constraints of a step change a value's layout.

XLA places the collective a constraint asks for wherever its scheduler
likes (often at the next operation, whose line is not the constraint's), so
the compiled program alone cannot say who asked. The traced step can: each
constraint's operand has a layout (propagated from the arguments' layouts
and earlier constraints, as XLA propagates them; exact under Explicit axes)
and the constraint asks for another. Where they differ, the constraint asked
for a reshard between them, whose buffers have known sizes per device; a
collective of the compiled program that moves exactly such buffers over the
axes that change is that reshard (:func:`asked_for`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

from jax.extend import core as jex_core

from flax_shardmeta._capacity.estimate.propagate import (
  Spec,
  aval_spec,
  inner_specs,
  outer_specs,
  propagate,
)
from flax_shardmeta._programs.jaxprs import sub_jaxprs
from flax_shardmeta._specs import mesh_axes_of

_CONSTRAINTS = ('sharding_constraint', 'reshard')


@dataclasses.dataclass(frozen=True)
class LayoutChange:
  """A constraint that changes its operand's layout.

  Attributes:
    source: the user's line of the constraint (``'pkg/model.py:22'``).
    scope: jax's name stack at the constraint.
    shape: the value's global shape.
    before: the operand's layout, one mesh-axis entry per dimension.
    after: the layout the constraint asks for.
    sizes: mesh axis sizes.

  Example:
    >>> c = LayoutChange('m.py:3', '', (8, 16), ('data', None), (None, 'data'),
    ...                  {'data': 4})
    >>> c.elements(c.before), c.elements(c.after), sorted(c.axes)
    (32, 32, ['data'])
  """

  source: str
  scope: str
  shape: tuple[int, ...]
  before: tuple[Any, ...]
  after: tuple[Any, ...]
  sizes: dict[str, int]

  def elements(self, spec: Sequence[Any]) -> int:
    """Elements of one device's shard under ``spec``."""
    out = 1
    for dim, entry in zip(self.shape, spec):
      ways = math.prod(self.sizes.get(a, 1) for a in mesh_axes_of(entry))
      out *= -(-dim // ways)
    return out

  @property
  def axes(self) -> frozenset[str]:
    """The mesh axes whose placement changes."""
    changed: set[str] = set()
    for b, a in zip(self.before, self.after):
      if mesh_axes_of(b) != mesh_axes_of(a):
        changed |= set(mesh_axes_of(b)) | set(mesh_axes_of(a))
    return frozenset(changed)

  def explains(self, elements_in: int, elements_out: int, axes: Sequence[str]) -> bool:
    """Whether a collective moving ``elements_in`` to ``elements_out`` per
    device over ``axes`` is this change's reshard."""
    if axes and not set(axes) <= self.axes:
      return False
    return (elements_in, elements_out) == (
      self.elements(self.before),
      self.elements(self.after),
    )


def layout_changes(
  jaxpr: Any,
  in_specs: Sequence[Spec],
  sizes: dict[str, int],
  where: Any,
) -> list[LayoutChange]:
  """Every constraint of ``jaxpr`` (and its sub-programs) whose operand's
  layout is known and differs from the one it asks for.

  Args:
    jaxpr: the traced step's jaxpr.
    in_specs: the layout of each of its inputs (None where unknown).
    sizes: mesh axis sizes.
    where: ``source_info -> 'file:line'`` (the user's line of an equation).
  """
  found: list[LayoutChange] = []
  _walk(jaxpr, list(in_specs), sizes, where, found)
  return found


def _walk(
  jaxpr: Any,
  in_specs: list[Spec],
  sizes: dict[str, int],
  where: Any,
  found: list[LayoutChange],
) -> list[Spec]:
  spec_of: dict[Any, Spec] = {}
  for v, s in zip(jaxpr.invars, in_specs):
    spec_of[v] = aval_spec(v.aval) or s
  for eqn in jaxpr.eqns:
    ins = [spec_of.get(v) if isinstance(v, jex_core.Var) else None for v in eqn.invars]
    if eqn.primitive.name in _CONSTRAINTS and eqn.invars:
      _record(eqn, ins[0], sizes, where, found)
    outs = [aval_spec(v.aval) for v in eqn.outvars]
    subs = sub_jaxprs(eqn)
    for inner, how in subs:
      inner_outs = _walk(inner, inner_specs(eqn, how, ins, inner), sizes, where, found)
      outs = outer_specs(eqn, how, outs, inner_outs)
    if not subs:
      outs = [o or d for o, d in zip(outs, propagate(eqn, ins, sizes))]
    for v, s in zip(eqn.outvars, outs):
      spec_of[v] = s
  return [
    spec_of.get(v) if isinstance(v, jex_core.Var) else None for v in jaxpr.outvars
  ]


def _record(
  eqn: Any, before: Spec, sizes: dict[str, int], where: Any, found: list[LayoutChange]
) -> None:
  shape = tuple(int(d) for d in getattr(eqn.invars[0].aval, 'shape', ()))
  sharding = eqn.params.get('sharding', eqn.params.get('dst_sharding'))
  spec = getattr(sharding, 'spec', None)
  if before is None or spec is None or not shape:
    return
  after = tuple(spec) + (None,) * (len(shape) - len(spec))
  before = tuple(before) + (None,) * (len(shape) - len(before))
  norm_before = tuple(mesh_axes_of(e) for e in before)
  norm_after = tuple(mesh_axes_of(e) for e in after)
  if norm_before == norm_after:
    return
  scope = str(getattr(eqn.source_info, 'name_stack', '') or '')
  found.append(
    LayoutChange(where(eqn.source_info), scope, shape, before, after, dict(sizes))
  )


def asked_for(
  changes: Sequence[LayoutChange],
  elements_in: int,
  elements_out: int,
  axes: Sequence[str],
  op_name: str = '',
) -> LayoutChange | None:
  """The change a collective is the reshard of: one moving those buffers over
  those axes; of several, one in the same pass (forward, or the backward
  pass's ``transpose``), then in the same module scope.

  Example:
    >>> fwd = LayoutChange('m.py:3', 'jvp(M)', (8, 16), ('data', None),
    ...                    (None, 'data'), {'data': 4})
    >>> bwd = dataclasses.replace(fwd, source='m.py:2', scope='transpose(jvp(M))')
    >>> asked_for([fwd, bwd], 32, 32, ('data',), 'jit(f)/transpose(jvp(M))/mul').source
    'm.py:2'
  """
  fits = [c for c in changes if c.explains(elements_in, elements_out, axes)]
  if not fits:
    return None
  backward = 'transpose(' in op_name
  same_pass = [c for c in fits if ('transpose(' in c.scope) == backward] or fits
  scope = _module_part(op_name)
  same = [c for c in same_pass if scope and _module_part(c.scope) == scope]
  return (same or same_pass)[0]


def _module_part(name_stack: str) -> str:
  """A name stack's module path, transformations left out (``'jit(f)/
  transpose(jvp(M))/layer/mul'`` -> ``'M/layer'``), to compare scopes."""
  words = re.findall(r'[A-Za-z_][\w.-]*', name_stack)
  skip = {'jit', 'pjit', 'jvp', 'transpose', 'vmap', 'while', 'body', 'closed_call'}
  return '/'.join(w for w in words if w not in skip)
