"""Estimating a step's memory per chip where nothing can compile for the target.

For an ``AbstractMesh`` (a GPU pod, or any mesh planned from a laptop) there
is no compiler to ask, so ``fit`` estimates:

* parameters, optimizer state, batch and gradients exactly, from the plan of
  each argument (gradients are laid out like their parameters);
* everything else (the activations kept for the backward pass, workspace) by
  walking the traced step in program order and keeping the bytes of every
  live value, each freed after its last use, donated arguments included until
  theirs; the peak is what the chip must hold.

Each value's bytes per chip follow its sharding: exact under Explicit mesh
axes (the traced types carry it); under Auto axes, propagated from the
arguments' layouts and the constraints inside the step, forward (elementwise
ops keep their most sharded operand's, a matmul takes its operands' free
dimensions', reductions drop theirs) and back from the step's output layouts
(a gradient flowing into the updated parameters is laid out like them); a
value nothing tells about is counted replicated, and the report says how
much that was. Broadcasts, and elementwise results used once, are fused
into their consumers as XLA does. XLA also reorders and rematerialises on
its own, so the estimate can land on either side of the compiled figure;
``BENCHMARKS.md`` gives its measured error.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.sharding import PartitionSpec

from flax_shardmeta._planning import report as rep
from flax_shardmeta._planning.chips import Chip
from flax_shardmeta._planning.step import Step, input_shardings, prepare
from flax_shardmeta._specs import mesh_axes_of

Spec = tuple[Any, ...] | None  # one entry per dimension; None: unknown


@dataclasses.dataclass
class _Walk:
  """Running totals of one liveness walk."""

  sizes: dict[str, int]
  unknown_bytes: float = 0.0
  at_peak: list[tuple[int, str]] = dataclasses.field(default_factory=list)

  def nbytes(self, aval: Any, spec: Spec) -> int:
    shape = getattr(aval, 'shape', None)
    dtype = getattr(aval, 'dtype', None)
    if shape is None or dtype is None:
      return 0
    try:
      itemsize = np.dtype(dtype).itemsize
    except TypeError:  # key arrays and other extended dtypes
      itemsize = 8
    if spec is None:
      return math.prod(shape) * itemsize
    shard = [
      -(-n // math.prod(self.sizes.get(a, 1) for a in mesh_axes_of(e)))
      for n, e in zip(shape, spec)
    ]
    return math.prod(shard) * itemsize


def _aval_spec(aval: Any) -> Spec:
  """The sharding a traced type carries (Explicit axes), else None."""
  sharding = getattr(aval, 'sharding', None)
  spec = getattr(sharding, 'spec', None)
  if spec is None or not getattr(aval, 'shape', None):
    return None
  entries = tuple(spec) + (None,) * (len(aval.shape) - len(spec))
  if all(e is None for e in entries):
    return None  # Auto axes: the type says nothing
  return entries


def _unique(entries: Sequence[Any]) -> tuple[Any, ...]:
  """Drops mesh axes used by an earlier dimension (a spec uses each once)."""
  used: set[str] = set()
  out = []
  for e in entries:
    axes = [a for a in mesh_axes_of(e) if a not in used]
    used.update(axes)
    out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  return tuple(out)


def _ways(spec: Spec, sizes: dict[str, int]) -> int:
  """Into how many shards a layout splits its array."""
  if spec is None:
    return 1
  return math.prod(sizes.get(a, 1) for e in spec for a in mesh_axes_of(e))


def _propagate(eqn: Any, ins: list[Spec], sizes: dict[str, int]) -> list[Spec]:
  """Output specs of one equation from its operands' (Auto axes)."""
  name = eqn.primitive.name
  outs: Any = eqn.outvars
  if name == 'sharding_constraint':
    spec = getattr(eqn.params.get('sharding'), 'spec', None)
    if spec is not None:
      rank = len(outs[0].aval.shape)
      return [_unique(tuple(spec) + (None,) * (rank - len(spec)))]
  if name == 'dot_general' and len(ins) == 2:
    (lc, rc), (lb, rb) = eqn.params['dimension_numbers']
    lhs, rhs = ins
    lrank, rrank = len(eqn.invars[0].aval.shape), len(eqn.invars[1].aval.shape)
    lhs = lhs or (None,) * lrank
    rhs = rhs or (None,) * rrank
    batch = [lhs[d] for d in lb]
    lfree = [lhs[d] for d in range(lrank) if d not in lc and d not in lb]
    rfree = [rhs[d] for d in range(rrank) if d not in rc and d not in rb]
    return [_unique(batch + lfree + rfree)]
  if name == 'transpose' and ins and ins[0] is not None:
    return [tuple(ins[0][d] for d in eqn.params['permutation'])]
  if name == 'broadcast_in_dim' and ins and ins[0] is not None:
    rank = len(outs[0].aval.shape)
    placed: list[Any] = [None] * rank
    for src, dst in enumerate(eqn.params['broadcast_dimensions']):
      if eqn.invars[0].aval.shape[src] == outs[0].aval.shape[dst]:
        placed[dst] = ins[0][src]
    return [tuple(placed)]
  if name == 'reshape' and ins and ins[0] is not None:
    return [_reshape_spec(eqn.invars[0].aval.shape, outs[0].aval.shape, ins[0])]
  if name.startswith('reduce_') or name in ('argmax', 'argmin'):
    axes = set(eqn.params.get('axes', ()))
    if ins and ins[0] is not None:
      kept = tuple(e for d, e in enumerate(ins[0]) if d not in axes)
      return [kept] * len(outs)
  # Same rank as an operand with a known layout: elementwise, slicing,
  # casts, concatenation, padding... keep the most sharded such operand's
  # layout, as XLA's propagation does.
  result: list[Spec] = []
  for v in outs:
    rank = len(getattr(v.aval, 'shape', ()))
    known = [
      s
      for s, iv in zip(ins, eqn.invars)
      if s is not None and len(getattr(iv.aval, 'shape', ())) == rank
    ]
    result.append(max(known, key=lambda s: _ways(s, sizes)) if known else None)
  return result


