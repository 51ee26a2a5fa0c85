"""Why each collective of a compiled program is there: which parameter, which
gradient, which line of the user's code.

XLA keeps, on every instruction, the jax name stack (``op_name``: the module
scope and the primitive, ``transpose(...)`` for the backward pass) and the
user's source line (a stack frame in the module's tables). Those say *where*;
the data flow says *what*:

- a collective whose operand comes, through moves and slices only, from a
  parameter argument gathers that parameter for use (``'parameter'``, FSDP);
  through a loop's carried values too, so a scanned layer's slice of a stacked
  parameter is found;
- an all-reduce or reduce-scatter whose result reaches an updated parameter
  (or its optimizer state) without passing another matmul reduces that
  parameter's gradient (``'gradient'``); the output is told by the module's
  input/output aliasing, else by the parameter of the same shape and scope;
- a scalar (a loss, a metric, a counter, a norm) is ``'other'``;
- everything else reshards a value computed in the step (``'activation'``).

Where metadata is missing (XLA drops it on some fused ops), the nearest
operand that has it stands in, and the data flow decides the reason alone.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence

from flax_shardmeta._capacity.hlo_text import (
  Computation,
  Instruction,
  array_shapes,
  entry,
  largest_array_bytes,
  shape_bytes,
)

REASONS = ('parameter', 'gradient', 'activation', 'other')
"""Why a collective runs, in the order ``why()`` lists them."""

PARAMETERS, OPTIMIZER = 'parameters', 'optimizer state'

# Ops that move or cut a value without computing a new one.
_MOVES = frozenset(
  'bitcast copy reshape transpose convert get-tuple-element dynamic-slice slice '
  'all-gather all-gather-start all-gather-done collective-permute '
  'collective-permute-start collective-permute-done all-to-all copy-start '
  'copy-done optimization-barrier fusion async-start async-done broadcast '
  'pad'.split()
)
# Ops a gradient is not followed through: past a contraction or a reduction
# (a norm's scale gradient sums the activations' gradients) it is another value.
_CONTRACTIONS = frozenset(('dot', 'convolution', 'custom-call', 'reduce'))
# Name-stack parts that are transformations, not module scopes.
_TRANSFORMS = re.compile(
  r'^(jit|pjit|jvp|transpose|vmap|remat\d*|checkpoint|rematted_computation|while|'
  r'body|cond|scan|cond_fun|body_fun|custom_vjp_call|custom_jvp_call|shard_map|'
  r'closed_call|core_call|named_call|xla_call)$'
)
_LIBRARIES = (
  f'{os.sep}jax{os.sep}',
  f'{os.sep}jaxlib{os.sep}',
  f'{os.sep}flax{os.sep}',
  f'{os.sep}optax{os.sep}',
  f'{os.sep}flax_shardmeta{os.sep}_',
  f'{os.sep}flax_shardmeta{os.sep}cli{os.sep}',
)


@dataclasses.dataclass(frozen=True)
class Attribution:
  """Why one collective instruction is there.

  Attributes:
    reason: one of :data:`REASONS`.
    parameters: plan paths of the parameters involved (``'parameter'`` and
      ``'gradient'``), e.g. ``('params/layers/w1',)``.
    source: the user's line, ``'file:line'`` (``''`` when unknown).
    scope: the module scope from the name stack, e.g. ``'Model/layers/attn'``.
    change: for ``'activation'``, how the value's layout changes.
    asked_by: ``'constraint'`` when a sharding constraint asked for it, else
      the operation that needed it (``'dot_general'``...).
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


def scope_of(op_name: str) -> str:
  """The module scope of a name stack (transformations and the primitive
  dropped).

  Example:
    >>> scope_of('jit(step)/transpose(jvp(Model))/layers/while/body/attn/dot_general')
    'Model/layers/attn'
    >>> scope_of('jit(step)/jvp(Llama)/layers/bse,ehd->bshd/dot_general')
    'Llama/layers'
  """
  parts = op_name.split('/')[1:-1]
  out = []
  for part in parts:
    while (m := re.fullmatch(r'(\w+)\((.*)\)', part)) is not None:
      part = m.group(2)
    # einsum specs ('bse,ehd->bshd') and primitives with their parameters
    # ('dot_general:...') are no module
    if part and not _TRANSFORMS.match(part) and not re.search(r'[:,>]', part):
      out.append(part)
  return '/'.join(out)


