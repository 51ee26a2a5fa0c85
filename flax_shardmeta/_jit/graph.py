"""``fsm.jit`` on NNX graph nodes: modules and optimizers passed as arguments.

``jax.jit`` takes pytrees, while an ``nnx.Module`` or ``nnx.Optimizer`` is a
graph of Variables updated in place. As ``nnx.jit`` does, the graph nodes among
the positional arguments are split into one state, the function runs on their
merged copy inside the trace, and the state it leaves is written back into the
objects passed in. That state is laid out by its Variables' annotations (as
``fsm.get_sharding`` lays out ``nnx.state(...)``), going in and coming out, so a
training step keeps the planned layout step after step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax

from flax_shardmeta._errors import NnxJitError
from flax_shardmeta._sharding import get_sharding
from flax_shardmeta._typing import AnyMesh


def _is_node(x: Any) -> bool:
  """An NNX graph node other than a Variable (a module, an optimizer...).

  Variables are graph nodes too, but also pytrees holding one value: in a
  ``nnx.State`` or alone, jax.jit takes them as it takes any pytree.
  """
  nnx = sys.modules.get('flax.nnx')
  return (
    nnx is not None and nnx.graph.is_graph_node(x) and not isinstance(x, nnx.Variable)
  )


def graph_positions(args: Sequence[Any]) -> tuple[int, ...]:
  """The positions of ``args`` holding NNX graph nodes (modules, optimizers)."""
  if 'flax.nnx' not in sys.modules:  # no graph node exists before flax.nnx
    return ()
  return tuple(i for i, a in enumerate(args) if _is_node(a))


def check_no_nested_nodes(
  args: Sequence[Any], kwargs: dict[str, Any], *, top_level: bool = True
) -> None:
  """Graph nodes are taken as top-level positional arguments only (called
  while tracing, so once per compilation; ``top_level=False``: none at all,
  the arguments being those of a call without graph nodes)."""
  if 'flax.nnx' not in sys.modules:
    return
  for where, value in [*((f'argument {i}', a) for i, a in enumerate(args))] + [
    (f'keyword argument {k!r}', v) for k, v in kwargs.items()
  ]:
    if top_level and where.startswith('argument') and _is_node(value):
      continue
    inner = jax.tree_util.tree_leaves(value, is_leaf=_is_node)
    if any(_is_node(x) for x in inner):
      raise NnxJitError(
        f'fsm.jit got an NNX graph node inside {where}: graph nodes (modules, '
        'optimizers) are taken as positional arguments of their own, e.g. '
        'step(model, optimizer, batch).'
      )


class GraphCall:
  """One ``fsm.jit`` function called with graph nodes at ``positions``."""

  def __init__(
    self,
    fn: Callable[..., Any],
    positions: tuple[int, ...],
    mesh: AnyMesh,
    rules: tuple[tuple[str, Any], ...],
    in_shardings: Any,
    out_shardings: Any,
    jit_kwargs: dict[str, Any],
  ):
    self.fn, self.positions, self.mesh, self.rules = fn, positions, mesh, rules
    self.ins, self.outs, self.jit_kwargs = in_shardings, out_shardings, jit_kwargs
    self._jits: dict[Any, Any] = {}

  def run(self, method: str | None, args: tuple[Any, ...], kwargs: Any) -> Any:
    from flax import nnx

    nodes = tuple(args[i] for i in self.positions)
    others = tuple(a for i, a in enumerate(args) if i not in self.positions)
    graphdef, state = nnx.split(nodes)
    jitted = self._jitted(graphdef, state, len(args))
    if method is not None:
      return getattr(jitted, method)(state, *others, **kwargs)
    new_state, out = jitted(state, *others, **kwargs)
    nnx.update(nodes, new_state)  # the updates reach the objects passed in
    return out

  def _jitted(self, graphdef: Any, state: Any, n_args: int) -> Any:
    key = (graphdef, n_args)
    if key in self._jits:
      return self._jits[key]
    from flax import nnx

    fn, positions = self.fn, self.positions

    def pure(state: Any, *others: Any, **kwargs: Any) -> Any:
      check_no_nested_nodes(others, kwargs, top_level=False)
      nodes = nnx.merge(graphdef, state)
      rest = iter(others)
      full = [
        nodes[positions.index(i)] if i in positions else next(rest)
        for i in range(n_args)
      ]
      out = fn(*full, **kwargs)
      return nnx.state(nodes), out

    # The graph state is laid out by its annotations (validated, named by
    # path): the same going in and coming out.
    state_shardings = get_sharding(state, self.mesh, self.rules)
    kwargs = dict(self.jit_kwargs)
    for what in ('static_argnums', 'donate_argnums'):
      kwargs[what] = self._renumber(kwargs.get(what), n_args, what)
    ins = self.ins
    if ins is not None:
      entries = ins if isinstance(ins, tuple) else (ins,) * n_args
      for i in positions:
        if i < len(entries) and entries[i] is not None:
          raise NnxJitError(
            f'fsm.jit got in_shardings for argument {i}, an NNX graph node: '
            "graph nodes are laid out by their Variables' annotations (as "
            'fsm.get_sharding(nnx.state(node), mesh) gives); pass None at '
            'that position.'
          )
      kwargs['in_shardings'] = (state_shardings,) + tuple(
        entries[i] if i < len(entries) else None
        for i in range(n_args)
        if i not in positions
      )
    else:
      kwargs['in_shardings'] = (state_shardings,) + (None,) * (n_args - len(positions))
    kwargs['out_shardings'] = (state_shardings, self.outs)
    self._jits[key] = jax.jit(pure, **kwargs)
    return self._jits[key]

  def _renumber(self, argnums: Any, n_args: int, what: str) -> tuple[int, ...]:
    """Argument numbers of the function -> those of the split call (the graph
    state is argument 0, the other arguments follow in order)."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums or ())
    others = [i for i in range(n_args) if i not in self.positions]
    out = set()
    for n in nums:
      n = n % n_args if n_args else n
      if n not in self.positions:
        out.add(1 + others.index(n))
      elif what == 'static_argnums':
        raise NnxJitError(
          f'fsm.jit: argument {n} is an NNX graph node and cannot be static '
          '(static_argnums); its state is an argument of the compiled step.'
        )
      else:
        out.add(0)  # donating a graph node donates the whole graph state
    return tuple(sorted(out))