def _reshape_spec(
  shape_in: tuple[int, ...], shape_out: tuple[int, ...], spec: tuple[Any, ...]
) -> tuple[Any, ...]:
  """A reshape's output layout: dimensions grouped into blocks of equal size;
  a block keeps the layout of its major input dimension on its major output
  dimension when that divides, and is replicated otherwise."""
  out: list[Any] = [None] * len(shape_out)
  i = j = 0
  while i < len(shape_in) and j < len(shape_out):
    i1, j1 = i + 1, j + 1
    pin, pout = shape_in[i], shape_out[j]
    while pin != pout:
      if pin < pout and i1 < len(shape_in):
        pin *= shape_in[i1]
        i1 += 1
      elif j1 < len(shape_out):
        pout *= shape_out[j1]
        j1 += 1
      else:
        return tuple(out)
    major = spec[i]
    rest_sharded = any(e is not None for e in spec[i + 1 : i1])
    if major is not None and not rest_sharded and shape_out[j] % shape_in[i] == 0:
      out[j] = major
    elif i1 - i == 1 and j1 - j == 1:
      out[j] = spec[i]
    i, j = i1, j1
  return tuple(out)


# XLA fuses these into their consumers: their results are never materialised.
_FUSED = frozenset({'broadcast_in_dim', 'iota'})

# Elementwise work XLA fuses with its producer: a value whose only use is one
# of these (or a reduction) never gets a buffer of its own.
_ELEMENTWISE = frozenset(
  'abs add and atan2 ceil clamp convert_element_type cos div eq erf erf_inv exp '
  'exp2 expm1 floor ge gt integer_pow is_finite le log log1p logistic lt max min '
  'mul ne neg not or pow rem round rsqrt select_n sign sin sqrt square stop_gradient '
  'sub tan tanh xor copy reduce_precision'.split()
)


def _fused_uses(jaxpr: Any) -> set[Any]:
  """Values used exactly once, by an elementwise op or a reduction."""
  uses: dict[Any, int] = {}
  fusing: dict[Any, bool] = {}
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    fuses = name in _ELEMENTWISE or name.startswith('reduce_')
    for v in eqn.invars:
      if isinstance(v, jex_core.Var):
        uses[v] = uses.get(v, 0) + 1
        fusing[v] = fuses
  outputs = {v for v in jaxpr.outvars if isinstance(v, jex_core.Var)}
  return {v for v, n in uses.items() if n == 1 and fusing[v] and v not in outputs}


