"""Why each collective of a compiled program is there: which parameter, which
gradient, which line of the user's code.

XLA keeps, on every instruction, the jax name stack (``op_name``: the module
scope and the primitive, ``transpose(...)`` for the backward pass) and the
user's source line (a stack frame in the module's tables). Those say *where*;
the data flow (``hlo_flow``) says *what*, for each value a collective moves
(XLA combines several reductions into one collective: each is told apart,
with its own bytes):

- a scalar (a loss, a metric, a counter, a norm) is ``'other'``;
- a value only moved or cut from a parameter argument, through copies,
  converts, kernels that only move data and loop-carried tuples, gathers
  that parameter for use (``'parameter'``, FSDP);
- a value that reaches a parameter's new value (or its optimizer state)
  without passing a contraction or reduction is that parameter's gradient
  (``'gradient'``), whatever moves, slices, loops, async pairs or permute
  rings lie between; the new values are told by the module's donated
  outputs and by the step's output tree;
- a value that reaches another output (the loss, metrics) is ``'other'``;
- a value the backward pass computes that reaches the new value of another
  argument is that argument's gradient (a step differentiating arguments
  not named ``params``);
- a collective the step's code calls itself (``ppermute``, ``psum``... in a
  ``shard_map``) is asked for by that call (``'explicit'``);
- a value consumed by the step's computation is an activation's
  (``'activation'``), asked for by a constraint when its buffers are those of
  a layout change one of the step's constraints asks for
  (``constraint_changes``), wherever XLA placed it;
- where the data flow cannot decide, ``'unknown'``.

Sources are the user's line that calls the layer: the traced step's
equations of the instruction's name stack give it (``TracedLines``), XLA's
own frames only choose among several. A gradient's is the line that first
uses its parameter. Without the trace, where XLA kept only library frames on
an instruction, those of the values it moves, their consumers and the kernel
or loop it sits in stand in; with none, ``NO_USER_LINE``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

from flax_shardmeta._capacity.hlo.flow import Flow, Reach
from flax_shardmeta._capacity.why.layout_changes import LayoutChange, asked_for
from flax_shardmeta._capacity.why.routing_lines import batched_axes, batched_gather
from flax_shardmeta._capacity.why.traced_lines import TracedLines, is_explicit
from flax_shardmeta._frames import NO_USER_LINE, import_path, is_library_file
from flax_shardmeta._programs.hlo_text import (
  Computation,
  Instruction,
  array_shapes,
  largest_array_bytes,
)
from flax_shardmeta._programs.name_stacks import primitive_of, scope_of

REASONS = (
  'parameter',
  'gradient',
  'routing',
  'activation',
  'explicit',
  'other',
  'unknown',
)
"""Why a collective runs, in the order ``why()`` lists them."""

PARAMETERS, OPTIMIZER, INPUTS = (
  'parameters',
  'optimizer state',
  'batch and other inputs',
)


@dataclasses.dataclass(frozen=True)
class Attribution:
  """Why one value a collective moves is moved (a combined collective moves
  several).

  Attributes:
    reason: one of :data:`REASONS`.
    parameters: plan paths of the parameters involved (``'parameter'`` and
      ``'gradient'``), e.g. ``('params/layers/w1',)``.
    source: the user's line, ``'pkg/model.py:22'`` (``'(no user line)'``
      when no instruction near it has one).
    scope: the module scope from the name stack, e.g. ``'Model/layers/attn'``.
    change: for ``'activation'``, how the value's layout changes; for
      ``'routing'``, the line's role (``'dispatch'``, ``'experts'``,
      ``'combine'``); for a ``'parameter'`` gathered whole over the axis of a
      dimension its use batches over (the experts of a mixture-of-experts
      layer), which: ``'batched dim 1 over expert -> whole'``.
    asked_by: ``'constraint'`` when a sharding constraint asked for it, else
      the operation that needed it (``'dot_general'``...); for
      ``'explicit'``, the collective the code calls (``'ppermute'``...).
  """

  reason: str = 'activation'
  parameters: tuple[str, ...] = ()
  source: str = ''
  scope: str = ''
  change: str = ''
  asked_by: str = ''


def plan_path(keystr: str, names: Sequence[str] = ()) -> str:
  """``"[0].params['layers']['w1']"`` -> ``'state/params/layers/w1'``: the
  leading argument index becomes the step's argument name (as in fit's and
  the plans' errors and in ``fsm.snapshot``), a box's ``.value`` is dropped.

  Example:
    >>> plan_path("[0].params['w1']", ('state', 'batch')), plan_path("[1][0].value")
    ('state/params/w1', '1/0')
  """
  parts = [
    a or b or c
    for a, b, c in re.findall(r"\.(\w+)|\['([^']*)'\]|\[(\d+)\]", keystr)
    if a != 'value'
  ]
  if keystr.startswith('[') and parts and parts[0].isdigit():
    i = int(parts[0])
    parts[0] = names[i] if i < len(names) else parts[0]
  return '/'.join(parts)


class Attributor:
  """Attributes the collectives of one parsed program, operand by operand.

  Args:
    computations: the program, from ``hlo_text.parse``.
    leaves: per entry parameter number, ``(plan path, category)`` (the
      report's row names), or None where unknown.
    frames: ``hlo_text.stack_frames`` of the program's text.
    aliases: output index -> entry parameter number (donated arguments).
    shapes: per entry parameter number, the argument's global shape.
    outputs: output index -> the entry parameter number whose new value it
      is, from the step's output tree; None when the outputs cannot be told
      (then only donated outputs are known).
    changes: the layout changes the step's constraints ask for
      (``constraint_changes.layout_changes``).
    lines: the traced step's lines (``traced_lines``), its ``uses`` per
      entry parameter number; None without the trace.
    specs: per entry parameter number, the mesh axes of each dimension of
      its layout (``((), ('expert',), (), ())``), or None where unknown.
  """

  def __init__(
    self,
    computations: dict[str, Computation],
    leaves: Sequence[tuple[str, str] | None] = (),
    frames: dict[int, list[tuple[str, int]]] | None = None,
    aliases: dict[int, int] | None = None,
    shapes: Sequence[tuple[int, ...]] = (),
    outputs: dict[int, int] | None = None,
    changes: Sequence[LayoutChange] = (),
    lines: TracedLines | None = None,
    specs: Sequence[tuple[tuple[str, ...], ...] | None] = (),
  ) -> None:
    self.computations = computations
    self.flow = Flow(computations)
    self.entry = self.flow.entry
    self.leaves = list(leaves)
    self.frames = frames or {}
    self.outputs_known = outputs is not None
    self.updates = {**(outputs or {}), **(aliases or {})}
    self.shapes = list(shapes)
    self.changes = list(changes)
    self.lines = lines
    uses = lines.uses if lines is not None else ()
    self.uses = {
      leaf[0]: line
      for leaf, line in zip(self.leaves, uses)
      if leaf is not None and line and len(uses) == len(self.leaves)
    }
    batched = lines.batched if lines is not None else ()
    self.batched_axes = batched_axes(self.leaves, batched, specs)

  def attribute(
    self,
    inst: Instruction,
    comp: Computation,
    kind: str,
    operand: int = 0,
    axes: Sequence[str] = (),
  ) -> Attribution:
    """Why operand ``operand`` of ``inst`` (a collective of ``kind``; a
    combined one carries several values) is moved."""
    named = self._named(inst, comp, operand)
    op = named.op_name() if named is not None else ''
    scope = scope_of(op)
    common = {'source': self._line(inst, comp, named, op), 'scope': scope}
    value = inst.operands[operand] if operand < len(inst.operands) else None
    dims_in, dims_out = operand_dims(inst, comp, operand)
    leaf = self.leaf(self.flow.origin(comp, value)) if value is not None else None
    if max(_bytes(comp, value, inst), 0) <= 8:
      return Attribution('other', (leaf[0],) if leaf else (), **common)
    if leaf is not None and leaf[1] == PARAMETERS:
      change = batched_gather(self.batched_axes.get(leaf[0], {}), kind, axes)
      return Attribution('parameter', (leaf[0],), change=change, **common)
    if leaf is not None and leaf[1] == OPTIMIZER:
      return Attribution('other', (leaf[0],), **common)
    lines = self.lines
    role = lines.routing_role(kind, op, common['source'], inst.opcode) if lines else ''
    if role and lines is not None:
      if inst.opcode.startswith('ragged-all-to-all'):  # at its exchange's line
        common['source'] = lines.exchange_line(role, common['source'])
      return Attribution('routing', (), change=role, asked_by=role, **common)
    reach = self._reach(inst, comp, operand)
    grads = self.updated(reach.outputs)
    if not grads and 'transpose(' in op:
      grads = self.updated(reach.outputs, INPUTS)
    if grads:
      # The line using the parameter, not the loss or the update; a
      # collective the step's code calls in its forward pass keeps its own.
      own = is_explicit(op) and 'transpose(' not in op
      used = common['source'] if own else self.uses.get(grads[0], common['source'])
      return Attribution('gradient', grads, source=used, scope=scope)
    if is_explicit(op):
      asked = primitive_of(op)
      return Attribution(
        'explicit', (), change=_change(inst, kind), asked_by=asked, **common
      )
    if reach.outputs:
      known = self.outputs_known and bool(self.leaves)
      return Attribution('other' if known else 'unknown', (), **common)
    if not reach.complete or not self.leaves:
      return Attribution('unknown', (), **common)
    change = None
    if kind != 'all-reduce' and dims_in is not None and dims_out is not None:
      change = asked_for(
        self.changes, math.prod(dims_in), math.prod(dims_out), axes, op
      )
    if change is not None:
      return Attribution(
        'activation',
        (),
        source=change.source,
        scope=scope_of(f'jit(step)/{change.scope}/sharding_constraint') or scope,
        change=_change(inst, kind),
        asked_by='constraint',
      )
    if not reach.consumed:
      return Attribution('unknown', (), **common)
    asked = primitive_of(op) if op else ''
    if asked in ('sharding_constraint', 'reshard', 'with_sharding_constraint'):
      asked = 'constraint'
    return Attribution(
      'activation', (), change=_change(inst, kind), asked_by=asked, **common
    )

  def source(self, inst: Instruction | None) -> str:
    """The user's line of ``inst``: its innermost frame outside jax, flax,
    optax and this library (``'pkg/model.py:22'``, the path under the module's
    import root); ``''`` when it has none."""
    frame = inst.frame() if inst is not None else None
    if frame is None:
      return ''
    if isinstance(frame, str):
      file, _, line = frame.rpartition(':')
      return '' if is_library_file(file) else f'{import_path(file)}:{line}'
    for file, line in self.frames.get(frame, []):
      if not is_library_file(file):
        return f'{import_path(file)}:{line}'
    return ''

  def _line(
    self, inst: Instruction, comp: Computation, named: Instruction | None, op: str
  ) -> str:
    """The user's line of ``inst``: that of the traced equations its name
    stack names; of several, the one XLA's frames (on it, then near it)
    name, else the first; without any, :meth:`_source_near`."""
    traced = self.lines.lines_of(op) if self.lines is not None else ()
    if len(traced) == 1:
      return traced[0]
    found = self._source_near(inst, comp, named, set(traced))
    return found if found in traced or not traced else traced[0]

  def _source_near(
    self,
    inst: Instruction,
    comp: Computation,
    named: Instruction | None,
    among: set[str] | None = None,
  ) -> str:
    """The user's line of ``inst``; where XLA kept only library frames, that of
    the values it moves, then of their consumers, then of the kernel or loop
    it sits in; else ``NO_USER_LINE``. With ``among``, only those lines
    count."""

    def source(i: Instruction | None) -> str:
      found = self.source(i)
      return found if not among or found in among else ''

    for candidate in (named, inst):
      found = source(candidate)
      if found:
        return found
    at: Computation | None = comp
    where = inst
    for _ in range(8):
      if at is None:
        break
      for near in self._near(at, where):
        found = source(near)
        if found:
          return found
      caller = self.flow.caller(at)
      if caller is None:
        break
      at, where = caller
      found = source(where)
      if found:
        return found
    return NO_USER_LINE

  def _near(self, comp: Computation, inst: Instruction) -> list[Instruction]:
    """Instructions near ``inst``: its operands' producers breadth first, then
    its consumers'."""
    by_name = self.flow.by_name[comp.name]
    users = self.flow.users[comp.name]
    out: list[Instruction] = []
    for step in (
      lambda i: [by_name[o] for o in i.operands if o in by_name],
      lambda i: users.get(i.name, []),
    ):
      layer, seen = [inst], {inst.name}
      for _ in range(4):
        layer = [n for i in layer for n in step(i) if n.name not in seen][:16]
        seen.update(n.name for n in layer)
        out += layer
    return out

  # The data flow
  # ----------------------------------------------------------------------------

  def _named(
    self, inst: Instruction, comp: Computation, operand: int
  ) -> Instruction | None:
    """Whose name stack tells the scope: for one value of a combined
    collective, the element taken from its result or the value itself; else
    ``inst``, or the nearest operand with a name stack when XLA dropped it,
    or the kernel it sits in."""
    by_name = self.flow.by_name[comp.name]
    if len(inst.operands) > 1:
      for user in self._results(inst, comp):
        if user.opcode == 'get-tuple-element' and (
          user.int_attribute('index') == operand and user.op_name()
        ):
          return user
      value = by_name.get(inst.operands[operand])
      if value is not None and value.op_name():
        return value
    seen, todo = set(), [inst]
    while todo:
      at = todo.pop(0)
      if at.op_name():
        return at
      seen.add(at.name)
      todo += [by_name[o] for o in at.operands if o in by_name and o not in seen][:2]
      if len(seen) > 16:
        break
    caller = self.flow.caller(comp)  # a called computation: its caller's
    if caller is not None and caller[1] is not inst:
      return self._named(caller[1], caller[0], 0)
    return None

  def _results(self, inst: Instruction, comp: Computation) -> list[Instruction]:
    """The users of a collective's result (through its done, for a start)."""
    users = self.flow.users[comp.name]
    found = []
    for user in users.get(inst.name, []):
      found += users.get(user.name, []) if user.opcode.endswith('-done') else [user]
    return found

  def _reach(self, inst: Instruction, comp: Computation, operand: int) -> Reach:
    """Where the moved value goes from the collective's result."""
    combined = len(inst.operands) > 1
    index = (operand,) if combined else ()
    at = inst
    if inst.opcode.endswith('-start'):
      done = next(
        (
          u
          for u in self.flow.users[comp.name].get(inst.name, [])
          if u.opcode.endswith('-done')
        ),
        None,
      )
      if done is None:
        return Reach(complete=False)
      at = done
    elif not inst.shape.startswith('('):
      index = ()
    return self.flow.reach(comp, at.name, index)

  def line(self, inst: Instruction, comp: Computation) -> str:
    """The user's line of the value ``inst`` computes, as :meth:`attribute`
    tells a collective's (``NO_USER_LINE`` where none is near)."""
    return self._line(inst, comp, inst, inst.op_name())

  def leaf(self, number: int | None) -> tuple[str, str] | None:
    """``(plan path, category)`` of entry parameter ``number``, if known."""
    if number is None or number >= len(self.leaves):
      return None
    return self.leaves[number]

  def updated(self, outputs: set[int], inputs: str = '') -> tuple[str, ...]:
    """The parameters whose new values (or optimizer state) are among
    ``outputs``; with ``inputs``, the arguments of that category whose new
    values are."""
    found: set[str] = set()
    params = [leaf[0] for leaf in self.leaves if leaf and leaf[1] == PARAMETERS]
    for out in outputs:
      leaf = self.leaf(self.updates.get(out))
      if leaf is None:
        continue
      path, category = leaf
      if inputs:
        if category == inputs:
          found.add(path)
      elif category == PARAMETERS:
        found.add(path)
      elif category == OPTIMIZER:
        found.add(_param_of_state(path, params))
    return tuple(sorted(found))


def operand_dims(
  inst: Instruction, comp: Computation, operand: int
) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
  """Dimensions of one value a collective moves: as it goes in, as it comes
  out (a combined collective's result holds one element per operand; an async
  start's, its operands before its results)."""
  value = inst.operands[operand] if operand < len(inst.operands) else None
  given = array_shapes(comp.shapes.get(value or '', ''))
  dims_in = given[0][1] if given else None
  arrays = array_shapes(inst.shape)
  k = len(inst.operands)
  if inst.opcode.startswith(('all-to-all', 'ragged-all-to-all')) and k > 1:
    # An all-to-all of several operands moves one value, one piece per peer.
    pieces = [array_shapes(comp.shapes.get(o, '')) for o in inst.operands]
    total_in = sum(math.prod(p[0][1]) for p in pieces if p)
    return (total_in,), (sum(math.prod(d) for _, d in arrays[-k:]),)
  if inst.opcode == 'collective-permute-start' and len(arrays) > 1:
    return dims_in, arrays[1][1]
  if inst.opcode.endswith('-start') and len(arrays) >= 2 * k:
    return dims_in, arrays[k + operand][1]
  if len(arrays) == k and operand < k:
    return dims_in, arrays[operand][1]
  return dims_in, arrays[-1][1] if arrays else None


def _bytes(comp: Computation, value: str | None, inst: Instruction) -> float:
  """Bytes of the largest array of a moved value (its operand, else the
  collective's result)."""
  if value is not None and value in comp.shapes:
    return largest_array_bytes(comp.shapes[value])
  return largest_array_bytes(inst.shape)


def _param_of_state(path: str, params: Sequence[str]) -> str:
  """An optimizer-state leaf's parameter: ``'state/opt_state/0/mu/params/w'``
  -> ``'state/params/w'`` where such a parameter exists."""
  suffix = _state_param(path)
  return next((p for p in params if p.endswith('/' + suffix) or p == suffix), suffix)


def _state_param(path: str) -> str:
  """An optimizer-state leaf's parameter: ``'opt_state/0/mu/w'`` -> ``'w'``."""
  for word in ('/mu/', '/nu/', '/trace/', '/v_row/', '/v_col/', '/v/', '/m/'):
    if word in path:
      return path.split(word, 1)[1]
  return path


def _change(inst: Instruction, kind: str) -> str:
  """How a resharding collective changes its value's layout."""
  dims = inst.int_list('dimensions') or []
  dim = f'dim {dims[0]}' if dims else 'a dimension'
  return {
    'all-gather': f'{dim} sharded -> whole',
    'reduce-scatter': f'partial sums -> {dim} sharded',
    'all-reduce': 'partial sums -> summed',
    'all-to-all': f'resharded across {dim}',
    'collective-permute': 'shards moved',
  }.get(kind, '')
