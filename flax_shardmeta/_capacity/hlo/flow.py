"""The data flow of a compiled program: where a value comes from, where it goes.

``hlo_attribution`` asks two questions of every collective's operand:

- *where does it come from?* (:meth:`Flow.origin`): the entry parameter it
  is moved or cut from, through copies, converts, slices, fused kernels that
  only move data, loop-carried tuples and async pairs; None when anything
  computes on the way;
- *where does it go?* (:meth:`Flow.reach`): the entry outputs its value
  reaches through anything but a contraction or reduction, and whether it was
  consumed by one.

A value is followed as ``(computation, instruction, index)``: the element at
tuple ``index`` of the instruction's result, so a loop carrying fifty values
passes each to its own position rather than all to all. Fused kernels,
calls, loop bodies, conditionals and async wrappers are entered at the
parameter the value feeds and left where their root returns it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from flax_shardmeta._programs.hlo_text import Computation, Instruction, entry

# Where a value stops being itself: past a contraction or a reduction (a
# norm's scale gradient sums the activations' gradients) it is another value.
STOPS = frozenset(
  (
    'dot',
    'convolution',
    'reduce',
    'reduce-window',
    'select-and-scatter',
    'custom-call',
    'rng',
    'rng-bit-generator',
    'compare',
    'is-finite',
    'sort',
  )
)
# Ops through which a value only moves (its origin is followed through them).
MOVES = frozenset(
  'bitcast copy reshape transpose convert get-tuple-element dynamic-slice slice '
  'all-gather all-gather-start all-gather-done collective-permute '
  'collective-permute-start collective-permute-done all-to-all copy-start '
  'copy-done optimization-barrier async-start async-done broadcast pad '
  'all-reduce all-reduce-start all-reduce-done bitcast-convert'.split()
)
# Operand positions that are indices or predicates, not data.
_INDEX_OPERANDS = {
  'dynamic-slice': lambda q: q >= 1,
  'dynamic-update-slice': lambda q: q >= 2,
  'gather': lambda q: q >= 1,
  'scatter': lambda q: q >= 1,  # updates are summed into the buffer
  'select': lambda q: q == 0,
  'pad': lambda q: q >= 1,
}
# Ops whose result is their tuple operand, element for element.
_PER_ELEMENT = frozenset(('copy', 'optimization-barrier', 'bitcast'))
_ENTERED = ('calls', 'body', 'true_computation', 'false_computation', 'branch')

Place = tuple[str, str, tuple[int, ...]]  # (computation, instruction, index)


@dataclasses.dataclass
class Reach:
  """Where a value goes (:meth:`Flow.reach`).

  Attributes:
    outputs: positions of the entry's result tuple the value reaches.
    consumed: whether a contraction, reduction or comparison used it.
    complete: False when the walk was cut short (a very large program).
  """

  outputs: set[int] = dataclasses.field(default_factory=set)
  consumed: bool = False
  complete: bool = True


class Flow:
  """The users, callers and parameters of a parsed program, for following
  values through it.

  Example:
    >>> from flax_shardmeta._programs.hlo_text import parse
    >>> flow = Flow(parse('''
    ... ENTRY %main (p: f32[4], q: f32[4]) -> (f32[4], f32[]) {
    ...   %p = f32[4]{0} parameter(0)
    ...   %q = f32[4]{0} parameter(1)
    ...   %c = f32[4]{0} convert(%p)
    ...   %s = f32[4]{0} add(%c, %q)
    ...   %z = f32[] constant(0)
    ...   %r = f32[] reduce(%q, %z), dimensions={0}, to_apply=%add
    ...   ROOT %t = (f32[4]{0}, f32[]) tuple(%s, %r)
    ... }'''))
    >>> main = flow.entry
    >>> flow.origin(main, 'c'), sorted(flow.reach(main, 's').outputs)
    (0, [0])
    >>> reach = flow.reach(main, 'q')
    >>> sorted(reach.outputs), reach.consumed
    ([0], True)
  """

  def __init__(self, computations: dict[str, Computation], budget: int = 200_000):
    self.computations = computations
    self.entry = entry(computations)
    self.budget = budget
    self.by_name = {
      c.name: {i.name: i for i in c.instructions} for c in computations.values()
    }
    self.users: dict[str, dict[str, list[Instruction]]] = {}
    # callee -> every (computation, instruction) that enters it
    self.callers: dict[str, list[tuple[Computation, Instruction]]] = {}
    self.params: dict[str, dict[int, str]] = {}
    for comp in computations.values():
      users = self.users.setdefault(comp.name, {})
      numbers = self.params.setdefault(comp.name, {})
      for inst in comp.instructions:
        for o in dict.fromkeys(inst.operands):
          users.setdefault(o, []).append(inst)
        for role, callee in inst.called():
          if role in _ENTERED:
            self.callers.setdefault(callee, []).append((comp, inst))
        number = inst.parameter_number()
        if number is not None:
          numbers[number] = inst.name

  def root(self, comp: Computation) -> Instruction | None:
    return comp.instructions[-1] if comp.instructions else None

  def caller(self, comp: Computation) -> tuple[Computation, Instruction] | None:
    """The first instruction entering ``comp`` (its enclosing scope)."""
    found = self.callers.get(comp.name)
    return found[0] if found else None

  # Where a value comes from
  # ----------------------------------------------------------------------------

  def origin(self, comp: Computation, name: str) -> int | None:
    """The entry parameter ``name``'s value is only moved or cut from."""
    return self._origin(comp, name, (), 0)

  def _origin(
    self, comp: Computation, name: str, index: tuple[int, ...], depth: int
  ) -> int | None:
    inst = self.by_name[comp.name].get(name)
    if inst is None or depth > 96:
      return None
    op = inst.opcode
    if op == 'parameter':
      number = inst.parameter_number()
      if comp is self.entry:
        return number if not index else None
      caller = self.caller(comp)
      if caller is None or number is None:
        return None
      outer, call = caller
      if call.opcode == 'while':
        at = 0
      elif call.opcode == 'conditional':
        at = 1 + next(
          (k for k, (_, c) in enumerate(call.called()) if c == comp.name), 0
        )
      else:
        at = number
      if at >= len(call.operands):
        return None
      return self._origin(outer, call.operands[at], index, depth + 1)
    if op == 'get-tuple-element':
      k = inst.int_attribute('index') or 0
      return self._origin(comp, inst.operands[0], (k, *index), depth + 1)
    if op == 'tuple':
      if not index or index[0] >= len(inst.operands):
        return None
      return self._origin(comp, inst.operands[index[0]], index[1:], depth + 1)
    if op.endswith('-done') and inst.operands:
      # An async pair (a collective, a copy, or a kernel run asynchronously,
      # as XLA's GPU compiler runs some fusions): what the start made.
      start = self.by_name[comp.name].get(inst.operands[0])
      if start is None or _callee(start) is None:
        return self._origin(comp, inst.operands[0], (), depth + 1)
      inst, op, index = start, 'fusion', ()
    if op in ('fusion', 'call') or (op.endswith('-start') and _callee(inst)):
      inner = self.computations.get(_callee(inst) or '')
      root = self.root(inner) if inner is not None else None
      if inner is None or root is None:
        return None
      return self._origin(inner, root.name, index, depth + 1)
    if op == 'while':
      # What a loop returns is what its body's last trip put there: a value
      # carried through, or a stack its trips wrote (a scan's saved slices).
      body = next((c for r, c in inst.called() if r == 'body'), None)
      inner = self.computations.get(body or '')
      root = self.root(inner) if inner is not None else None
      if inner is None or root is None or not index:
        return None
      return self._origin(inner, root.name, index, depth + 1)
    if op == 'dynamic-update-slice' and len(inst.operands) > 1:
      # A buffer written with moved values (a stack of a parameter's slices,
      # or a shard written into zeros and summed, as XLA gathers some values)
      # holds what was written.
      found = self._origin(comp, inst.operands[1], index, depth + 1)
      if found is not None:
        return found
      return self._origin(comp, inst.operands[0], index, depth + 1)
    if op not in MOVES or not inst.operands:
      return None
    if op in _PER_ELEMENT or op.endswith(('-done', '-start')):
      kept = index if op in _PER_ELEMENT else ()
      return self._origin(comp, inst.operands[0], kept, depth + 1)
    return self._origin(comp, inst.operands[0], (), depth + 1)

  # Where a value goes
  # ----------------------------------------------------------------------------

  def reach(self, comp: Computation, name: str, index: tuple[int, ...] = ()) -> Reach:
    """The entry outputs the value at ``index`` of ``name`` reaches through
    anything but a contraction or reduction, across loops, kernels and calls."""
    out = Reach()
    seen: set[Place] = set()
    todo: list[tuple[Computation, str, tuple[int, ...]]] = [(comp, name, index)]
    while todo:
      at_comp, at, where = todo.pop()
      place = (at_comp.name, at, where)
      if place in seen:
        continue
      seen.add(place)
      if len(seen) > self.budget:
        out.complete = False
        break
      if len(where) > _DEEPEST:  # a path no tuple nests this deep: a misread
        out.complete = False
        continue
      root = self.root(at_comp)
      if root is not None and root.name == at:
        todo += self._leaving(at_comp, where, out)
      for user in self.users[at_comp.name].get(at, []):
        for q, operand in enumerate(user.operands):
          if operand != at:
            continue
          todo += self._through(at_comp, user, q, where, out)
    return out

  def _through(
    self,
    comp: Computation,
    user: Instruction,
    q: int,
    index: tuple[int, ...],
    out: Reach,
  ) -> Iterator[tuple[Computation, str, tuple[int, ...]]]:
    """Where the value goes through ``user``, which takes it as operand ``q``."""
    op = user.opcode
    index_operand = _INDEX_OPERANDS.get(op)
    if op in STOPS or (index_operand is not None and index_operand(q)):
      out.consumed = True
      return
    if op in ('fusion', 'call') or (op.endswith('-start') and _callee(user)):
      inner = self.computations.get(_callee(user) or '')
      param = self.params[inner.name].get(q) if inner is not None else None
      if inner is not None and param is not None:
        yield inner, param, index  # left where its root returns it
      elif inner is None:
        yield comp, user.name, ()
      return
    if op == 'while':
      body = next((c for r, c in user.called() if r == 'body'), None)
      inner = self.computations.get(body or '')
      if inner is not None and 0 in self.params[inner.name]:
        yield inner, self.params[inner.name][0], index
      yield comp, user.name, index  # a loop that runs no trip
      return
    if op == 'conditional':
      if q == 0:
        out.consumed = True  # the branch index
        return
      branches = [c for r, c in user.called() if r in _ENTERED[3:]]
      inner = self.computations.get(branches[q - 1]) if q <= len(branches) else None
      if inner is not None and 0 in self.params[inner.name]:
        yield inner, self.params[inner.name][0], index
      return
    if op == 'get-tuple-element':
      k = user.int_attribute('index') or 0
      if not index:
        yield comp, user.name, ()
      elif index[0] == k:
        yield comp, user.name, index[1:]
      return
    if op == 'tuple':
      yield comp, user.name, (q, *index)
      return
    if op.endswith('-done'):
      start = self.by_name[comp.name].get(user.operands[0])
      combined = start is not None and len(start.operands) > 1
      yield comp, user.name, index[:1] if combined else ()
      return
    if op.endswith('-start'):
      combined = len(user.operands) > 1
      yield comp, user.name, (q,) if combined else ()
      return
    if op in _PER_ELEMENT:
      yield comp, user.name, index
      return
    if len(user.operands) > 1 and user.shape.startswith('('):
      yield comp, user.name, (q,)  # a combined collective: element for element
      return
    yield comp, user.name, ()

  def _leaving(
    self, comp: Computation, index: tuple[int, ...], out: Reach
  ) -> list[tuple[Computation, str, tuple[int, ...]]]:
    """A computation's root returns the value: to the entry's outputs, to a
    loop's next trip and result, or to the instruction that called it."""
    root = self.root(comp)
    if comp is self.entry:
      if root is not None and root.opcode == 'tuple' and index:
        out.outputs.add(index[0])
      elif root is not None and root.opcode == 'tuple':
        out.outputs.update(range(len(root.operands)))
      else:
        out.outputs.add(0)
      return []
    found = []
    for outer, call in self.callers.get(comp.name, []):
      if call.opcode == 'while':
        if 0 in self.params[comp.name]:
          found.append((comp, self.params[comp.name][0], index))
        found.append((outer, call.name, index))
      elif call.opcode.endswith('-start'):  # its done passes the result on
        found.append((outer, call.name, ()))
      else:
        found.append((outer, call.name, index))
    return found


# Tuples in compiled programs nest a few levels (a loop's state, an async
# wrapper's); an index longer than this went round a cycle it should not.
_DEEPEST = 16


def _callee(inst: Instruction) -> str | None:
  """The computation an instruction runs (a kernel, a call, an async
  wrapper's), if any."""
  return next((c for r, c in inst.called() if r == 'calls'), None)
