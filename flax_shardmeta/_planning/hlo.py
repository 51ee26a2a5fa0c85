"""Reading a compiled program's HLO text: collectives and work per step.

XLA reports memory per chip exactly, but two things a training step costs are
only in the optimised HLO itself: which collectives run and on which mesh
axes, and how often each loop body runs. ``cost_analysis()`` counts a loop
body once, whatever its trip count, so a scanned 32-layer model looks like a
one-layer one; the collectives inside that loop run 32 times a step. This
module parses the text into computations, finds each loop's trip count from
its condition (``i < N`` with ``i`` counting from a constant), and weighs
every computation by how many times a step runs it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

COLLECTIVE_KINDS = (
  'all-gather',
  'reduce-scatter',
  'all-reduce',
  'all-to-all',
  'collective-permute',
)
"""The collective kinds reported, in the order tables list them."""

_OPCODE_KIND = {
  'all-gather': 'all-gather',
  'all-gather-start': 'all-gather',
  'reduce-scatter': 'reduce-scatter',
  'all-reduce': 'all-reduce',
  'all-reduce-start': 'all-reduce',
  'all-to-all': 'all-to-all',
  'ragged-all-to-all': 'all-to-all',
  'collective-permute': 'collective-permute',
  'collective-permute-start': 'collective-permute',
}

_ITEMSIZE = {
  'pred': 1,
  's4': 0.5,
  'u4': 0.5,
  's8': 1,
  'u8': 1,
  's16': 2,
  'u16': 2,
  'f16': 2,
  'bf16': 2,
  's32': 4,
  'u32': 4,
  'f32': 4,
  's64': 8,
  'u64': 8,
  'f64': 8,
  'c64': 8,
  'c128': 16,
}

# Instructions that move no data of their own.
_FREE = frozenset(
  {
    'parameter',
    'constant',
    'get-tuple-element',
    'tuple',
    'bitcast',
    'while',
    'call',
    'conditional',
    'after-all',
    'partition-id',
    'replica-id',
    'opt-barrier',
    'add-dependency',
  }
)

_ARRAY = re.compile(r'\b([a-z][a-z0-9]*)\[([0-9,]*)\]')
_HEADER = re.compile(r'^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$')
_INSTRUCTION = re.compile(r'^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$')


def _itemsize(dtype: str) -> float:
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
    total += math.prod(int(d) for d in dims.split(',') if d) * _itemsize(dtype)
  return int(total)


def array_shapes(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """``(dtype, dims)`` of each array in a (tuple) shape string."""
  return [
    (dtype, tuple(int(d) for d in dims.split(',') if d))
    for dtype, dims in _ARRAY.findall(shape)
    if dtype in _ITEMSIZE or dtype.startswith(('f8', 'f4'))
  ]


@dataclasses.dataclass
class Instruction:
  """One HLO instruction: its name, result shape, opcode, operands, attributes."""

  name: str
  shape: str
  opcode: str
  operands: list[str]
  attributes: str
  args: str = ''  # the text inside the parentheses, e.g. a constant's literal

  def called(self) -> list[tuple[str, str]]:
    """``(role, computation)`` for every computation this instruction calls."""
    out = []
    for role in (
      'calls',
      'to_apply',
      'condition',
      'body',
      'true_computation',
      'false_computation',
    ):
      for m in re.finditer(rf'\b{role}=%?([\w.\-]+)', self.attributes):
        out.append((role, m.group(1)))
    m = re.search(r'branch_computations=\{([^}]*)\}', self.attributes)
    if m:
      out += [('branch', b.strip().lstrip('%')) for b in m.group(1).split(',')]
    return out


@dataclasses.dataclass
class Computation:
  """A named HLO computation and its instructions (in text order)."""

  name: str
  is_entry: bool
  instructions: list[Instruction]
  shapes: dict[str, str]  # name -> result shape, parameters included


def _split_top(text: str, open_: str, close: str) -> tuple[str, str]:
  """``'(a, (b)) rest'`` -> ``('(a, (b))', ' rest')``: a balanced prefix."""
  depth = 0
  for i, ch in enumerate(text):
    if ch in open_:
      depth += 1
    elif ch in close:
      depth -= 1
      if depth == 0:
        return text[: i + 1], text[i + 1 :]
  return text, ''


def _parse_instruction(line: str) -> Instruction | None:
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
  operands = re.findall(r'%([\w.\-]+)', args)
  return Instruction(name, shape, opcode, operands, attributes, args[1:-1])


def _parameters(header: str) -> dict[str, str]:
  """Parameter name -> shape, from a computation header."""
  inside, _ = _split_top(header[header.index('(') :], '(', ')')
  inside = inside[1:-1]
  out: dict[str, str] = {}
  depth, start = 0, 0
  for i, ch in enumerate(inside + ','):
    if ch in '([{':
      depth += 1
    elif ch in ')]}':
      depth -= 1
    elif ch == ',' and depth == 0:
      name, _, shape = inside[start:i].partition(':')
      if shape:
        out[name.strip().lstrip('%')] = shape.strip()
      start = i + 1
  return out


def parse(text: str) -> dict[str, Computation]:
  """The computations of an HLO module's text, by name.

  Example:
    >>> text = '''
    ... ENTRY %main (p: f32[4]) -> f32[4] {
    ...   %p = f32[4]{0} parameter(0)
    ...   ROOT %n = f32[4]{0} negate(%p)
    ... }'''
    >>> [i.opcode for i in parse(text)['main'].instructions]
    ['parameter', 'negate']
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
    if stripped == '}':
      computations[current.name] = current
      current = None
      continue
    inst = _parse_instruction(line)
    if inst is not None:
      current.instructions.append(inst)
      current.shapes[inst.name] = inst.shape
  return computations


