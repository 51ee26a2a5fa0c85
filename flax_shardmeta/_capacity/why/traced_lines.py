"""The user's line of each operation of a traced step, for the compiled
program's collectives.

XLA keeps on each instruction jax's name stack and a few innermost frames;
for a flax layer those are flax's own (``linear.py``), and the user's line
that called the layer may be cut off, so the nearest user line XLA kept is
another operation's (the ``relu`` between two layers). The traced step
keeps every equation's full traceback: the frame just outside jax, flax,
optax and this package (``_frames.user_frame``) is the line that called the
layer. Equations are keyed as the compiled program's name stacks read
(module scope, primitive, forward or backward pass), so an instruction's
``op_name`` finds its line (:meth:`TracedLines.lines_of`).

Two more facts come from the trace: where each argument is first used (a
gradient row names the line that uses its parameter, not the loss or the
update), and which collectives the step's own code calls (``ppermute``,
``psum``... in a ``shard_map``): those are asked for by that call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jax.extend import core as jex_core

from flax_shardmeta._capacity.why.routing_lines import (
  EXCHANGES,
  ROUTING_KINDS,
  routing_roles,
)
from flax_shardmeta._frames import user_line
from flax_shardmeta._programs.jaxprs import (
  NAMED_CALLS,
  UnknownParameters,
  operand_offset,
  scan_parts,
  sub_jaxprs,
)
from flax_shardmeta._programs.name_stacks import (
  merged_names,
  primitive_of,
  scope_of,
)

EXPLICIT = frozenset(
  'psum psum_invariant pmax pmin ppermute pbroadcast all_to_all ragged_all_to_all '
  'all_gather all_gather_invariant all_gather_reduced reduce_scatter psum_scatter '
  'unreduced_psum unreduced_reduce_scatter'.split()
)
"""The collective primitives a step's code calls itself (in ``shard_map``)."""

Key = tuple[str, str, bool]

# Operations that only move, cast or lay out a value: a parameter passing
# through one is not used yet (its use is where the layer computes with it).
_MOVES = frozenset(
  'convert_element_type copy copy_p reshape squeeze expand_dims broadcast_in_dim '
  'transpose sharding_constraint reshard mesh_cast pvary pbroadcast '
  'dynamic_slice slice device_put'.split()
)