def _sub_jaxprs(eqn: Any) -> list[tuple[Any, str]]:
  """``(jaxpr, how its inputs map)`` for every sub-program of an equation."""
  name = eqn.primitive.name
  found = []
  for key, value in eqn.params.items():
    values = value if isinstance(value, (tuple, list)) else (value,)
    for v in values:
      inner = getattr(v, 'jaxpr', v)
      if isinstance(inner, jex_core.Jaxpr):
        if name == 'while' and key == 'cond_jaxpr':
          continue  # tiny, and its outputs are not the loop's
        how = {'scan': 'scan', 'while': 'while', 'cond': 'cond'}.get(name, 'call')
        if name == 'shard_map':
          how = 'local'
        found.append((inner, how))
  return found


def scan_split(params: dict[str, Any]) -> tuple[int, int]:
  """A scan's number of constant and carried operands (the rest are scanned).

  jax up to 0.10 records them as ``num_consts`` / ``num_carry``; newer jax
  records the operand tree ``ft_in`` = (consts, carry, xs) instead.
  """
  if 'num_consts' in params:
    return int(params['num_consts']), int(params['num_carry'])
  tree = params.get('ft_in')
  if tree is not None:
    consts, carry, _ = tree.unpack()
    return len(list(consts.vals)), len(list(carry.vals))
  return 0, 0


def _inner_specs(eqn: Any, how: str, ins: list[Spec], inner: Any) -> list[Spec]:
  n = len(inner.invars)
  if how == 'local':
    return [tuple([None] * len(getattr(v.aval, 'shape', ()))) for v in inner.invars]
  if how == 'scan':
    n_consts, n_carry = scan_split(eqn.params)
    consts = n_consts + n_carry
    return [s if i < consts or s is None else s[1:] for i, s in enumerate(ins)][:n]
  if how == 'while':
    skip = eqn.params.get('cond_nconsts', 0)
    return ins[skip : skip + n] if len(ins) >= skip + n else [None] * n
  if how == 'cond':
    return ins[1 : 1 + n]
  return ins[:n] if len(ins) == n else [None] * n


def _walk(
  jaxpr: Any,
  in_specs: list[Spec],
  w: _Walk,
  counted: frozenset[Any] = frozenset(),
  in_virtual: Sequence[bool] = (),
  top: bool = False,
  out_hints: Sequence[Spec] = (),
) -> tuple[list[Spec], int, list[bool]]:
  """Output specs, the peak bytes of values live inside ``jaxpr``, and which
  outputs are virtual (fused broadcasts XLA never materialises).

  Layouts go forward from the inputs, then backward from ``out_hints`` (the
  step's out_shardings) through elementwise ops, as XLA's own propagation
  goes both ways: a gradient flowing into the updated parameters is laid out
  like them. Inputs in ``counted`` (donated arguments) count from the start
  and are freed after their last use; the others belong to the caller.
  """
  virtual: set[Any] = {v for v, flag in zip(jaxpr.invars, in_virtual) if flag}
  spec_of: dict[Any, Spec] = {}
  for v, s in zip(jaxpr.invars, in_specs):
    spec_of[v] = _aval_spec(v.aval) or s
  for v in jaxpr.constvars:
    spec_of[v] = _aval_spec(v.aval)
  inner_peaks: list[int] = []
  for eqn in jaxpr.eqns:  # forward: layouts and what is virtual
    peak_here, fused = _forward(eqn, spec_of, virtual, w)
    inner_peaks.append(peak_here)
    virtual.update(v for v, f in zip(eqn.outvars, fused) if f)
  _backward(jaxpr, spec_of, out_hints, w)
  fused_away = _fused_uses(jaxpr)
  last: dict[Any, int] = {}
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if isinstance(v, jex_core.Var):
        last[v] = i
  for v in jaxpr.outvars:
    if isinstance(v, jex_core.Var):
      last[v] = len(jaxpr.eqns)
  size: dict[Any, int] = {}
  live = 0
  for v in jaxpr.invars:
    if v in counted:
      size[v] = w.nbytes(v.aval, spec_of.get(v))
      live += size[v]
  peak = live
  for i, eqn in enumerate(jaxpr.eqns):  # liveness
    out_bytes = 0
    for v in eqn.outvars:
      s = spec_of.get(v)
      free = v in virtual or (
        v in fused_away and eqn.primitive.name in _ELEMENTWISE  # its consumer's buffer
      )
      size[v] = 0 if free else w.nbytes(v.aval, s)
      if s is None and getattr(v.aval, 'shape', ()) and not free:
        w.unknown_bytes = max(w.unknown_bytes, size[v])
      out_bytes += size[v]
    during = live + inner_peaks[i] + out_bytes
    if top and during > peak:
      largest = sorted(size.items(), key=lambda kv: -kv[1])[:6]
      w.at_peak = [(b, f'{v.aval.str_short()} ({_where(eqn)})') for v, b in largest]
    peak = max(peak, during)
    live += out_bytes
    for v in list(eqn.invars) + list(eqn.outvars):
      if isinstance(v, jex_core.Var) and last.get(v, -1) <= i and v in size:
        live -= size.pop(v)
  out_specs = [
    spec_of.get(v) if isinstance(v, jex_core.Var) else None for v in jaxpr.outvars
  ]
  out_virtual = [isinstance(v, jex_core.Var) and v in virtual for v in jaxpr.outvars]
  return out_specs, peak, out_virtual


