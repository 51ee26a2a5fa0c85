"""jaxprs as each jax release writes them, walked in one place.

Which call primitives have a body that is evaluated in place (``jit``, custom
derivatives, remat: their boundaries carry no types of their own), the
sub-programs of an equation and how its operands enter them, and a scan's
parameters, which jax 0.12 changed (``ft_in`` trees and an open body instead
of ``num_consts`` / ``num_carry`` and a closed one). The parameter generator,
the estimate, why()'s traced lines, golden files and the Explicit audit all
read jaxprs through these.

Example:
  >>> import jax, jax.numpy as jnp
  >>> def f(c, xs):
  ...   return jax.lax.scan(lambda c, x: (c + x, c * x), c, xs)
  >>> (eqn,) = jax.make_jaxpr(f)(0.0, jnp.ones(3)).jaxpr.eqns
  >>> body, consts, carry = scan_parts(eqn.params)
  >>> consts, carry, [how for _, how in sub_jaxprs(eqn)]
  (0, 1, ['scan'])
"""

from __future__ import annotations

from typing import Any

import jax.extend.core as jex

INLINED_CALLS = frozenset({
  'jit', 'pjit', 'closed_call', 'core_call', 'checkpoint', 'remat', 'remat2',
  'custom_jvp_call', 'custom_vjp_call', 'custom_vjp_call_jaxpr', 'custom_lin',
})  # fmt: skip
"""Call primitives whose body is evaluated in place (no types at the boundary).
``jax.checkpoint``'s primitive is ``remat2`` (jax 0.10 to 0.12)."""

NAMED_CALLS = ('pjit', 'jit')
"""Calls that name their body in the program's name stack (``jit(fn)``)."""

# Parameters holding the body of a call primitive.
_BODY_PARAMS = ('jaxpr', 'call_jaxpr', 'fun_jaxpr')


class UnknownParameters(Exception):
  """A primitive's parameters are not those of any jax release read here."""


def inlined_body(eqn: Any) -> tuple[jex.Jaxpr, tuple[Any, ...]] | None:
  """``(body, consts)`` of a call evaluated in place; None for any other
  equation (or a call without a body parameter, e.g. ``custom_lin``)."""
  if eqn.primitive.name not in INLINED_CALLS:
    return None
  inner = next((eqn.params[k] for k in _BODY_PARAMS if k in eqn.params), None)
  if inner is None:
    return None
  if isinstance(inner, jex.ClosedJaxpr):
    return inner.jaxpr, tuple(inner.consts)
  return inner, ()


def scan_parts(params: dict[str, Any]) -> tuple[jex.ClosedJaxpr, int, int]:
  """A scan's body, closed, with its numbers of constants and of carries.

  Raises:
    UnknownParameters: the parameters are neither jax 0.12's (``ft_in``) nor
      earlier releases' (``num_consts`` / ``num_carry``).
  """
  body = params['jaxpr']
  if not isinstance(body, jex.ClosedJaxpr):
    body = jex.ClosedJaxpr(body, ())
  if 'num_consts' in params:
    return body, int(params['num_consts']), int(params['num_carry'])
  if 'ft_in' in params:
    consts, carry, _ = params['ft_in'].unpack()
    return body, len(list(consts.vals)), len(list(carry.vals))
  raise UnknownParameters(f'scan parameters {sorted(params)} are not known')


def sub_jaxprs(eqn: Any) -> list[tuple[Any, str]]:
  """``(jaxpr, how its inputs map)`` for every sub-program of an equation:
  ``'scan'``, ``'while'`` (its body; the condition is left out: tiny, and its
  outputs are not the loop's), ``'cond'``, ``'local'`` (a ``shard_map``
  body, on per-device shapes) or ``'call'``."""
  name = eqn.primitive.name
  found = []
  for key, value in eqn.params.items():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      inner = getattr(v, 'jaxpr', v)
      if not isinstance(inner, jex.Jaxpr) or key == 'cond_jaxpr':
        continue
      how = {'scan': 'scan', 'while': 'while', 'cond': 'cond'}.get(name, 'call')
      found.append((inner, 'local' if name == 'shard_map' else how))
  return found


def operand_offset(eqn: Any) -> int:
  """The position of the equation's operand that is its sub-programs' first
  input: a while's body skips its condition's constants, a cond's branches
  its index."""
  if eqn.primitive.name == 'while':
    return int(eqn.params.get('cond_nconsts', 0))
  return 1 if eqn.primitive.name == 'cond' else 0