@dataclasses.dataclass(frozen=True)
class TracedLines:
  """The user's lines of a traced step.

  Attributes:
    lines: ``(scope, primitive, backward)`` -> the user's lines of the
      equations so keyed, in program order.
    uses: per input of the step (in the jaxpr's order), the user's line that
      first computes with it (``''`` where none does).
    checkpoints: the user's line of each ``checkpoint_name`` call, and the
      lines that made the value it names -> the names (what a remat policy
      saves or offloads by name).
    checkpoint_shapes: each name -> the shapes of the values given it (a
      line that makes several values tells them apart by shape).
    routing: the lines that route tokens to experts and back, each with its
      role, ``'dispatch'``, ``'experts'`` or ``'combine'`` (``routing_lines``).
    routing_masks: the lines that make routing values alone (the experts'
      choice, the masks and slots made from it), none of ``routing``'s.
    exchanges: the lines of ``routing`` that call ``all_to_all`` or
      ``ragged_all_to_all`` on tokens (a ``shard_map``'s routing).
    batched: per input of the step, the dimensions its first use batches
      over (a ``dot_general``'s batch dimensions, e.g. the experts of
      ``'becd,edf->becf'``), numbered as the input's; ``()`` where none.

  Example:
    >>> t = TracedLines({('M/up', 'dot_general', True): ('m.py:4',)}, ('m.py:4',))
    >>> t.lines_of('jit(step)/transpose(jvp(M))/up/dot_general')
    ('m.py:4',)
    >>> t.lines_of('jit(step)/jvp(M)/up/dot_general')
    ()
  """

  lines: dict[Key, tuple[str, ...]]
  uses: tuple[str, ...] = ()
  checkpoints: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
  checkpoint_shapes: dict[str, tuple[tuple[int, ...], ...]] = dataclasses.field(
    default_factory=dict
  )
  routing: dict[str, str] = dataclasses.field(default_factory=dict)
  batched: tuple[tuple[int, ...], ...] = ()
  routing_masks: frozenset[str] = frozenset()
  exchanges: frozenset[str] = frozenset()

  def lines_of(self, op_name: str) -> tuple[str, ...]:
    """The user's lines of the equations an instruction's ``op_name`` names
    (of names XLA merged, the first one's); ``()`` when none match."""
    if not op_name:
      return ()
    return self.lines.get(key_of(merged_names(op_name)[0]), ())

  def routing_role(self, kind: str, op: str, source: str, opcode: str = '') -> str:
    """The role of the line a token-moving collective of ``kind`` (its
    instruction's ``opcode``, the ``op_name`` near it) is at; ``''`` when it
    is at no routing line, or is a collective the code calls otherwise.

    Example:
      >>> t = TracedLines({}, routing={'m.py:9': 'dispatch'})
      >>> t.routing_role('all-to-all', 'jit(step)/x/dot_general', 'm.py:9')
      'dispatch'
    """
    if kind not in ROUTING_KINDS:
      return ''
    if opcode.startswith('ragged-all-to-all'):
      # Only lax.ragged_all_to_all makes one, and XLA may leave it without
      # a name: its line is its operand's. Tokens the experts computed on
      # go back (the combine), their gradients (the backward pass) back to
      # the experts' inputs, the dispatch's transpose; other tokens go out.
      role = self.routing.get(source, '')
      if role == 'experts':
        return 'dispatch' if 'transpose(' in op else 'combine'
      return role or ('dispatch' if self.routing else '')
    if is_explicit(op) and primitive_of(op) not in EXCHANGES:
      return ''
    return self.routing.get(source, '')

  def exchange_line(self, role: str, near: str) -> str:
    """The line of the step's one exchange of ``role`` (where a ragged
    all-to-all XLA left without a name is put); ``near`` where there are
    several or none."""
    lines = [x for x in self.exchanges if self.routing.get(x) == role]
    return lines[0] if len(lines) == 1 else near

  def kept(self, keep: Sequence[bool]) -> TracedLines:
    """These lines with ``uses`` only for the inputs kept (the compiled
    program's parameters: jax drops the inputs a step never reads)."""
    if len(keep) != len(self.uses):
      return dataclasses.replace(self, uses=(), batched=())
    kept = tuple(u for u, k in zip(self.uses, keep) if k)
    batched = tuple(b for b, k in zip(self.batched, keep) if k)
    return dataclasses.replace(self, uses=kept, batched=batched)


def key_of(op_name: str) -> Key:
  """What an ``op_name`` is matched by: module scope, primitive, pass.

  Example:
    >>> key_of('jit(step)/transpose(jvp(MLP))/while/body/down/dot_general')
    ('MLP/down', 'dot_general', True)
  """
  return (scope_of(op_name), primitive_of(op_name), 'transpose(' in op_name)