def _forward(
  eqn: Any, spec_of: dict[Any, Spec], virtual: set[Any], w: _Walk
) -> tuple[int, list[bool]]:
  """Sets the layouts of ``eqn``'s outputs; returns the peak inside it (its
  sub-programs') and which outputs are virtual."""
  ins = [spec_of.get(v) if isinstance(v, jex_core.Var) else None for v in eqn.invars]
  outs = [_aval_spec(v.aval) for v in eqn.outvars]
  inner_peak = 0
  subs = _sub_jaxprs(eqn)
  in_flags = [isinstance(v, jex_core.Var) and v in virtual for v in eqn.invars]
  out_virtual = [False] * len(eqn.outvars)
  for inner, how in subs:
    inner_specs = _inner_specs(eqn, how, ins, inner)
    flags = in_flags if how == 'call' else []
    inner_outs, inner_live, inner_virtual = _walk(
      inner, inner_specs, w, in_virtual=flags
    )
    inner_peak = max(inner_peak, inner_live)
    if how == 'call' and len(inner_virtual) == len(out_virtual):
      out_virtual = inner_virtual
    if how in ('call', 'while') and len(inner_outs) == len(outs):
      outs = [o or s for o, s in zip(outs, inner_outs)]
    elif how == 'scan':
      carry = scan_split(eqn.params)[1]
      outs = [
        o or (s if j < carry or s is None else (None, *s))
        for j, (o, s) in enumerate(zip(outs, inner_outs))
      ]
  if not subs:
    outs = [o or d for o, d in zip(outs, _propagate(eqn, ins, w.sizes))]
    if eqn.primitive.name in _FUSED or (
      eqn.invars and all(_scalar_or(v, virtual) for v in eqn.invars)
    ):
      out_virtual = [True] * len(eqn.outvars)
  for v, s in zip(eqn.outvars, outs):
    spec_of[v] = s
  return inner_peak, out_virtual


def _shard_factor(spec: Spec, w: _Walk) -> int:
  return _ways(spec, w.sizes)


