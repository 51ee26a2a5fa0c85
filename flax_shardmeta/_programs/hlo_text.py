"""Reading a compiled program's optimised HLO text: the one place that parses it.

Why text: jax gives a compiled program as text (``Compiled.as_text()``) and,
through jaxlib, as ``HloModule`` objects whose instructions expose only their
name, opcode and operands (jax 0.10 and 0.12 alike). What the capacity layer
needs besides (result shapes, which computations a loop runs, replica groups,
trip counts the compiler recorded, contracting dimensions, convolution
windows) is only in the text; the serialized ``HloModuleProto`` has it all,
but no protobuf schema for it ships with jax or jaxlib. So the text is read
here, by regular expressions, and nowhere else: :func:`parse` and the
:class:`Instruction` accessors own every detail of the format (the fields of
an instruction's metadata, jax's name stack among them: ``hlo_metadata``).

Why it is fragile: XLA's text form is for people, not a stable interface; a
release can rename an attribute, change how replica groups print or how
layouts annotate a shape. Two guards make such a change loud rather than
silently wrong: ``compiled_text.disagreements`` checks every parse against XLA's own
module objects (names, opcodes, operands), and ``tests/test_hlo.py`` compiles
a program with a known loop and collective and expects to find both.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import numpy as np

# The metadata readers live in hlo_metadata; read_frame, read_op_name and
# stack_frames stay importable from here.
from flax_shardmeta._programs.name_stacks import (
  bracket_end,
  read_frame as read_frame,
  read_op_name as read_op_name,
  stack_frames as stack_frames,
)

_ITEMSIZE: dict[str, float] = {
  **dict.fromkeys(('s4', 'u4'), 0.5),
  **dict.fromkeys(('pred', 's8', 'u8'), 1),
  **dict.fromkeys(('s16', 'u16', 'f16', 'bf16'), 2),
  **dict.fromkeys(('s32', 'u32', 'f32'), 4),
  **dict.fromkeys(('s64', 'u64', 'f64', 'c64'), 8),
  'c128': 16,
}

_ARRAY = re.compile(r'\b([a-z][a-z0-9]*)\[([0-9,]*)\]')
_HEADER = re.compile(r'^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$')
# A computation run by another execution thread than the main one (a TPU's
# SparseCore, an async wrapper's) closes with the thread's name.
_FOOTER = re.compile(r'^\}(?:,\s*execution_thread="([^"]*)")?$')
_INSTRUCTION = re.compile(r'^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$')
# XLA's dumps (jax 0.12) leave out get-tuple-element: an operand `%while.3#1`
# is element 1 of `while.3`. The `#k` stays in the operand's name, and
# `parse` adds the get-tuple-element it stands for.
_OPERAND = re.compile(r'%([\w.\-]+(?:#\d+)*)')
_COMMENT = re.compile(r'/\*.*?\*/')
# Attributes print as `, key=value` after the operands; metadata's own fields
# are space-separated inside braces, so anchoring on ', ' never reads them.
_CALL_ROLES = (
  'calls',
  'to_apply',
  'condition',
  'body',
  'true_computation',
  'false_computation',
)
_CALLED = re.compile(rf'(?:^|, )({"|".join(_CALL_ROLES)})=%?([\w.\-]+)')


def itemsize(dtype: str) -> float:
  """Bytes of one element of an HLO element type (``'bf16'`` -> 2)."""
  if dtype.startswith('f8') or dtype.startswith('f4'):
    return 1 if dtype.startswith('f8') else 0.5
  return _ITEMSIZE.get(dtype, 0)


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string, tuples summed, layouts ignored.

  Example:
    >>> shape_bytes('(f32[2,3]{1,0}, bf16[4]{0:T(128)}, s32[])')
    36
  """
  total = 0.0
  for dtype, dims in _ARRAY.findall(shape):
    total += math.prod(int(d) for d in dims.split(',') if d) * itemsize(dtype)
  return int(total)


