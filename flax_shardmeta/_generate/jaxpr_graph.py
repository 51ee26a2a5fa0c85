"""An init's jaxpr as one flat graph of nodes, nested calls inlined.

Generating a parameter window by window (:mod:`flax_shardmeta._generate.windowed`)
follows it back through the operations that compute it. Here the jaxpr of an
init becomes a list of nodes, one per primitive application, with the bodies
of calls (``jit``, custom derivatives, remat: ``_programs.jaxprs`` says which)
inlined, so that the path from the random key to each parameter is one list;
scans stay nodes, their bodies read by :func:`scan_parts`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.extend.core as jex

from flax_shardmeta._generate.loops import Unsupported
from flax_shardmeta._programs import jaxprs
from flax_shardmeta._programs.jaxprs import inlined_body


@dataclasses.dataclass
class Node:
  """One primitive application (or an input, or a constant) of the graph."""

  prim: Any  # None for inputs and constants
  inputs: list[int]
  params: dict[str, Any]
  aval: Any
  value: Any = None  # constants and literals


class Graph:
  """A jaxpr with nested calls inlined, as a flat list of nodes."""

  def __init__(self, closed: jex.ClosedJaxpr):
    self.nodes: list[Node] = []
    self.inputs = [self._add(Node(None, [], {}, v.aval)) for v in closed.jaxpr.invars]
    self.outputs = self._flatten(closed.jaxpr, closed.consts, self.inputs)

  def _add(self, node: Node) -> int:
    self.nodes.append(node)
    return len(self.nodes) - 1

  def _const(self, value: Any, aval: Any) -> int:
    return self._add(Node(None, [], {}, aval, value))

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
      inlined = inlined_body(eqn)
      if inlined is not None:
        outs = self._flatten(*inlined, args)
      else:
        outs = []
        for i, v in enumerate(eqn.outvars):
          node = Node(eqn.primitive, args, dict(eqn.params), v.aval)
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


def scan_parts(params: dict[str, Any]) -> tuple[jex.ClosedJaxpr, int, int]:
  """A scan's body, closed, with its numbers of constants and of carries
  (:func:`flax_shardmeta._programs.jaxprs.scan_parts`); parameters of no
  known jax release are Unsupported (the output is then generated whole),
  which tests/test_bit_identity.py's stacked layers notice."""
  try:
    return jaxprs.scan_parts(params)
  except jaxprs.UnknownParameters as e:
    raise Unsupported(str(e)) from None


def bind(node: Node, args: list[Any], drop_sharding: bool = False) -> Any:
  """Applies ``node``'s primitive to ``args`` (without its layout when
  ``drop_sharding``: a full-shape layout does not fit a window)."""
  params = {k: v for k, v in node.params.items() if k != '_index'}
  if drop_sharding and params.get('sharding') is not None:
    params['sharding'] = None  # the full-shape layout does not fit a window
  out = node.prim.bind(*args, **params)
  return out[node.params['_index']] if node.prim.multiple_results else out