def _backward(
  jaxpr: Any, spec_of: dict[Any, Spec], out_hints: Sequence[Spec], w: _Walk
) -> None:
  """Layouts from the outputs back through elementwise ops, where sharper."""

  def offer(v: Any, spec: Spec) -> None:
    if not isinstance(v, jex_core.Var) or spec is None:
      return
    if len(spec) != len(getattr(v.aval, 'shape', ())):
      return
    if _shard_factor(spec, w) > _shard_factor(spec_of.get(v), w):
      spec_of[v] = spec

  for v, hint in zip(jaxpr.outvars, out_hints):
    offer(v, hint)
  for eqn in reversed(jaxpr.eqns):
    name = eqn.primitive.name
    if name == 'transpose':
      spec = spec_of.get(eqn.outvars[0])
      if spec is not None:
        inverse = [0] * len(spec)
        for dst, src in enumerate(eqn.params['permutation']):
          inverse[src] = dst
        offer(eqn.invars[0], tuple(spec[d] for d in inverse))
      continue
    calls = any(how == 'call' for _, how in _sub_jaxprs(eqn))
    passes = name in _ELEMENTWISE or name in ('add_any', 'sharding_constraint')
    if not passes and not calls:
      continue
    for out in eqn.outvars:
      spec = spec_of.get(out)
      for v in eqn.invars:
        if getattr(v, 'aval', None) is not None and v.aval.shape == out.aval.shape:
          offer(v, spec)


def _where(eqn: Any) -> str:
  """Where in the step the peak is: the op and its name stack."""
  names = str(getattr(eqn.source_info, 'name_stack', '') or '')
  return f'at {eqn.primitive.name} in {names}' if names else f'at {eqn.primitive.name}'


def _scalar_or(v: Any, virtual: set[Any]) -> bool:
  """A literal, a scalar, or a virtual value: nothing that forces a buffer."""
  if not isinstance(v, jex_core.Var):
    return True
  return v in virtual or not getattr(v.aval, 'shape', ())


def _dot_flops(eqn: Any) -> float:
  (lc, _), _ = eqn.params['dimension_numbers']
  lhs = eqn.invars[0].aval.shape
  out = eqn.outvars[0].aval.shape
  return 2.0 * math.prod(out) * math.prod(lhs[d] for d in lc)


def _scan_factor(jaxpr: Any) -> float:
  """Flops of loop bodies run ``length`` times (the walk counts them once)."""
  total = 0.0
  for eqn in jaxpr.eqns:
    subs = _sub_jaxprs(eqn)
    if eqn.primitive.name == 'dot_general':
      total += _dot_flops(eqn)
    for inner, how in subs:
      times = eqn.params.get('length', 1) if how == 'scan' else 1
      total += times * _scan_factor(inner)
  return total


