"""What each value alive at a step's peak is: its kind told by where the
value comes from and where it goes (why's data flow), what and where by the
operation that made its contents, through XLA's copies and casts and, for a
scan's stacked buffers, into the loop body that writes them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from flax_shardmeta._capacity import vocabulary as vocab
from flax_shardmeta._capacity.hlo.attribution import Attributor
from flax_shardmeta._capacity.hlo.trip_counts import trip_count
from flax_shardmeta._capacity.peak.rows import PeakRow
from flax_shardmeta._frames import NO_USER_LINE
from flax_shardmeta._programs.buffers import Value
from flax_shardmeta._programs.hlo_text import (
  Computation,
  Instruction,
  array_shapes,
  largest_array_bytes,
)
from flax_shardmeta._programs.name_stacks import primitive_of, scope_of

COLLECTIVES = frozenset(
  (
    'all-reduce',
    'all-gather',
    'reduce-scatter',
    'all-to-all',
    'ragged-all-to-all',
    'collective-permute',
    'collective-broadcast',
  )
)
_WORKSPACE = ('s8[', 'u8[')
# Operations that only move or cast a value: its contents are their operand's.
# What passes a value on unchanged but for its type or shape, inside a kernel.
_PASSES = frozenset({'bitcast', 'reshape', 'copy', 'convert', 'reduce-precision'})
_MOVES = frozenset(
  ('copy', 'bitcast', 'reshape', 'convert', 'copy-start', 'copy-done', 'transpose')
)
_BACKWARD = 'transpose('
# The kinds of rows a routing line's role is told for (not a parameter's).
# (A collective's is its attribution's: one of tokens, not a parameter's.)
_ROUTED = frozenset({'activation', 'backward', 'offload'})
_ON_HOST = 'S(5)'  # XLA's memory space of host memory, in a layout


class ValueReader:
  """Tells what each value at the peak is, from the program's data flow."""

  def __init__(self, attributor: Attributor):
    self.why = attributor
    self.flow = attributor.flow
    self.where: dict[str, tuple[Computation, Instruction]] = {}
    for comp in attributor.computations.values():
      for inst in comp.instructions:
        self.where.setdefault(inst.name, (comp, inst))

  def row(self, value: Value, size: int) -> PeakRow:
    """The row of ``size`` bytes of ``value``: its kind told by where the
    value comes from and goes (the data flow), what and where by the
    operation that made its contents (through copies, and for a scan's
    stacked buffers, the loop body's update); a token or mask of a
    mixture-of-experts layer with its routing role."""
    row = self._row(value, size)
    if row.kind not in _ROUTED or not row.where or self.why.lines is None:
      return row
    lines = self.why.lines
    role = lines.routing.get(row.where, '')
    role = role or ('mask' if row.where in lines.routing_masks else '')
    return dataclasses.replace(row, role=role) if role else row

  def _row(self, value: Value, size: int) -> PeakRow:
    found = self.where.get(value.name)
    if found is None:
      return PeakRow('temporary', '', '', size, shape=value.shape)
    comp, inst = found
    index = tuple(int(i) for i in value.index.strip('{}').split(',') if i)
    base = inst.opcode.removesuffix('-start').removesuffix('-done')
    if base in COLLECTIVES:
      return self._collective(comp, inst, base, index, size, value.shape)
    hosted = self._offload(comp, inst, index, value, size)
    if hosted is not None:
      return hosted
    made_in, made, layers = self._maker(comp, inst, index, value.shape)
    layers = layers or self._stacked_in(comp, value.shape)
    line_of = made
    if made.opcode == 'parameter':  # a layer's input: at the scan's line
      caller = self.flow.caller(made_in)
      made_in, line_of = caller if caller is not None else (made_in, made)
    op = made.op_name() or line_of.op_name()
    row = PeakRow(
      'activation',
      _operation(made.op_name(), made),
      self._line(made_in, line_of),
      size,
      scope_of(op),
      layers,
      value.shape,
    )
    if inst.opcode == 'custom-call' and index and value.shape.startswith(_WORKSPACE):
      target = (inst.attribute('custom_call_target') or 'a library call').strip('"')
      return dataclasses.replace(row, kind='workspace', what=f'scratch of {target}')
    leaf = self.why.leaf(self.flow.origin(comp, inst.name)) if not index else None
    if leaf is not None:
      kind = 'parameter copy' if leaf[1] == vocab.PARAMETERS else 'input copy'
      return dataclasses.replace(row, kind=kind, what=leaf[0])
    updated = list(self.why.updated(self.flow.reach(comp, inst.name, index).outputs))
    backward = _BACKWARD in op
    if updated:
      more = f' (+{len(updated) - 1} more)' if len(updated) > 1 else ''
      kind = 'gradient' if backward else 'optimizer update'
      return dataclasses.replace(row, kind=kind, what=updated[0] + more)
    if backward:
      return dataclasses.replace(row, kind='backward')
    named = self._checkpoint(row.where, value.shape, layers)
    return dataclasses.replace(row, checkpoint=named)

  def _offload(
    self,
    comp: Computation,
    inst: Instruction,
    index: tuple[int, ...],
    value: Value,
    size: int,
  ) -> PeakRow | None:
    """A chip's buffer of a copy between host and chip memory: a value
    coming in from host memory (an argument laid out there, by its path; an
    offloaded activation, by its checkpoint name) or one waiting to go out
    to it. None for any other value."""
    by_name = self.flow.by_name[comp.name]
    source = None
    if inst.opcode in ('copy-start', 'copy-done') and index in ((), (0,)):
      start = inst
      if inst.opcode == 'copy-done' and inst.operands:
        start = by_name.get(inst.operands[0], inst)
      source = by_name.get(start.operands[0]) if start.operands else None
    if source is not None and _ON_HOST in source.shape:
      leaf = self.why.leaf(self.flow.origin(comp, source.name))
      if leaf is not None:
        return PeakRow('offload', leaf[0], '', size, shape=value.shape)
      row = self.row(Value(source.name, '', size, 0, value.shape, 0), size)
      named = row.checkpoint or self._checkpoint(row.where, value.shape, row.layers)
      what = f'{row.what} (in from host memory)'
      return dataclasses.replace(row, kind='offload', what=what, checkpoint=named)
    going = [
      u
      for u in self.flow.users[comp.name].get(inst.name, [])
      if u.opcode == 'copy-start' and _ON_HOST in u.shape.split(',')[0]
    ]
    if going and not index:
      made_in, made, layers = self._maker(comp, inst, index, value.shape)
      where = self._line(made_in, made)
      return PeakRow(
        'offload',
        f'{_operation(made.op_name(), made)} (out to host memory)',
        where,
        size,
        scope_of(made.op_name()),
        layers,
        value.shape,
        checkpoint=self._checkpoint(where, value.shape, layers),
      )
    return None

  def _checkpoint(self, line: str, shape: str, layers: int) -> str:
    """The ``checkpoint_name`` given to a value made at ``line`` whose
    shape a chip's ``shape`` (a scan's ``layers`` stacked) is a shard of;
    names given to values of other shapes there are not this one's."""
    traced = self.why.lines
    names = traced.checkpoints.get(line, ()) if traced is not None and line else ()
    arrays = array_shapes(shape)
    if not names or traced is None or len(arrays) != 1:
      return ''
    dims = (
      arrays[0][1][1:] if layers and arrays[0][1][:1] == (layers,) else arrays[0][1]
    )
    return ', '.join(
      n
      for n in names
      if any(_shard_of(dims, s) for s in traced.checkpoint_shapes.get(n, ()))
    )

  def _maker(
    self, comp: Computation, inst: Instruction, index: tuple[int, ...], shape: str
  ) -> tuple[Computation, Instruction, int]:
    """The operation that made a value's contents, and over how many layers
    a scan stacked them (0: none): through copies, casts and tuples, into a
    loop's body for its carried buffers, from a loop's initial buffer (zeros
    XLA broadcast) to what the body writes there."""
    layers = 0
    seen: set[tuple[str, str, tuple[int, ...]]] = set()
    named: tuple[Computation, Instruction] | None = None  # the first jax named
    stacking = False  # passed a scan's update of a stacked buffer
    for _ in range(32):
      if (comp.name, inst.name, index) in seen:
        break
      seen.add((comp.name, inst.name, index))
      by_name = self.flow.by_name[comp.name]
      op = inst.op_name()
      if named is None and _jax_name(op):
        named = comp, inst
      if inst.opcode == 'parameter' and index and stacking:
        break  # a scan stacks its carry: each layer's input
      if inst.opcode == 'parameter' and index:
        caller = self.flow.caller(comp)  # a loop body's carry: its initial value
        if caller is None or caller[1].opcode != 'while' or not caller[1].operands:
          break
        comp, loop = caller
        init = self.flow.by_name[comp.name].get(loop.operands[0])
        if init is None:
          break
        inst = init
        continue
      if inst.opcode == 'while' and index:
        n = trip_count(inst, comp, self.why.computations)
        layers = n if n and _leading(shape) == n else layers
        inner = self._carried(comp, inst, index[0])
        if inner is None:  # the body passes it through: its initial value
          init = by_name.get(inst.operands[0]) if inst.operands else None
          if init is None:
            break
          inst = init
          continue
        (comp, inst), index = inner, ()
        continue
      step = None
      loop = self._loop_fed(comp, inst, index)
      if loop is not None:  # zeros a scan fills: what its body writes there
        inst, index = loop
        continue
      if inst.opcode == 'get-tuple-element' and inst.operands:
        step, k = by_name.get(inst.operands[0]), inst.int_attribute('index')
        index = (k,) if k is not None else ()
      elif inst.opcode == 'tuple' and index and index[0] < len(inst.operands):
        step, index = by_name.get(inst.operands[index[0]]), index[1:]
      elif _updates_in_place(inst, op) and len(inst.operands) > 1:
        stacking = True
        inside = self._written_inside(inst)
        if inside is not None:  # a kernel that makes what it writes
          comp, inst = inside
          break
        step = self._written(comp, inst)
      elif _jax_name(op) and inst.opcode not in _MOVES:
        break
      elif inst.opcode in _MOVES and inst.operands:
        step = by_name.get(inst.operands[0])
      elif inst.operands and not _jax_name(op):
        step = by_name.get(inst.operands[0])
      if step is None:
        break
      inst = step
    if (
      not _jax_name(inst.op_name()) and named is not None and inst.opcode != 'parameter'
    ):
      comp, inst = named  # the walk lost the contents: the nearest jax name
    return comp, inst, layers

  def _written_inside(
    self, inst: Instruction
  ) -> tuple[Computation, Instruction] | None:
    """A kernel (fusion) that writes a slice in place and makes that slice
    itself (a matmul stacked per layer by its scan): the instruction inside
    that makes it, through casts and reshapes; None where the slice is one of
    the kernel's operands, or ``inst`` is no kernel."""
    inner, written = self._update_of(inst)
    if inner is None or written is None or written.opcode == 'parameter':
      return None
    return inner, written

  def _written(self, comp: Computation, inst: Instruction) -> Instruction | None:
    """The operand whose contents ``inst`` writes in place: the one its
    kernel writes, else the largest update operand."""
    by_name = self.flow.by_name[comp.name]
    _, written = self._update_of(inst)
    k = written.parameter_number() if written is not None else None
    if k is not None and k < len(inst.operands):
      return by_name.get(inst.operands[k])
    return _largest(comp, inst.operands[1:], by_name)

  def _update_of(
    self, inst: Instruction
  ) -> tuple[Computation | None, Instruction | None]:
    """Inside a fusion that updates a slice in place: its computation and
    what makes the update (through casts and reshapes)."""
    callee = next((c for r, c in inst.called() if r == 'calls'), None)
    inner = self.why.computations.get(callee or '') if inst.opcode == 'fusion' else None
    if inner is None:
      return None, None
    by_name = self.flow.by_name[inner.name]
    dus = next(
      (i for i in inner.instructions if i.opcode == 'dynamic-update-slice'), None
    )
    written = by_name.get(dus.operands[1]) if dus and len(dus.operands) > 1 else None
    while written is not None and written.opcode in _PASSES and written.operands:
      written = by_name.get(written.operands[0])
    return inner, written

  def _stacked_in(self, comp: Computation, shape: str) -> int:
    """A value a loop body holds with one slot per trip (a scan's stacked
    buffer, updated in place): the trip count; else 0."""
    caller = self.flow.caller(comp)
    if caller is None or caller[1].opcode != 'while':
      return 0
    n = trip_count(caller[1], caller[0], self.why.computations)
    return n if n and _leading(shape) == n else 0

  def _loop_fed(
    self, comp: Computation, inst: Instruction, index: tuple[int, ...] = ()
  ) -> tuple[Instruction, tuple[int, ...]] | None:
    """The loop whose initial carry ``inst`` is and whose body writes that
    element (the zeros a scan then fills with a value per layer), and the
    element: ``(while, (k,))``; None for a value the loop only reads."""
    users = self.flow.users[comp.name]
    at = [inst]
    if index:  # an element of a tuple-shaped result: where it is taken out
      at = [
        u
        for u in users.get(inst.name, [])
        if u.opcode == 'get-tuple-element' and u.int_attribute('index') == index[0]
      ]
    for _ in range(4):  # through the copies XLA puts before the loop
      moved = [u for i in at for u in users.get(i.name, []) if u.opcode in _MOVES]
      for i in at:
        for user in users.get(i.name, []):
          if user.opcode != 'tuple':
            continue
          for loop in users.get(user.name, []):
            k = user.operands.index(i.name)
            if loop.opcode == 'while' and self._carried(comp, loop, k) is not None:
              return loop, (k,)
      at = moved
    return None

  def _collective(
    self,
    comp: Computation,
    inst: Instruction,
    base: str,
    index: tuple[int, ...],
    size: int,
    shape: str,
  ) -> PeakRow:
    start = inst
    if inst.opcode.endswith('-done') and inst.operands:
      start = self.flow.by_name[comp.name].get(inst.operands[0], inst)
    operand = index[0] if index and len(start.operands) > 1 else 0
    a = self.why.attribute(start, comp, base, operand)
    told = a.reason + (f' of {", ".join(a.parameters[:2])}' if a.parameters else '')
    where = a.source if a.source != NO_USER_LINE else ''
    scope = a.scope or scope_of(inst.op_name())
    what = f'{base}: {told}'
    role = a.change.split(';')[0] if a.reason == 'routing' else ''
    return PeakRow('collective', what, where, size, scope, shape=shape, role=role)

  def _line(self, comp: Computation, inst: Instruction) -> str:
    line = self.why.line(inst, comp)
    return '' if line == NO_USER_LINE else line

  def _carried(
    self, comp: Computation, loop: Instruction, k: int
  ) -> tuple[Computation, Instruction] | None:
    """What a loop's body makes element ``k`` of its carry; None where the
    body passes the element through unchanged (a scan's stacked residuals,
    read by the backward loop)."""
    body_name = loop.attribute('body')
    body = self.why.computations.get((body_name or '').lstrip('%'))
    if body is None or not body.instructions:
      return None
    root = body.instructions[-1]
    if root.opcode != 'tuple' or k >= len(root.operands):
      return None
    by_name = self.flow.by_name[body.name]
    inst = by_name.get(root.operands[k])
    for _ in range(8):  # through the copies around it
      if inst is None or inst.opcode not in ('copy', 'bitcast'):
        break
      inst = by_name.get(inst.operands[0]) if inst.operands else None
    if inst is None:
      return None
    if inst.opcode == 'get-tuple-element' and inst.int_attribute('index') == k:
      source = by_name.get(inst.operands[0]) if inst.operands else None
      if source is not None and source.opcode == 'parameter':
        return None
    return body, inst

  def peak(self, name: str) -> tuple[str, str]:
    """The phase of the step the operation ``name`` runs in, and it with
    its line and scope."""
    found = self.where.get(name)
    if found is None:
      return '', name
    comp, inst = found
    op = inst.op_name()
    if _BACKWARD in op:
      phase = 'backward'
    elif 'jvp(' in op or not op:
      phase = 'forward'
    else:
      reach = self.flow.reach(comp, inst.name)
      phase = 'optimizer update' if self.why.updated(reach.outputs) else 'forward'
    line, scope = self._line(comp, inst), scope_of(op)
    told = ', '.join(x for x in (line, scope) if x)
    return phase, f'{name} ({told})' if told else name