def _entry(computations: dict[str, Computation]) -> Computation | None:
  return next((c for c in computations.values() if c.is_entry), None)


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
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attributes)
  if m:
    return int(m.group(1))
  called = dict(loop.called())
  cond = computations.get(called.get('condition', ''))
  if cond is None or not cond.instructions:
    return None
  by_name = {i.name: i for i in cond.instructions}
  root = cond.instructions[-1]
  if root.opcode != 'compare' or len(root.operands) != 2:
    return None
  direction = re.search(r'direction=(\w+)', root.attributes)
  lhs, rhs = (by_name.get(o) for o in root.operands)
  if lhs is None or rhs is None or direction is None:
    return None
  flipped = {'GT': 'LT', 'GE': 'LE', 'LT': 'GT', 'LE': 'GE'}
  op = direction.group(1)
  if lhs.opcode == 'constant' and rhs.opcode == 'get-tuple-element':
    lhs, rhs, op = rhs, lhs, flipped.get(op, op)
  if lhs.opcode != 'get-tuple-element' or rhs.opcode != 'constant':
    return None
  limit = _constant(rhs)
  index = re.search(r'index=(\d+)', lhs.attributes)
  if limit is None or index is None or op not in ('LT', 'LE'):
    return None
  counter = int(index.group(1))
  start = _initial_value(loop, counter, caller)
  step = _step(computations.get(called.get('body', '')), counter)
  if step is None or step <= 0:
    return None
  span = limit - start + (1 if op == 'LE' else 0)
  return max(-(-span // step), 0)


def _step(body: Computation | None, counter: int) -> int | None:
  """How much the loop body adds to its counter (XLA unrolls by 2 and adds 2)."""
  if body is None or not body.instructions:
    return None
  by_name = {i.name: i for i in body.instructions}
  root = body.instructions[-1]
  if root.opcode != 'tuple' or counter >= len(root.operands):
    return None
  update = by_name.get(root.operands[counter])
  while update is not None and update.opcode in ('copy', 'bitcast') and update.operands:
    update = by_name.get(update.operands[0])
  if update is None or update.opcode != 'add' or len(update.operands) != 2:
    return None
  steps = [_constant(by_name[o]) for o in update.operands if o in by_name]
  steps = [v for v in steps if v is not None]
  return steps[0] if len(steps) == 1 else None


def _constant(inst: Instruction) -> int | None:
  m = re.fullmatch(r'\s*(-?\d+)\s*', inst.args)
  return int(m.group(1)) if inst.opcode == 'constant' and m else None


def _initial_value(loop: Instruction, index: int, caller: Computation) -> int:
  """The loop counter's start: element ``index`` of the loop's initial tuple."""
  by_name = {i.name: i for i in caller.instructions}
  init = by_name.get(loop.operands[0]) if loop.operands else None
  if init is None or init.opcode != 'tuple' or index >= len(init.operands):
    return 0
  value = by_name.get(init.operands[index])
  while value is not None and value.opcode in ('copy', 'bitcast') and value.operands:
    value = by_name.get(value.operands[0])
  start = _constant(value) if value is not None else None
  return 0 if start is None else start


def multiplicities(
  computations: dict[str, Computation],
) -> tuple[dict[str, int], list[tuple[str, int | None]]]:
  """How many times one step runs each computation, and each loop's trips.

  A loop whose trip count cannot be told counts once (listed with None).
  """
  entry = _entry(computations)
  if entry is None:
    return {}, []
  times: dict[str, int] = {}
  loops: list[tuple[str, int | None]] = []
  order = _topological(computations, entry.name)
  times[entry.name] = 1
  for name in order:
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
  seen: set[str] = set()
  post: list[str] = []

  def visit(name: str) -> None:
    stack: list[tuple[str, Iterator[str]]] = [
      (name, iter(_callees(computations[name])))
    ]
    seen.add(name)
    while stack:
      node, it = stack[-1]
      nxt = next(it, None)
      if nxt is None:
        post.append(node)
        stack.pop()
      elif nxt in computations and nxt not in seen:
        seen.add(nxt)
        stack.append((nxt, iter(_callees(computations[nxt]))))

  visit(root)
  return post[::-1]


def _callees(comp: Computation) -> list[str]:
  return [callee for inst in comp.instructions for _, callee in inst.called()]


# Collectives
# ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
  """One collective instruction and what one step spends on it.

  Attributes:
    kind: one of :data:`COLLECTIVE_KINDS` (async start/done pairs count once).
    name: the instruction's name in the HLO.
    bytes: bytes of its larger side (the full buffer) per device, per run.
    runs: how many times a step runs it (loop trips included).
    group_size: devices in each of its groups.
    axes: the mesh axes its groups span (empty when they cannot be told).
    crosses_slices: whether a group spans slices (the data-centre network).
  """

  kind: str
  name: str
  bytes: int
  runs: int
  group_size: int
  axes: tuple[str, ...]
  crosses_slices: bool = False

  @property
  def bytes_per_step(self) -> int:
    """Bytes per device over a whole step."""
    return self.bytes * self.runs


def collectives(
  computations: dict[str, Computation],
  times: dict[str, int],
  mesh_devices: Any = None,
  axis_names: Sequence[str] = (),
) -> list[CollectiveOp]:
  """Every collective of the program, weighed by how often a step runs it."""
  grid = None if mesh_devices is None else np.asarray(mesh_devices)
  out = []
  for comp in computations.values():
    runs = times.get(comp.name, 0)
    if runs == 0:
      continue
    for inst in comp.instructions:
      kind = _OPCODE_KIND.get(inst.opcode)
      if kind is None:
        continue
      operand_bytes = sum(shape_bytes(comp.shapes.get(o, '')) for o in inst.operands)
      result = array_shapes(inst.shape)
      result_bytes = max((math.prod(d) * _itemsize(t) for t, d in result), default=0)
      size = int(max(operand_bytes, result_bytes))
      group = _first_group(inst.attributes, grid, axis_names)
      axes, crosses = _axes_of(group, grid, axis_names)
      n = len(group) if group else _group_size_fallback(inst.attributes, grid)
      out.append(CollectiveOp(kind, inst.name, size, runs, n, axes, crosses))
  return out


def _first_group(attributes: str, grid: np.ndarray | None, axis_names: Sequence[str]):
  """The device ids of the first replica group (or source/target pair)."""
  n_devices = None if grid is None else grid.size
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
  # mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}: the
  # devices laid out as an iota (reshaped, transposed) over those axes, the
  # group spanning the named ones. Without device_ids the iota is plain.
  m = re.search(
    r'replica_groups=mesh\[([^\]]*)\]'
    r'(?:,\s*device_ids=\(\[([0-9,]+)\](?:<=\[([0-9,]+)\])?(?:T\(([0-9,]+)\))?\))?'
    r'\s*\{([^}]*)\}',
    attributes,
  )
  if m and grid is not None:
    positions = [a.strip().strip("'") for a in m.group(5).split(',') if a.strip()]
    dims = [int(re.sub(r'^.*=', '', a)) for a in m.group(1).split(',') if a.strip()]
    axes = [int(p.split('_')[-1]) for p in positions if p.startswith('axis_')]
    if math.prod(dims) == grid.size:
      ids = np.arange(grid.size)
      if m.group(2):
        shape = [int(x) for x in (m.group(3) or m.group(2)).split(',')]
        ids = ids.reshape(shape)
        if m.group(4):
          ids = ids.transpose([int(x) for x in m.group(4).split(',')])
      ids = ids.reshape(dims)
      index = tuple(slice(None) if i in axes else 0 for i in range(len(dims)))
      return [int(i) for i in ids[index].reshape(-1)]
  m = re.search(r'source_target_pairs=\{\{(\d+),(\d+)\}', attributes)
  if m:
    return [int(m.group(1)), int(m.group(2))]
  if re.search(r'replica_groups=\{\}', attributes) and n_devices:
    return list(range(n_devices))
  return None


def _axes_of(
  group: list[int] | None, grid: np.ndarray | None, axis_names: Sequence[str]
) -> tuple[tuple[str, ...], bool]:
  if (
    not group or grid is None or max(group) >= grid.size or len(axis_names) != grid.ndim
  ):
    return (), False
  coords = np.array(np.unravel_index(group, grid.shape))  # (ndim, len(group))
  varying = tuple(
    name for name, row in zip(axis_names, coords) if len(set(row.tolist())) > 1
  )
  slices = {getattr(grid.flat[i], 'slice_index', 0) or 0 for i in group}
  return varying, len(slices) > 1


def _group_size_fallback(attributes: str, grid: np.ndarray | None) -> int:
  return 0 if grid is None else int(grid.size)


# Work per step
# ------------------------------------------------------------------------------


def _dot_flops(inst: Instruction, comp: Computation) -> float:
  """2 * output elements * contracted size, for dots and convolutions."""
  out = array_shapes(inst.shape)
  if not out:
    return 0.0
  out_elems = math.prod(out[0][1])
  if inst.opcode == 'dot':
    lhs = array_shapes(comp.shapes.get(inst.operands[0], '')) if inst.operands else []
    m = re.search(r'lhs_contracting_dims=\{([0-9,]*)\}', inst.attributes)
    if not lhs or m is None:
      return 0.0
    dims = [int(d) for d in m.group(1).split(',') if d]
    return 2.0 * out_elems * math.prod(lhs[0][1][d] for d in dims)
  if inst.opcode == 'convolution' and len(inst.operands) > 1:
    return _convolution_flops(inst, comp, out_elems, out[0][1])
  return 0.0


def _convolution_flops(
  inst: Instruction, comp: Computation, out_elems: int, out_dims: tuple[int, ...]
) -> float:
  """Multiply-adds of the window positions that touch real input, times 2.

  TPU programs express batched dots and weight gradients as convolutions
  with padded windows; padding positions do no work, so, like XLA's own cost
  analysis, only valid (output, window) pairs count.
  """
  lhs = array_shapes(comp.shapes.get(inst.operands[0], ''))
  rhs = array_shapes(comp.shapes.get(inst.operands[1], ''))
  m = re.search(r'dim_labels=(\w+)_(\w+)->(\w+)', inst.attributes)
  if not lhs or not rhs or m is None:
    return 0.0
  lhs_l, rhs_l, out_l = m.groups()
  lhs_d, rhs_d = lhs[0][1], rhs[0][1]
  if (len(lhs_l), len(rhs_l), len(out_l)) != (len(lhs_d), len(rhs_d), len(out_dims)):
    return 0.0
  window = re.search(r'window=\{([^}]*)\}', inst.attributes)
  fields = dict(re.findall(r'(\w+)=(\S+)', window.group(1))) if window else {}
  spatial = sorted(ch for ch in rhs_l if ch.isdigit())

  def per_dim(key: str, default: str) -> list[str]:
    return fields[key].split('x') if key in fields else [default] * len(spatial)

  stride, pad = per_dim('stride', '1'), per_dim('pad', '0_0')
  lhs_dil, rhs_dil = per_dim('lhs_dilate', '1'), per_dim('rhs_dilate', '1')
  pairs = 1
  for j, ch in enumerate(spatial):
    size_in = lhs_d[lhs_l.index(ch)]
    size_k = rhs_d[rhs_l.index(ch)]
    size_out = out_dims[out_l.index(ch)]
    lo = int(pad[j].split('_')[0])
    o = np.arange(size_out)[:, None] * int(stride[j]) - lo
    p = o + np.arange(size_k)[None, :] * int(rhs_dil[j])
    ld = int(lhs_dil[j])
    valid = (p >= 0) & (p <= (size_in - 1) * ld) & (p % ld == 0)
    pairs *= int(valid.sum())
  batch = lhs_d[lhs_l.index('b')] if 'b' in lhs_l else 1
  in_features = rhs_d[rhs_l.index('i')] if 'i' in rhs_l else 1
  out_features = rhs_d[rhs_l.index('o')] if 'o' in rhs_l else 1
  groups = re.search(r'batch_group_count=(\d+)', inst.attributes)
  if groups:  # each output feature sees one batch group
    batch //= int(groups.group(1))
  return 2.0 * batch * in_features * out_features * pairs


def _kernel_bytes(
  inst: Instruction, comp: Computation, computations: dict[str, Computation]
) -> int:
  """HBM bytes one run of a kernel reads and writes.

  Operands and results, except where a kernel touches only a slice of a
  buffer: an operand read only through ``dynamic-slice`` costs the slices,
  and a result written by ``dynamic-update-slice`` in place costs the update,
  as in XLA's own cost model. Stacked layers (``nn.scan``) read and write
  one layer's slice per trip, not the whole stack.
  """
  if inst.opcode in _FREE or inst.opcode.endswith('-done'):
    return 0
  operand_sizes = [shape_bytes(comp.shapes.get(o, '')) for o in inst.operands]
  if inst.opcode.endswith('-start'):
    arrays = array_shapes(inst.shape)
    result = max((math.prod(d) * _itemsize(t) for t, d in arrays), default=0)
    return int(sum(operand_sizes) + result)
  if inst.opcode == 'dynamic-slice':
    return 2 * shape_bytes(inst.shape)
  if inst.opcode == 'dynamic-update-slice' and len(operand_sizes) > 1:
    return 2 * operand_sizes[1]
  result = shape_bytes(inst.shape)
  called = dict(inst.called()).get('calls')
  fused = computations.get(called or '') if inst.opcode == 'fusion' else None
  if fused is None:
    return sum(operand_sizes) + result
  by_name = {i.name: i for i in fused.instructions}
  params = {
    int(i.args): i.name
    for i in fused.instructions
    if i.opcode == 'parameter' and i.args.strip().isdigit()
  }
  total = 0
  for index, size in enumerate(operand_sizes):
    read = _read_bytes(params.get(index, ''), fused, computations, depth=0)
    total += size if read is None else min(read, size)
  root = fused.instructions[-1] if fused.instructions else None
  roots = (
    [by_name.get(o) for o in root.operands]
    if root is not None and root.opcode == 'tuple'
    else [root]
  )
  for r in roots:
    if r is not None and r.opcode == 'dynamic-update-slice' and len(r.operands) > 1:
      total += shape_bytes(fused.shapes.get(r.operands[1], ''))
    elif r is not None and r.opcode == 'bitcast' and r.operands:
      inner = by_name.get(r.operands[0])
      if inner is not None and inner.opcode == 'dynamic-update-slice':
        total += shape_bytes(fused.shapes.get(inner.operands[1], ''))
      else:
        total += shape_bytes(r.shape)
    elif r is not None:
      total += shape_bytes(r.shape)
  return total


def _read_bytes(
  name: str, comp: Computation, computations: dict[str, Computation], depth: int
) -> int | None:
  """Bytes a fused computation reads of its parameter ``name``: the slices
  when it is only sliced (also inside nested fusions), 0 when it is only
  updated in place, None when it is read whole."""
  uses = [i for i in comp.instructions if name in i.operands]
  if not uses or depth > 4:
    return None
  total = 0
  for u in uses:
    if u.opcode == 'dynamic-slice' and u.operands[0] == name:
      total += shape_bytes(u.shape)
    elif u.opcode == 'dynamic-update-slice' and u.operands[0] == name:
      continue  # updated in place: the write is the result's
    elif u.opcode == 'fusion':
      inner = computations.get(dict(u.called()).get('calls', ''))
      if inner is None:
        return None
      params = {
        int(i.args): i.name
        for i in inner.instructions
        if i.opcode == 'parameter' and i.args.strip().isdigit()
      }
      for k, operand in enumerate(u.operands):
        if operand == name:
          read = _read_bytes(params.get(k, ''), inner, computations, depth + 1)
          if read is None:
            return None
          total += read
    else:
      return None
  return total


@dataclasses.dataclass(frozen=True)
class ProgramSummary:
  """What one step of a compiled program does beyond its memory figures.

  Attributes:
    collectives: every collective instruction, weighed by its runs per step.
    loops: ``(while instruction, trip count or None)`` for every loop.
    extra_flops: flops of the loop trips ``cost_analysis`` leaves out.
    extra_bytes: HBM bytes of those trips (operands and results of each
      kernel, as XLA counts them).
    hlo_flops: flops of one pass over the program text, by the same count
      (to compare with XLA's own).
  """

  collectives: tuple[CollectiveOp, ...]
  loops: tuple[tuple[str, int | None], ...]
  extra_flops: float
  extra_bytes: float
  hlo_flops: float

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form (cached with a compiled program's figures)."""
    return {
      'collectives': [dataclasses.asdict(c) for c in self.collectives],
      'loops': [list(loop) for loop in self.loops],
      'extra_flops': self.extra_flops,
      'extra_bytes': self.extra_bytes,
      'hlo_flops': self.hlo_flops,
    }

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> ProgramSummary:
    """Inverse of :meth:`to_dict`."""
    return cls(
      tuple(CollectiveOp(**{**c, 'axes': tuple(c['axes'])}) for c in d['collectives']),
      tuple((name, n) for name, n in d['loops']),
      d['extra_flops'],
      d['extra_bytes'],
      d['hlo_flops'],
    )


def summarize(
  text: str, mesh_devices: Any = None, axis_names: Sequence[str] = ()
) -> ProgramSummary:
  """Collectives, loops and the work ``cost_analysis`` misses, from HLO text.

  Example:
    >>> text = '''
    ... %add (a: f32[], b: f32[]) -> f32[] {
    ...   %a = f32[] parameter(0)
    ...   %b = f32[] parameter(1)
    ...   ROOT %s = f32[] add(%a, %b)
    ... }
    ... %cond (p: (s32[], f32[8])) -> pred[] {
    ...   %p = (s32[], f32[8]) parameter(0)
    ...   %i = s32[] get-tuple-element(%p), index=0
    ...   %n = s32[] constant(4)
    ...   ROOT %lt = pred[] compare(%i, %n), direction=LT
    ... }
    ... %body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
    ...   %p = (s32[], f32[8]) parameter(0)
    ...   %i = s32[] get-tuple-element(%p), index=0
    ...   %x = f32[8] get-tuple-element(%p), index=1
    ...   %r = f32[8] all-reduce(%x), replica_groups={{0,1}}, to_apply=%add
    ...   %one = s32[] constant(1)
    ...   %j = s32[] add(%i, %one)
    ...   ROOT %t = (s32[], f32[8]) tuple(%j, %r)
    ... }
    ... ENTRY %main (x: f32[8]) -> (s32[], f32[8]) {
    ...   %x = f32[8] parameter(0)
    ...   %z = s32[] constant(0)
    ...   %t = (s32[], f32[8]) tuple(%z, %x)
    ...   ROOT %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body
    ... }'''
    >>> s = summarize(text)
    >>> s.loops, [(c.kind, c.bytes, c.runs) for c in s.collectives]
    ((('w', 4),), [('all-reduce', 32, 4)])
  """
  computations = parse(text)
  times, loops = multiplicities(computations)
  ops = collectives(computations, times, mesh_devices, axis_names)
  # Kernels' own computations: their traffic is their caller's operands and
  # result, counted where they are called.
  fused = {
    callee
    for comp in computations.values()
    for inst in comp.instructions
    for role, callee in inst.called()
    if role in ('calls', 'to_apply') and inst.opcode not in ('call', 'async-start')
  }
  extra_flops = extra_bytes = hlo_flops = 0.0
  for comp in computations.values():
    runs = times.get(comp.name, 0)
    flops = sum(_dot_flops(i, comp) for i in comp.instructions)
    hlo_flops += flops if runs else 0.0
    if runs > 1:
      extra_flops += (runs - 1) * flops
      if comp.name not in fused:
        kernels = sum(_kernel_bytes(i, comp, computations) for i in comp.instructions)
        extra_bytes += (runs - 1) * kernels
  return ProgramSummary(tuple(ops), tuple(loops), extra_flops, extra_bytes, hlo_flops)