def estimate(
  target: Step, args: Sequence[Any], capacity: int | None, chip: Chip | None
) -> rep.FitReport:
  """The estimated :class:`FitReport` of ``target`` (see the module doc)."""
  mesh = target.mesh
  arguments = prepare(target, args)
  traced = target.trace(*arguments.lowered)
  closed = traced.jaxpr
  donated = [
    bool(getattr(a, 'donated', False))
    for a in jax.tree_util.tree_leaves(traced.args_info)
  ]
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  w = _Walk(sizes)
  jaxpr = closed.jaxpr
  in_specs: list[Spec] = _input_specs(target, arguments.lowered)
  if len(in_specs) != len(jaxpr.invars):
    in_specs = [None for _ in jaxpr.invars]
  # Donated arguments are freed after their last use; the others stay all step.
  flags = donated + [False] * (len(jaxpr.invars) - len(donated))
  kept_bytes = sum(
    w.nbytes(v.aval, _aval_spec(v.aval) or spec)
    for v, spec, gone in zip(jaxpr.invars, in_specs, flags)
    if not gone
  )
  counted = frozenset(v for v, gone in zip(jaxpr.invars, flags) if gone)
  hints = _output_specs(target, len(jaxpr.outvars))
  out_specs, peak, _ = _walk(jaxpr, in_specs, w, counted, top=True, out_hints=hints)
  total = kept_bytes + peak
  by_category = {rep.PARAMETERS: 0, rep.OPTIMIZER: 0, rep.INPUTS: 0}
  leaf_bytes = [
    w.nbytes(v.aval, _aval_spec(v.aval) or spec)
    for v, spec in zip(jaxpr.invars, in_specs)
  ]
  if len(leaf_bytes) != len(arguments.categories):
    leaf_bytes = list(arguments.plan_bytes)
  for c, b in zip(arguments.categories, leaf_bytes):
    by_category[c] += b
  out_bytes = sum(
    w.nbytes(v.aval, _aval_spec(v.aval) or spec)
    for v, spec in zip(jaxpr.outvars, out_specs)
  )
  donated_bytes = sum(b for b, d in zip(leaf_bytes, flags) if d)
  not_donated = max(out_bytes - donated_bytes, 0)
  gradients = by_category[rep.PARAMETERS] if by_category[rep.OPTIMIZER] else 0
  known = sum(by_category.values()) + gradients + not_donated
  rows = (
    rep.Row(rep.PARAMETERS, by_category[rep.PARAMETERS], 'exact, by the plan'),
    rep.Row(rep.OPTIMIZER, by_category[rep.OPTIMIZER], 'exact, by the plan'),
    rep.Row(rep.INPUTS, by_category[rep.INPUTS], 'exact, by the plan'),
    rep.Row(rep.GRADIENTS, gradients, 'exact: laid out like the parameters'),
    rep.Row(rep.OUTPUTS, not_donated, 'outputs minus donated arguments'),
    rep.Row(
      rep.ACTIVATIONS,
      max(total - known, 0),
      'estimated: peak of live values in program order',
    ),
  )
  total_bytes = sum(r.bytes for r in rows)
  axis_types = {str(t).split('.')[-1] for t in getattr(mesh, 'axis_types', ())}
  how = (
    'Explicit axes: every value carries its sharding'
    if axis_types == {'Explicit'}
    else 'Auto axes: shardings propagated from the arguments and constraints'
  )
  notes = [
    f'estimate ({how}): XLA fuses, reorders and rematerialises on its own, so '
    'the compiled program may need more or less (see BENCHMARKS.md for the '
    'measured error)'
  ]
  if w.unknown_bytes:
    notes.append(
      'some intermediate values have no layout the step tells (largest '
      f'{w.unknown_bytes / 2**20:.1f} MiB); they were counted replicated'
    )
  hbm = capacity if capacity is not None else (chip.hbm_bytes if chip else None)
  flops = _scan_factor(jaxpr) / max(math.prod(mesh.axis_sizes), 1)
  return rep.FitReport(
    source='estimate',
    method='no compiler for this mesh: arguments and gradients by the plan, '
    'activations by a liveness walk over the traced step',
    mesh=dict(sizes),
    devices=f'an abstract mesh of {math.prod(mesh.axis_sizes)} devices'
    + (f' ({chip.name})' if chip else ''),
    chip=chip,
    rows=rows,
    total_bytes=total_bytes,
    hbm_bytes=hbm,
    memory_analysis=None,
    donated_bytes=int(min(donated_bytes, out_bytes)),
    collectives=(),
    flops=flops,
    bytes_accessed=None,
    cost_analysis=None,
    roofline=None,
    notes=tuple(notes),
  )


def _output_specs(target: Any, n: int) -> list[Spec]:
  """Each output leaf's layout from the step's out_shardings (None if unknown)."""
  given = getattr(target.step, 'out_shardings', None)
  if given is None:
    return [None] * n
  flat = jax.tree_util.tree_leaves(
    given, is_leaf=lambda x: x is None or isinstance(x, jax.sharding.Sharding)
  )
  if len(flat) != n:
    return [None] * n
  return [tuple(s.spec) if getattr(s, 'spec', None) is not None else None for s in flat]


def _input_specs(target: Step, lowered: Sequence[Any]) -> list[Spec]:
  """Each argument leaf's layout: the step's in_shardings, else its own."""
  leaves = jax.tree_util.tree_leaves(lowered)
  given = input_shardings(target, lowered)
  if len(given) != len(leaves):
    given = [None] * len(leaves)
  out: list[Spec] = []
  for leaf, sharding in zip(leaves, given):
    spec = getattr(sharding, 'spec', None)
    shape = getattr(leaf, 'shape', None)
    if spec is not None and shape is not None:
      out.append(tuple(spec) + (None,) * (len(shape) - len(spec)))
    else:
      out.append(_leaf_spec(leaf))
  return out


def _leaf_spec(x: Any) -> Spec:
  sharding = getattr(x, 'sharding', None)
  spec = getattr(sharding, 'spec', None)
  shape = getattr(x, 'shape', None)
  if spec is None or shape is None:
    return None
  if not isinstance(spec, PartitionSpec):
    return None
  return tuple(spec) + (None,) * (len(shape) - len(spec))
