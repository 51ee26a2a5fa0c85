"""XLA's layouts under Auto axes of chosen values inside a step.

The step's program (its jaxpr, traced for Auto axes) is evaluated again,
equation by equation, in a new trace that returns the chosen equations'
results as extra outputs; a value inside a ``scan`` comes back stacked over
its iterations. Compiled, the program's output shardings are how XLA lays
each value out when the step runs on Auto axes: the layout a fix for
Explicit axes keeps. Calls (``jit``, ``custom_jvp``/``custom_vjp``,
``remat``) are inlined; ``scan``, ``while`` and ``cond`` are rebuilt around
their replayed bodies (values inside ``while`` and ``cond`` bodies cannot be
returned, and keep no layout).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from flax_shardmeta._programs.jaxprs import inlined_body, scan_parts


class Replay:
  """Evaluates jaxprs inside a new trace, returning chosen results too.

  Args:
    export: equations (``id``) whose first result to return as extra outputs.
  """

  def __init__(self, export: frozenset[int]):
    self.export = export
    self._exported: list[dict[int, tuple[Any, int]]] = [{}]

  def function(self, closed: Any) -> Callable[..., list[Any]]:
    """A function of the jaxpr's inputs evaluating ``closed`` by replay: it
    returns ``(outputs, {eqn id: value})``."""

    def run(*args: Any) -> Any:
      self._exported = [{}]
      outs = self.run(closed.jaxpr, closed.consts, args)
      return outs, {k: v for k, (v, _) in self._exported[0].items()}

    return run

  def export_depths(self) -> dict[int, int]:
    """Per exported equation, the number of scans its value is stacked over."""
    return {k: d for k, (_, d) in self._exported[0].items()}

  def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
      # A literal keeps the type it was traced with (Auto axes): rebuild it.
      return np.asarray(v.val) if isinstance(v, jcore.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
      outs = self._apply(eqn, [read(v) for v in eqn.invars])
      if not eqn.primitive.multiple_results:
        outs = [outs]
      if id(eqn) in self.export and outs:
        self._exported[-1][id(eqn)] = (outs[0], 0)
      for v, o in zip(eqn.outvars, outs):
        if not isinstance(v, jcore.DropVar):
          env[v] = o
    return [read(v) for v in jaxpr.outvars]

  def _apply(self, eqn: Any, invals: list[Any]) -> Any:
    name, params = eqn.primitive.name, eqn.params
    inlined = inlined_body(eqn)
    if inlined is not None:
      outs = self.run(*inlined, invals)
      return outs if eqn.primitive.multiple_results else outs[0]
    if name == 'scan':
      return self._scan(eqn, invals)
    if name == 'while':
      return self._while(eqn, invals)
    if name == 'cond':
      return self._cond(eqn, invals)
    return eqn.primitive.bind(*invals, **params)

  def _scan(self, eqn: Any, invals: list[Any]) -> Any:
    p = eqn.params
    # The scan's parameters differ between jax releases: read them in one place.
    body, nc, nk = scan_parts(p)
    consts, init, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]
    exported: list[tuple[int, int]] = []  # (eqn id, scans inside this one)

    def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
      self._exported.append({})
      try:
        outs = self.run(body.jaxpr, body.consts, [*consts, *carry, *x])
      finally:
        inner = self._exported.pop()
      exported[:] = [(k, d) for k, (_, d) in inner.items()]
      return outs[:nk], [*outs[nk:], *(v for v, _ in inner.values())]

    carry, ys = jax.lax.scan(
      step, list(init), list(xs), length=p['length'], reverse=p['reverse'],
      unroll=p['unroll'],
    )  # fmt: skip
    n_ys = len(eqn.outvars) - nk
    for (k, d), v in zip(exported, ys[n_ys:]):
      self._exported[-1][k] = (v, d + 1)
    return [*carry, *ys[:n_ys]]

  def _while(self, eqn: Any, invals: list[Any]) -> Any:
    p = eqn.params
    cn, bn = p['cond_nconsts'], p['body_nconsts']
    cconsts, bconsts, init = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
    cond, body = p['cond_jaxpr'], p['body_jaxpr']

    def keep(carry: list[Any]) -> Any:
      return self.run(cond.jaxpr, cond.consts, [*cconsts, *carry])[0]

    def step(carry: list[Any]) -> list[Any]:
      return self.run(body.jaxpr, body.consts, [*bconsts, *carry])

    return jax.lax.while_loop(keep, step, list(init))

  def _cond(self, eqn: Any, invals: list[Any]) -> Any:
    index, ops = invals[0], invals[1:]
    branches = [
      (lambda *xs, b=b: self.run(b.jaxpr, b.consts, xs)) for b in eqn.params['branches']
    ]
    return jax.lax.switch(index, branches, *ops)


def equations(
  jaxpr: Any, frame_of: Callable[[Any], Any], outer: Any = None
) -> Iterator[Any]:
  """``(equation, frame)`` for every equation of ``jaxpr`` and of the jaxprs
  inside it, in the order tracing made them (a call's body where the call
  is); ``frame`` is ``frame_of(equation)``, else the enclosing call's (a
  jitted jnp function's body may keep no frame of the user's)."""
  for eqn in jaxpr.eqns:
    frame = frame_of(eqn) or outer
    for value in eqn.params.values():
      for sub in value if isinstance(value, tuple) else (value,):
        inner = getattr(sub, 'jaxpr', sub)
        if hasattr(inner, 'eqns'):
          yield from equations(inner, frame_of, frame)
    yield eqn, frame