def traced_lines(jaxpr: Any) -> TracedLines:
  """The lines of a traced step's jaxpr (``traced.jaxpr.jaxpr``)."""
  found: dict[Key, list[str]] = {}
  named: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
  _walk(jaxpr, 'jit(step)', found, named)
  lines = {k: tuple(dict.fromkeys(v)) for k, v in found.items()}
  used: dict[int, str] = {}
  batched: dict[int, tuple[int, ...]] = {}
  offsets = {v: {i: 0} for i, v in enumerate(jaxpr.invars)}
  _first_uses(
    jaxpr, {v: {i} for i, v in enumerate(jaxpr.invars)}, used, offsets, batched
  )
  uses = tuple(used.get(i, '') for i in range(len(jaxpr.invars)))
  batch_dims = tuple(batched.get(i, ()) for i in range(len(jaxpr.invars)))
  checkpoints = {
    line: tuple(dict.fromkeys(n for n, _ in v)) for line, v in named.items()
  }
  shapes: dict[str, list[tuple[int, ...]]] = {}
  for given in named.values():
    for n, shape in given:
      shapes.setdefault(n, []).append(shape)
  by_name = {n: tuple(dict.fromkeys(v)) for n, v in shapes.items()}
  masks: set[str] = set()
  sent: set[str] = set()
  routing = routing_roles(jaxpr, masks, sent)
  return TracedLines(
    lines,
    uses,
    checkpoints,
    by_name,
    routing,
    batch_dims,
    frozenset(masks),
    frozenset(sent),
  )


def lines_of_trace(traced: Any) -> TracedLines | None:
  """:func:`traced_lines` of a ``jax.jit(...).trace(...)`` result (this
  script's lines, even when the program came from the fit cache); None for a
  program this reading does not know (XLA's own lines are used then)."""
  try:
    return traced_lines(traced.jaxpr.jaxpr)
  except Exception:  # noqa: BLE001 - only the lines are lost
    return None


def _walk(
  jaxpr: Any,
  prefix: str,
  found: dict[Key, list[str]],
  named: dict[str, list[tuple[str, tuple[int, ...]]]],
) -> list[list[str]]:
  """Every equation's user line into ``found`` by key, and the names each
  ``checkpoint_name`` call gives into ``named`` by its line (and by the
  lines that made the value it names). Returns the lines that made each of
  the jaxpr's outputs."""
  made: dict[Any, list[str]] = {}  # var -> the lines that made it, moves included
  for eqn in jaxpr.eqns:
    stack = str(getattr(eqn.source_info, 'name_stack', '') or '')
    at = '/'.join(p for p in (prefix, stack) if p)
    name = eqn.primitive.name
    line = user_line(getattr(eqn.source_info, 'traceback', None))
    if line:
      found.setdefault(key_of(f'{at}/{name}'), []).append(line)
    if name == 'name':  # checkpoint_name: what a remat policy names
      # The value XLA keeps is made on the lines before the call (often in
      # a helper), so the name goes to those lines too.
      given = str(eqn.params.get('name', ''))
      shape = tuple(getattr(getattr(eqn.invars[0], 'aval', None), 'shape', ()))
      for at_line in dict.fromkeys([line, *_made_of(eqn.invars[:1], made)]):
        if at_line:
          named.setdefault(at_line, []).append((given, shape))
    inner_prefix = (
      f'{at}/jit({eqn.params.get("name", "")})' if name in NAMED_CALLS else at
    )
    outs: list[list[str]] = []
    for inner, _ in _sub_jaxprs(eqn):
      outs = _walk(
        inner,
        f'{inner_prefix}/{name}' if name not in NAMED_CALLS else inner_prefix,
        found,
        named,
      )
    _note_made(eqn, line, made, outs)
  return [_made_of([v], made) for v in jaxpr.outvars]


def _made_of(variables: Sequence[Any], made: dict[Any, list[str]]) -> list[str]:
  """The lines that made the first of ``variables`` (``[]`` for a literal)."""
  v = variables[0] if variables else None
  return made.get(v, []) if isinstance(v, jex_core.Var) else []


def _note_made(
  eqn: Any, line: str, made: dict[Any, list[str]], inner: list[list[str]]
) -> None:
  """Records the lines that made each output of ``eqn``: its own, a moved
  value's, and those of a call's sub-program's outputs (``inner``)."""
  before = _made_of(eqn.invars, made) if eqn.primitive.name in _MOVES else []
  for k, out in enumerate(eqn.outvars):
    inside = inner[k] if len(inner) == len(eqn.outvars) else []
    lines: list[str] = [*inside, *([line] if line else []), *before]
    made[out] = list(dict.fromkeys(lines))[:6]