def _operation(op: str, inst: Instruction) -> str:
  """What a value is, in jax's words: the primitive that made it (a scan's
  carried buffer where only the loop is named)."""
  if inst.opcode == 'while':
    return 'scan carry'
  if inst.opcode == 'parameter':
    return "a layer's input (the scan's carry)"
  return primitive_of(op) or re.sub(r'\.\d+$', '', inst.opcode)


def _largest(
  comp: Computation, names: Sequence[str], by_name: dict[str, Instruction]
) -> Instruction | None:
  """Of the instructions ``names``, the one with the largest result."""
  found = [by_name[n] for n in names if n in by_name]
  return max(found, key=lambda i: largest_array_bytes(i.shape), default=None)


def _updates_in_place(inst: Instruction, op: str) -> bool:
  """Whether ``inst`` writes a slice into its first operand (a scan stacking
  a layer's value): its contents are the update's."""
  if primitive_of(op) == 'dynamic_update_slice':
    return True
  return 'dynamic-update-slice' in inst.opcode or (
    inst.opcode == 'fusion' and 'dynamic-update-slice' in inst.name
  )


def _shard_of(dims: tuple[int, ...], whole: tuple[int, ...]) -> bool:
  """Whether an array of ``dims`` can be a shard of one of ``whole``."""
  return len(dims) == len(whole) and all(w % d == 0 for d, w in zip(dims, whole) if d)


def _jax_name(op: str) -> bool:
  """Whether an ``op_name`` is jax's name stack (``jit(step)/...``), not a
  name XLA gave an instruction it made (``broadcast.78``)."""
  return '/' in op


def _leading(shape: str) -> int | None:
  m = re.match(r'^\w+\[(\d+)[,\]]', shape)
  return int(m.group(1)) if m else None