class Attributor:
  """Attributes the collectives of one parsed program.

  Args:
    computations: the program, from ``hlo_text.parse``.
    leaves: per entry parameter number, ``(plan path, category)`` (the
      report's row names), or None where unknown.
    frames: ``hlo_text.stack_frames`` of the program's text.
    aliases: output index -> entry parameter number (donated arguments).
    shapes: per entry parameter number, the argument's global shape.
  """

  def __init__(
    self,
    computations: dict[str, Computation],
    leaves: Sequence[tuple[str, str] | None] = (),
    frames: dict[int, list[tuple[str, int]]] | None = None,
    aliases: dict[int, int] | None = None,
    shapes: Sequence[tuple[int, ...]] = (),
  ) -> None:
    self.computations = computations
    self.entry = entry(computations)
    self.leaves = list(leaves)
    self.frames = frames or {}
    self.aliases = aliases or {}
    self.by_name = {
      c.name: {i.name: i for i in c.instructions} for c in computations.values()
    }
    self.users: dict[str, dict[str, list[Instruction]]] = {}
    self.callers: dict[str, tuple[Computation, Instruction]] = {}
    for comp in computations.values():
      users = self.users.setdefault(comp.name, {})
      for inst in comp.instructions:
        for o in inst.operands:
          users.setdefault(o, []).append(inst)
        for role, callee in inst.called():
          if role in ('body', 'calls', 'true_computation', 'false_computation'):
            self.callers.setdefault(callee, (comp, inst))
    self.param_shapes = self._parameter_shapes()
    self.entry_dims: dict[int, tuple[int, ...]] = {}
    for inst in self.entry.instructions if self.entry else []:
      number = inst.parameter_number()
      arrays = array_shapes(inst.shape)
      if number is not None and arrays:
        self.entry_dims[number] = arrays[0][1]
    self.shapes = list(shapes)

  def attribute(self, inst: Instruction, comp: Computation, kind: str) -> Attribution:
    """Why ``inst`` (a collective of ``kind``) is there."""
    named = self._named(inst, comp)
    op = named.op_name() if named is not None else ''
    scope = scope_of(op)
    common = {'source': self._source_near(inst, comp, named), 'scope': scope}
    leaf = self._origin_leaf(comp, inst.operands[0]) if inst.operands else None
    if leaf is not None and leaf[1] == PARAMETERS:
      return Attribution('parameter', (leaf[0],), **common)
    if largest_array_bytes(inst.shape) <= 8 or (
      leaf is not None and leaf[1] == OPTIMIZER
    ):
      return Attribution('other', (leaf[0],) if leaf else (), **common)
    if kind in ('all-reduce', 'reduce-scatter'):
      grads = self._gradient_of(inst, comp, scope)
      if grads:
        return Attribution('gradient', grads, **common)
    asked = op.rsplit('/', 1)[-1] if op else ''
    if asked in ('sharding_constraint', 'reshard', 'with_sharding_constraint'):
      asked = 'constraint'
    return Attribution(
      'activation', (), change=_change(inst, kind), asked_by=asked, **common
    )

  def source(self, inst: Instruction | None) -> str:
    """The user's line of ``inst``: its innermost frame outside jax, flax,
    optax and this library (``'file:line'``, relative to the working
    directory when under it)."""
    frame = inst.frame() if inst is not None else None
    if isinstance(frame, str) or frame is None:
      return _relative(frame) if frame else ''
    chain = self.frames.get(frame, [])
    mine = [(f, n) for f, n in chain if not any(lib in f for lib in _LIBRARIES)]
    if mine:
      return f'{_relative(mine[0][0])}:{mine[0][1]}'
    if not chain:
      return ''
    # Only library frames were kept (jax keeps the innermost few): the
    # library's own line, as the package path, the same on every machine.
    file, line = chain[0]
    return f'{_package_path(file)}:{line}'

  def _source_near(
    self, inst: Instruction, comp: Computation, named: Instruction | None
  ) -> str:
    """The line of ``inst``, else of the value's consumers (the op that needed
    the collective: some XLA versions keep a gather's name but not its frame)."""
    found = self.source(named)
    if found:
      return found
    at = [inst]
    for _ in range(3):  # through async done / copies to the consumer
      at = [u for a in at for u in self.users[comp.name].get(a.name, [])][:4]
      for user in at:
        if user.frame() is not None:
          return self.source(user)
    return ''

  # The data flow
  # ----------------------------------------------------------------------------

  def _named(self, inst: Instruction, comp: Computation) -> Instruction | None:
    """``inst``, or the nearest operand with a name stack when XLA dropped it."""
    seen, todo = set(), [inst]
    while todo:
      at = todo.pop(0)
      if at.op_name():
        return at
      seen.add(at.name)
      todo += [
        self.by_name[comp.name][o]
        for o in at.operands
        if o in self.by_name[comp.name] and o not in seen
      ][:2]
      if len(seen) > 16:
        break
    caller = self.callers.get(comp.name)  # a called computation: its caller's
    if caller is not None and caller[1] is not inst:
      return self._named(caller[1], caller[0])
    return None

  def _origin_leaf(self, comp: Computation, name: str) -> tuple[str, str] | None:
    number = self._origin(comp, name, [], 0)
    if number is None or number >= len(self.leaves):
      return None
    return self.leaves[number]

  def _origin(
    self, comp: Computation, name: str, index: list[int], depth: int
  ) -> int | None:
    """The entry parameter ``name`` is moved or cut from, through loops."""
    inst = self.by_name[comp.name].get(name)
    if inst is None or depth > 64:
      return None
    if inst.opcode == 'parameter':
      number = inst.parameter_number()
      if comp is self.entry:
        return number if not index else None
      caller = self.callers.get(comp.name)
      if caller is None or number is None:
        return None
      outer, call = caller
      at = 0 if call.opcode == 'while' else number
      if at >= len(call.operands):
        return None
      return self._origin(outer, call.operands[at], index, depth + 1)
    if inst.opcode == 'get-tuple-element':
      k = inst.int_attribute('index')
      return self._origin(comp, inst.operands[0], [*index, k or 0], depth + 1)
    if inst.opcode == 'tuple' and index:
      k = index[-1]
      if k >= len(inst.operands):
        return None
      return self._origin(comp, inst.operands[k], index[:-1], depth + 1)
    if inst.opcode not in _MOVES or not inst.operands:
      return None
    largest = max(inst.operands, key=lambda o: shape_bytes(comp.shapes.get(o, '')))
    return self._origin(comp, largest, index, depth + 1)

  def _gradient_of(
    self, inst: Instruction, comp: Computation, scope: str
  ) -> tuple[str, ...]:
    """The parameters whose update ``inst``'s result reaches without another
    contraction, or those of its shape in its scope."""
    outputs = self._reaches_outputs(comp, inst.name)
    paths = []
    size = _dims(
      max((d for _, d in array_shapes(inst.shape)), key=_product, default=())
    )
    for out in sorted(outputs):
      number = self.aliases.get(out)
      leaf = (
        self.leaves[number]
        if number is not None and number < len(self.leaves)
        else None
      )
      # A gradient's buffer is its parameter's: its shard, a layer's slice of
      # it, or a whole of which the shard is a device count's share. An
      # activation's gradient reaching the same update (an embedding's
      # scatter-add) is none of those.
      if leaf is not None and leaf[1] in (PARAMETERS, OPTIMIZER):
        if self._same_buffer(size, number):
          paths.append(leaf)
    params = [p for p, c in paths if c == PARAMETERS]
    if params:
      return tuple(sorted(set(params)))
    if outputs and not self.aliases:
      return self._by_shape(inst, scope)
    if not outputs:
      return ()
    return tuple(sorted({_state_param(p) for p, _ in paths}))

  def _reaches_outputs(self, comp: Computation, name: str) -> set[int]:
    """Output positions of the entry's result that ``name`` reaches through
    anything but a contraction, across loop boundaries."""
    found: set[int] = set()
    todo = [(comp, name, 0)]
    seen = set()
    while todo:
      at_comp, at, depth = todo.pop()
      if (at_comp.name, at) in seen or depth > 200:
        continue
      seen.add((at_comp.name, at))
      root = at_comp.instructions[-1] if at_comp.instructions else None
      if root is not None and root.name == at and at_comp is not self.entry:
        todo += self._called_result(at_comp, depth)
      for user in self.users[at_comp.name].get(at, []):
        if user.opcode in _CONTRACTIONS or self._contracts(user):
          continue
        if root is not None and user is root and user.opcode == 'tuple':
          positions = [i for i, o in enumerate(user.operands) if o == at]
          if at_comp is self.entry:
            found.update(positions)
          else:
            todo += self._loop_outputs(at_comp, positions, depth)
            todo += self._called_result(at_comp, depth)
          continue
        todo.append((at_comp, user.name, depth + 1))
    return found

  def _same_buffer(self, size: tuple[int, ...], number: int | None) -> bool:
    dims = self.entry_dims.get(number) if number is not None else None
    if not dims or not size:
      return False
    shapes = {_dims(dims), _dims(dims[1:])}
    if number is not None and number < len(self.shapes):
      whole = self.shapes[number]
      shapes |= {_dims(whole), _dims(whole[1:])}
    return size in shapes

  def _contracts(self, inst: Instruction) -> bool:
    """A fusion whose kernel contracts or reduces."""
    if inst.opcode != 'fusion':
      return False
    return any(
      i.opcode in _CONTRACTIONS
      for _, callee in inst.called()
      for i in (
        self.computations[callee].instructions if callee in self.computations else []
      )
    )

  def _called_result(
    self, comp: Computation, depth: int
  ) -> list[tuple[Computation, str, int]]:
    """A called computation's result, where its caller (a fusion, call or
    async wrapper; not a loop, whose results go by position) uses it."""
    caller = self.callers.get(comp.name)
    if caller is None or caller[1].opcode == 'while':
      return []
    return [(caller[0], caller[1].name, depth + 1)]

  def _loop_outputs(
    self, body: Computation, positions: list[int], depth: int
  ) -> list[tuple[Computation, str, int]]:
    """Where a loop body's result positions come out in its caller."""
    caller = self.callers.get(body.name)
    if caller is None or caller[1].opcode != 'while':
      return []
    outer, loop = caller
    out = []
    for user in self.users[outer.name].get(loop.name, []):
      if (
        user.opcode == 'get-tuple-element' and user.int_attribute('index') in positions
      ):
        out.append((outer, user.name, depth + 1))
    return out

  def _parameter_shapes(self) -> dict[tuple[int, ...], list[str]]:
    """Parameter paths by local shape, and by a scanned layer's slice of it."""
    out: dict[tuple[int, ...], list[str]] = {}
    if self.entry is None:
      return out
    for inst in self.entry.instructions:
      number = inst.parameter_number()
      if number is None or number >= len(self.leaves) or self.leaves[number] is None:
        continue
      path, category = self.leaves[number]  # type: ignore[misc]
      if category != PARAMETERS:
        continue
      for _, dims in array_shapes(inst.shape)[:1]:
        out.setdefault(dims, []).append(path)
        if len(dims) > 1:
          out.setdefault(dims[1:], []).append(path)
    return out

  def _by_shape(self, inst: Instruction, scope: str) -> tuple[str, ...]:
    shapes = array_shapes(inst.shape)
    if not shapes:
      return ()
    candidates = self.param_shapes.get(shapes[0][1], [])
    words = {w.lower() for w in scope.split('/') if w}
    scored = [(len(words & set(p.lower().split('/'))), p) for p in candidates]
    best = max((s for s, _ in scored), default=0)
    return tuple(sorted({p for s, p in scored if s == best}))


def _dims(dims: tuple[int, ...]) -> tuple[int, ...]:
  """Dimensions compared as a buffer's: sizes of 1 dropped, order ignored
  (XLA may hold a gradient transposed)."""
  return tuple(sorted(d for d in dims if d != 1))


def _product(dims: tuple[int, ...]) -> int:
  out = 1
  for d in dims:
    out *= d
  return out


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


def _package_path(path: str) -> str:
  """``'/x/site-packages/flax/linen/linear.py'`` -> ``'flax/linen/linear.py'``."""
  for marker in ('site-packages', 'dist-packages'):
    if marker + os.sep in path:
      return path.split(marker + os.sep, 1)[1]
  return _relative(path)


def _relative(path: str) -> str:
  try:
    rel = os.path.relpath(path)
  except ValueError:  # another drive
    return path
  return path if rel.startswith('..') else rel