def _sub_jaxprs(eqn: Any) -> list[tuple[Any, int]]:
  """Each sub-program of an equation, with the position of the equation's
  operand its first input is."""
  return [(inner, operand_offset(eqn)) for inner, _ in sub_jaxprs(eqn)]


# Moves that keep every dimension where it was: an input's dimensions are
# still numbered as its own after them.
_SAME_DIMS = frozenset(
  'convert_element_type copy copy_p sharding_constraint reshard mesh_cast pvary '
  'pbroadcast device_put'.split()
)


def _first_uses(
  jaxpr: Any,
  roots: dict[Any, set[int]],
  found: dict[int, str],
  offsets: dict[Any, dict[int, int]],
  batched: dict[int, tuple[int, ...]],
  depth: int = 0,
) -> None:
  """For each input (numbered in ``roots``: var -> the inputs it carries),
  the user's line of the first equation that computes with it, through
  moves and casts and into sub-programs, into ``found``; one pass. Where
  that use is a ``dot_general``, the input's dimensions it batches over go
  into ``batched`` (``offsets``: var -> input -> how many leading dimensions
  of the input a loop's slicing took off)."""
  for eqn in jaxpr.eqns:
    hits = {
      i: roots[v] - found.keys()
      for i, v in enumerate(eqn.invars)
      if isinstance(v, jex_core.Var) and v in roots
    }
    pending = set().union(*hits.values()) if hits else set()
    if not pending:
      continue
    name = eqn.primitive.name
    if name in _MOVES:
      kept = offsets.get(eqn.invars[0], {}) if name in _SAME_DIMS else {}
      for out in eqn.outvars:
        roots[out] = pending
        offsets[out] = kept
      continue
    subs = _sub_jaxprs(eqn)
    for inner, skip in subs:
      inner_roots: dict[Any, set[int]] = {}
      sliced = _sliced_from(eqn, skip)
      for i, carried in hits.items():
        if carried and 0 <= i - skip < len(inner.invars):
          var = inner.invars[i - skip]
          inner_roots.setdefault(var, set()).update(carried)
          shift = 1 if i >= sliced else 0
          known = offsets.get(eqn.invars[i], {})
          offsets[var] = {n: k + shift for n, k in known.items()}
      if inner_roots and depth < 16:
        _first_uses(inner, inner_roots, found, offsets, batched, depth + 1)
    if subs:
      continue  # only passed through: its use comes later
    line = user_line(getattr(eqn.source_info, 'traceback', None))
    if line:
      found.update(dict.fromkeys(pending, line))
    if name == 'dot_general':
      (_, _), (lhs, rhs) = eqn.params['dimension_numbers']
      for position, dims in ((0, lhs), (1, rhs)):
        known = offsets.get(eqn.invars[position], {})
        for n in hits.get(position, set()):
          if n in known and dims:
            batched[n] = tuple(sorted(d + known[n] for d in dims))


def _sliced_from(eqn: Any, skip: int) -> int:
  """The first operand a loop slices along its leading dimension (a scan's
  ``xs``); past every operand for any other equation."""
  if eqn.primitive.name != 'scan':
    return len(eqn.invars) + 1
  try:
    _, consts, carry = scan_parts(eqn.params)
  except UnknownParameters:
    return len(eqn.invars) + 1
  return skip + consts + carry


def is_explicit(op_name: str) -> bool:
  """Whether an instruction is a collective the step's code calls itself
  (its name stack ends in one of :data:`EXPLICIT`).

  Example:
    >>> is_explicit('jit(step)/jvp()/shard_map/ppermute'), is_explicit('x/dot_general')
    (True, False)
  """
  return bool(op_name) and primitive_of(merged_names(op_name)[0]) in EXPLICIT