def array_shapes(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """``(dtype, dims)`` of each array in a (tuple) shape string."""
  return [
    (dtype, tuple(int(d) for d in dims.split(',') if d))
    for dtype, dims in _ARRAY.findall(shape)
    if dtype in _ITEMSIZE or dtype.startswith(('f8', 'f4'))
  ]


def tuple_elements(shape: str) -> list[str]:
  """The element shapes of a tuple shape string (``[]`` for an array).

  Example:
    >>> tuple_elements('(f32[2]{0}, /*index=1*/(s32[], u8[4]{0}))')
    ['f32[2]{0}', '(s32[], u8[4]{0})']
  """
  if not shape.startswith('('):
    return []
  inside = _COMMENT.sub('', _balanced(shape, '(', ')')[1:-1])
  return [item for item in _top_level_items(inside) if item]


def _top_level_items(text: str) -> list[str]:
  """``text`` split at its commas outside brackets, each item stripped."""
  out, depth, start = [], 0, 0
  for i, ch in enumerate(text + ','):
    if ch in '([{':
      depth += 1
    elif ch in ')]}':
      depth -= 1
    elif ch == ',' and depth == 0:
      out.append(text[start:i].strip())
      start = i + 1
  return out


def largest_array_bytes(shape: str) -> float:
  """Bytes of the largest array in a (tuple) shape string."""
  return max((math.prod(d) * itemsize(t) for t, d in array_shapes(shape)), default=0)


# A library matmul's contracting dimensions in its backend config (JSON).
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')


@dataclasses.dataclass
class Instruction:
  """One HLO instruction: its name, result shape, opcode, operands, attributes."""

  name: str
  shape: str
  opcode: str
  operands: list[str]
  attributes: str
  args: str = ''  # the text inside the parentheses, e.g. a constant's literal

  @functools.cached_property
  def _called(self) -> list[tuple[str, str]]:
    out = [(m.group(1), m.group(2)) for m in _CALLED.finditer(self.attributes)]
    branches = self.attribute('branch_computations')
    if branches:
      out += [('branch', b.strip().lstrip('%')) for b in branches[1:-1].split(',')]
    return out

  def called(self) -> list[tuple[str, str]]:
    """``(role, computation)`` for every computation this instruction calls."""
    return list(self._called)

  def attribute(self, key: str) -> str | None:
    """The text of attribute ``key`` (``'{0,1}'``, ``'LT'``...), or None."""
    m = re.search(rf'(?:^|, ){re.escape(key)}=', self.attributes)
    if m is None:
      return None
    rest = self.attributes[m.end() :]
    if rest.startswith('{'):
      return _balanced(rest, '{', '}')
    if rest.startswith('"'):
      end = rest.find('"', 1)
      return rest[: end + 1] if end > 0 else rest
    return re.split(r',\s|\s', rest, maxsplit=1)[0]

  def int_attribute(self, key: str) -> int | None:
    """An integer attribute (``index=2``), or None."""
    text = self.attribute(key)
    return int(text) if text is not None and re.fullmatch(r'-?\d+', text) else None

  def int_list(self, key: str) -> list[int] | None:
    """A list attribute (``lhs_contracting_dims={1,2}``), or None."""
    text = self.attribute(key)
    if text is None or not text.startswith('{'):
      return None
    return [int(d) for d in text[1:-1].split(',') if d.strip()]

  def library_matmul_contracting(self) -> list[int] | None:
    """The left operand's contracting dimensions of a cuBLAS matmul (a custom
    call with a ``gemm_backend_config``: its first result is the product, a
    second the workspace), else None.

    Example:
      >>> i = Instruction('c', '(f32[8,4]{1,0}, s8[64]{0})', 'custom-call', [],
      ...   'backend_config={"gemm_backend_config":{"dot_dimension_numbers":'
      ...   '{"lhs_contracting_dimensions":["1"]}}}')
      >>> i.library_matmul_contracting()
      [1]
    """
    if self.opcode != 'custom-call' or '"gemm_backend_config"' not in self.attributes:
      return None
    m = _GEMM_CONTRACTING.search(self.attributes)
    if m is None:
      return None
    return [int(d.strip(' "')) for d in m.group(1).split(',') if d.strip(' "')]

  def op_name(self) -> str:
    """The jax name stack XLA kept in the metadata (``'jit(step)/jvp(Model)/
    layers/dot_general'``), or ``''`` (``hlo_metadata`` reads it)."""
    return read_op_name(self.attributes)

  def frame(self) -> int | str | None:
    """Where the user's code made it: a stack frame id (newer XLA) or
    ``'file:line'`` (older), or None."""
    return read_frame(self.attributes)

  def known_trip_count(self) -> int | None:
    """The trip count XLA recorded for a ``while`` in its backend config."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', self.attributes)
    return int(m.group(1)) if m else None

  def integer_constant(self) -> int | None:
    """The value of an integer scalar ``constant``, else None."""
    m = re.fullmatch(r'\s*(-?\d+)\s*', self.args)
    return int(m.group(1)) if self.opcode == 'constant' and m else None

  def parameter_number(self) -> int | None:
    """Which parameter of its computation a ``parameter`` is, else None."""
    if self.opcode != 'parameter' or not self.args.strip().isdigit():
      return None
    return int(self.args)

  def dim_labels(self) -> tuple[str, str, str] | None:
    """A convolution's ``(lhs, rhs, output)`` dimension labels."""
    m = re.fullmatch(r'(\w+)_(\w+)->(\w+)', self.attribute('dim_labels') or '')
    return (m.group(1), m.group(2), m.group(3)) if m else None

  def window(self) -> dict[str, str]:
    """A convolution's window fields (``size``, ``stride``, ``pad``...)."""
    text = self.attribute('window') or '{}'
    return dict(re.findall(r'(\w+)=(\S+)', text[1:-1]))

  def first_group(self, n_devices: int | None) -> list[int] | None:
    """Device ids of a collective's first replica group (or source/target pair)."""
    return _first_group(self.attributes, n_devices)


def _balanced(text: str, open_: str, close: str) -> str:
  """``'(a, (b)) rest'`` -> ``'(a, (b))'``: the balanced prefix."""
  return _split_top(text, open_, close)[0]


@dataclasses.dataclass
class Computation:
  """A named HLO computation and its instructions (in text order)."""

  name: str
  is_entry: bool
  instructions: list[Instruction]
  shapes: dict[str, str]  # name -> result shape, parameters included
  thread: str = 'main'  # the execution thread: 'sparsecore' for a TPU's SparseCore


def _split_top(text: str, open_: str, close: str) -> tuple[str, str]:
  """``'(a, (b)) rest'`` -> ``('(a, (b))', ' rest')``: a balanced prefix."""
  end = bracket_end(text, open_, close)
  return (text, '') if end is None else (text[: end + 1], text[end + 1 :])


def parse_instruction(line: str) -> Instruction | None:
  """One instruction line (``%n = f32[4]{0} negate(%p), metadata=...``)."""
  m = _INSTRUCTION.match(line)
  if m is None:
    return None
  name, rest = m.group(2), m.group(3).strip()
  if rest.startswith('('):
    shape, rest = _split_top(rest, '(', ')')
  else:
    shape, _, rest = rest.partition(' ')
  rest = rest.strip()
  paren = rest.find('(')
  if paren < 0:
    return None
  opcode = rest[:paren].strip()
  args, attributes = _split_top(rest[paren:], '(', ')')
  operands = _OPERAND.findall(args)
  return Instruction(name, shape, opcode, operands, attributes, args[1:-1])


def _parameters(header: str) -> dict[str, str]:
  """Parameter name -> shape, from a computation header."""
  inside, _ = _split_top(header[header.index('(') :], '(', ')')
  out: dict[str, str] = {}
  for item in _top_level_items(inside[1:-1]):
    name, _, shape = item.partition(':')
    if shape:
      out[name.strip().lstrip('%')] = shape.strip()
  return out


def parse(text: str) -> dict[str, Computation]:
  """The computations of an HLO module's text, by name (see the module doc).

  Example:
    >>> text = '''
    ... %sc (a: f32[]) -> f32[] {
    ...   ROOT %a = f32[] parameter(0)
    ... }, execution_thread="sparsecore"
    ...
    ... ENTRY %main (p: f32[4]) -> f32[4] {
    ...   %p = f32[4]{0} parameter(0)
    ...   ROOT %n = f32[4]{0} negate(%p)
    ... }'''
    >>> [i.opcode for i in parse(text)['main'].instructions], parse(text)['sc'].thread
    (['parameter', 'negate'], 'sparsecore')
  """
  computations: dict[str, Computation] = {}
  current: Computation | None = None
  for line in text.splitlines():
    stripped = line.strip()
    if current is None:
      m = _HEADER.match(stripped)
      if m:
        current = Computation(m.group(2), bool(m.group(1)), [], _parameters(stripped))
      continue
    if (closed := _FOOTER.match(stripped)) is not None:
      current.thread = closed.group(1) or current.thread
      computations[current.name] = current
      current = None
      continue
    inst = parse_instruction(line)
    if inst is not None:
      for operand in inst.operands:
        _add_element(current, operand)
      current.instructions.append(inst)
      current.shapes[inst.name] = inst.shape
  return computations


def _add_element(comp: Computation, operand: str) -> None:
  """The get-tuple-element a dump's ``%x#k`` operand stands for, added to
  ``comp`` before its first use (nested ``%x#k#j`` one level at a time)."""
  whole, sep, k = operand.rpartition('#')
  if not sep or operand in comp.shapes:
    return
  _add_element(comp, whole)
  elements = tuple_elements(comp.shapes.get(whole, ''))
  shape = elements[int(k)] if int(k) < len(elements) else ''
  gte = Instruction(operand, shape, 'get-tuple-element', [whole], f', index={k}')
  gte.args = f'%{whole}'
  comp.instructions.append(gte)
  comp.shapes[operand] = shape


def output_aliases(text: str) -> dict[int, int]:
  """Output position -> the entry parameter it aliases (donated arguments),
  from the module header's ``input_output_alias``.

  Example:
    >>> output_aliases('HloModule m, input_output_alias={ {0}: (2, {}, may-alias) }')
    {0: 2}
  """
  header = text[: text.find('\n')] if '\n' in text else text
  return {int(o): int(p) for o, p in _ALIAS.findall(header)}


_ALIAS = re.compile(r'\{(\d+)\}: \((\d+), \{\}')


def entry(computations: dict[str, Computation]) -> Computation | None:
  """The module's entry computation."""
  return next((c for c in computations.values() if c.is_entry), None)


def _first_group(attributes: str, n_devices: int | None) -> list[int] | None:
  m = re.search(r'replica_groups=\{\{([0-9,\s]*)\}', attributes)
  if m:
    return [int(x) for x in m.group(1).split(',') if x.strip()]
  m = re.search(
    r'replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](T\(([0-9,]+)\))?', attributes
  )
  if m:
    group_shape = [int(x) for x in m.group(1).split(',')]
    dims = [int(x) for x in m.group(2).split(',')]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(4):
      ids = ids.transpose([int(x) for x in m.group(4).split(',')])
    return [int(i) for i in ids.reshape(group_shape[0], -1)[0]]
  group = _mesh_group(attributes, n_devices)
  if group is not None:
    return group
  pairs = re.search(r'source_target_pairs=\{(\{[0-9,{}\s]*\})\}', attributes)
  if pairs:
    moved = [
      (int(a), int(b))
      for a, b in re.findall(r'\{(\d+),(\d+)\}', pairs.group(1))
      if a != b
    ]
    return _ring_of(moved) if moved else None
  if re.search(r'replica_groups=\{\}', attributes) and n_devices:
    return list(range(n_devices))
  return None


def _ring_of(pairs: list[tuple[int, int]]) -> list[int]:
  """The devices a permute's first pair is joined to through its pairs: a
  ring over 32 devices (XLA's windowed einsum passes a shard around it) is
  one group of 32, not a pair of neighbours that share all but one axis.

  Example:
    >>> _ring_of([(0, 1), (1, 2), (2, 0), (3, 4), (4, 3)])
    [0, 1, 2]
  """
  joined: dict[int, set[int]] = {}
  for a, b in pairs:
    joined.setdefault(a, set()).add(b)
    joined.setdefault(b, set()).add(a)
  seen, todo = {pairs[0][0]}, [pairs[0][0]]
  while todo:
    for other in joined[todo.pop()] - seen:
      seen.add(other)
      todo.append(other)
  return sorted(seen)


def _mesh_group(attributes: str, n_devices: int | None) -> list[int] | None:
  """``replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0))
  {'axis_0'}``: the devices laid out as an iota (reshaped, transposed) over
  those axes, the group spanning the named ones. Without device_ids the iota
  is plain. Newer XLA prints the mesh's own axis names (``mesh['data'=2,
  'model'=4] {'data'}``) where older printed ``axis_0``, ``axis_1``."""
  m = re.search(
    r'replica_groups=mesh\[([^\]]*)\]'
    r'(?:,\s*device_ids=\(\[([0-9,]+)\](?:<=\[([0-9,]+)\])?(?:T\(([0-9,]+)\))?\))?'
    r'\s*\{([^}]*)\}',
    attributes,
  )
  if m is None or not n_devices:
    return None
  mesh = re.findall(r"'?([^'=,\s]+)'?\s*=\s*(\d+)", m.group(1))
  names, dims = [n for n, _ in mesh], [int(d) for _, d in mesh]
  spanned = {a.strip().strip("'") for a in m.group(5).split(',') if a.strip()}
  if math.prod(dims) != n_devices or not spanned <= set(names):
    return None
  ids = np.arange(n_devices)
  if m.group(2):
    ids = ids.reshape([int(x) for x in (m.group(3) or m.group(2)).split(',')])
    if m.group(4):
      ids = ids.transpose([int(x) for x in m.group(4).split(',')])
  ids = ids.reshape(dims)
  index = tuple(slice(None) if name in spanned else 0 for name in names)
  return [int(i) for i in ids[index].reshape(-1)]
