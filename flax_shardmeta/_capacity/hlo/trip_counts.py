"""How many times one step runs each computation of a compiled program.

``cost_analysis()`` counts a loop body once, whatever its trip count, so a
scanned 32-layer model looks like a one-layer one. Each ``while`` loop's trip
count is read from what XLA recorded, else from its condition (``i < N``
with ``i`` counting from a constant), and every computation is weighed by the
product of the trip counts of the loops around it.
"""

from __future__ import annotations

from collections.abc import Iterator

from flax_shardmeta._programs.hlo_text import Computation, Instruction, entry

_FLIPPED = {'GT': 'LT', 'GE': 'LE', 'LT': 'GT', 'LE': 'GE'}


def trip_count(
  loop: Instruction, caller: Computation, computations: dict[str, Computation]
) -> int | None:
  """How many times a ``while`` runs its body, or None when it cannot be told.

  Reads XLA's ``known_trip_count`` where the compiler recorded it, else the
  loop condition ``i < N`` (``N`` a constant) with ``i`` starting from a
  constant in the loop's initial tuple and growing by a constant step in the
  body: the form ``lax.scan`` and ``fori_loop`` compile to, also after XLA
  unrolls a loop (its counter then grows by 2).
  """
  known = loop.known_trip_count()
  if known is not None:
    return known
  called = dict(loop.called())
  cond = computations.get(called.get('condition', ''))
  if cond is None or not cond.instructions:
    return None
  by_name = {i.name: i for i in cond.instructions}
  root = cond.instructions[-1]
  if root.opcode != 'compare' or len(root.operands) != 2:
    return None
  op = root.attribute('direction')
  lhs, rhs = (by_name.get(o) for o in root.operands)
  if lhs is None or rhs is None or op is None:
    return None
  if lhs.opcode == 'constant' and rhs.opcode == 'get-tuple-element':
    lhs, rhs, op = rhs, lhs, _FLIPPED.get(op, op)
  if lhs.opcode != 'get-tuple-element' or rhs.opcode != 'constant':
    return None
  limit = rhs.integer_constant()
  counter = lhs.int_attribute('index')
  if limit is None or counter is None or op not in ('LT', 'LE'):
    return None
  start = _initial_value(loop, counter, caller)
  step = _step(computations.get(called.get('body', '')), counter)
  if step is None or step <= 0:
    return None
  span = limit - start + (1 if op == 'LE' else 0)
  return max(-(-span // step), 0)


def _through_copies(
  inst: Instruction | None, by_name: dict[str, Instruction]
) -> Instruction | None:
  while inst is not None and inst.opcode in ('copy', 'bitcast') and inst.operands:
    inst = by_name.get(inst.operands[0])
  return inst


def _step(body: Computation | None, counter: int) -> int | None:
  """How much the loop body adds to its counter (XLA unrolls by 2 and adds 2)."""
  if body is None or not body.instructions:
    return None
  by_name = {i.name: i for i in body.instructions}
  root = body.instructions[-1]
  if root.opcode != 'tuple' or counter >= len(root.operands):
    return None
  update = _through_copies(by_name.get(root.operands[counter]), by_name)
  if update is None or update.opcode != 'add' or len(update.operands) != 2:
    return None
  steps = [by_name[o].integer_constant() for o in update.operands if o in by_name]
  steps = [v for v in steps if v is not None]
  return steps[0] if len(steps) == 1 else None


def _initial_value(loop: Instruction, index: int, caller: Computation) -> int:
  """The loop counter's start: element ``index`` of the loop's initial tuple."""
  by_name = {i.name: i for i in caller.instructions}
  init = by_name.get(loop.operands[0]) if loop.operands else None
  if init is None or init.opcode != 'tuple' or index >= len(init.operands):
    return 0
  value = _through_copies(by_name.get(init.operands[index]), by_name)
  start = value.integer_constant() if value is not None else None
  return 0 if start is None else start


def multiplicities(
  computations: dict[str, Computation],
) -> tuple[dict[str, int], list[tuple[str, int | None]]]:
  """How many times one step runs each computation, and each loop's trips.

  A loop whose trip count cannot be told counts once (listed with None).
  """
  main = entry(computations)
  if main is None:
    return {}, []
  times: dict[str, int] = {main.name: 1}
  loops: list[tuple[str, int | None]] = []
  for name in _topological(computations, main.name):
    comp = computations[name]
    here = times.get(name, 0)
    for inst in comp.instructions:
      for role, callee in inst.called():
        if callee not in computations:
          continue
        factor = 1
        if inst.opcode == 'while' and role in ('body', 'condition'):
          n = trip_count(inst, comp, computations)
          if role == 'body':
            loops.append((inst.name, n))
          factor = 1 if n is None else n
        times[callee] = times.get(callee, 0) + here * factor
  return times, loops


def _topological(computations: dict[str, Computation], root: str) -> list[str]:
  """Callers before callees, from ``root``."""
  seen: set[str] = {root}
  post: list[str] = []
  stack: list[tuple[str, Iterator[str]]] = [(root, iter(_callees(computations[root])))]
  while stack:
    node, it = stack[-1]
    nxt = next(it, None)
    if nxt is None:
      post.append(node)
      stack.pop()
    elif nxt in computations and nxt not in seen:
      seen.add(nxt)
      stack.append((nxt, iter(_callees(computations[nxt]))))
  return post[::-1]


def _callees(comp: Computation) -> list[str]:
  return [callee for inst in comp.instructions for _, callee in inst.called()]
