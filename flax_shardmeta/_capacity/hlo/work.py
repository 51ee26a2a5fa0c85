"""The work of a compiled program's kernels: flops of dots and convolutions,
and the HBM bytes each kernel reads and writes."""

from __future__ import annotations

import math

import numpy as np

from flax_shardmeta._programs.hlo_text import (
  Computation,
  Instruction,
  array_shapes,
  itemsize,
  largest_array_bytes,
  shape_bytes,
)

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


def dot_flops(inst: Instruction, comp: Computation) -> float:
  """2 * output elements * contracted size, for dots and convolutions."""
  out = array_shapes(inst.shape)
  if not out:
    return 0.0
  out_elems = math.prod(out[0][1])
  if inst.opcode == 'dot':
    lhs = array_shapes(comp.shapes.get(inst.operands[0], '')) if inst.operands else []
    dims = inst.int_list('lhs_contracting_dims')
    if not lhs or dims is None:
      return 0.0
    return 2.0 * out_elems * math.prod(lhs[0][1][d] for d in dims)
  if inst.opcode == 'convolution' and len(inst.operands) > 1:
    return _convolution_flops(inst, comp, out[0][1])
  library = inst.library_matmul_contracting()
  if library is not None and inst.operands:
    # A GPU matmul compiled as a cuBLAS call: XLA's cost model counts none.
    lhs = array_shapes(comp.shapes.get(inst.operands[0], ''))
    if lhs and all(d < len(lhs[0][1]) for d in library):
      return 2.0 * out_elems * math.prod(lhs[0][1][d] for d in library)
  return 0.0


def _convolution_flops(
  inst: Instruction, comp: Computation, out_dims: tuple[int, ...]
) -> float:
  """Multiply-adds of the window positions that touch real input, times 2.

  TPU programs express batched dots and weight gradients as convolutions
  with padded windows; padding positions do no work, so, like XLA's own cost
  analysis, only valid (output, window) pairs count.
  """
  lhs = array_shapes(comp.shapes.get(inst.operands[0], ''))
  rhs = array_shapes(comp.shapes.get(inst.operands[1], ''))
  labels = inst.dim_labels()
  if not lhs or not rhs or labels is None:
    return 0.0
  lhs_l, rhs_l, out_l = labels
  lhs_d, rhs_d = lhs[0][1], rhs[0][1]
  if (len(lhs_l), len(rhs_l), len(out_l)) != (len(lhs_d), len(rhs_d), len(out_dims)):
    return 0.0
  fields = inst.window()
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
  groups = inst.int_attribute('batch_group_count')
  if groups:  # each output feature sees one batch group
    batch //= groups
  return 2.0 * batch * in_features * out_features * pairs


def kernel_bytes(
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
    return int(sum(operand_sizes) + largest_array_bytes(inst.shape))
  if inst.opcode == 'dynamic-slice':
    return 2 * shape_bytes(inst.shape)
  if inst.opcode == 'dynamic-update-slice' and len(operand_sizes) > 1:
    return 2 * operand_sizes[1]
  if inst.library_matmul_contracting() is not None:
    # The product; the library's workspace (the second result) is scratch.
    product = array_shapes(inst.shape)[:1]
    return sum(operand_sizes) + sum(int(math.prod(d) * itemsize(t)) for t, d in product)
  called = dict(inst.called()).get('calls')
  fused = computations.get(called or '') if inst.opcode == 'fusion' else None
  if fused is None:
    return sum(operand_sizes) + shape_bytes(inst.shape)
  params = _parameters(fused)
  total = 0
  for index, size in enumerate(operand_sizes):
    read = _read_bytes(params.get(index, ''), fused, computations, depth=0)
    total += size if read is None else min(read, size)
  return total + _written_bytes(fused)


def _parameters(comp: Computation) -> dict[int, str]:
  """Parameter number -> instruction name."""
  out = {}
  for i in comp.instructions:
    number = i.parameter_number()
    if number is not None:
      out[number] = i.name
  return out


def _written_bytes(fused: Computation) -> int:
  """Bytes a fused kernel writes: its results, or only the update of each
  result it writes in place."""
  by_name = {i.name: i for i in fused.instructions}
  root = fused.instructions[-1] if fused.instructions else None
  roots = (
    [by_name.get(o) for o in root.operands]
    if root is not None and root.opcode == 'tuple'
    else [root]
  )
  total = 0
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
      params = _parameters(inner)
      for k, operand in enumerate(u.operands):
        if operand == name:
          read = _read_bytes(params.get(k, ''), inner, computations, depth + 1)
          if read is None:
            return None
          total += read
    else:
      return None
  return total
