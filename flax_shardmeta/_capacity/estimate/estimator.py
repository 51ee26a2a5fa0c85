"""Estimating a step's memory per chip where nothing can compile for the target.

For an ``AbstractMesh`` (a GPU pod, or any mesh planned from a laptop) there
is no compiler to ask, so ``fit`` estimates:

* parameters, optimizer state, RNG state, batch and gradients exactly, from
  the layout of each argument (gradients are laid out like their parameters);
* everything else (the activations kept for the backward pass, workspace) by
  walking the traced step in program order and keeping the bytes of every
  live value, each freed after its last use, donated arguments included until
  theirs (``_capacity.estimate.liveness``); the peak is what the chip must hold.

Each value's bytes per chip follow its layout (``_capacity.estimate.propagate``): exact
under Explicit mesh axes, propagated under Auto axes; a value nothing tells
about is counted replicated, and the report lists each such value with the
line that makes it (``_capacity.estimate.unplaced``) and how much of the peak rests on
them. XLA also reorders and rematerialises on its own, so the estimate can
land on either side of the compiled figure; ``BENCHMARKS.md`` gives its
measured error.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from flax_shardmeta._capacity import vocabulary as vocab
from flax_shardmeta._capacity.estimate.coverage import unmeasured
from flax_shardmeta._capacity.estimate.liveness import Walk, walk
from flax_shardmeta._capacity.estimate.propagate import Spec, aval_spec
from flax_shardmeta._capacity.estimate.unplaced import Key
from flax_shardmeta._capacity.fit.traced_step import (
  Step,
  input_shardings,
  jit_shardings,
  prepare,
)
from flax_shardmeta._capacity.peak.holders import estimated_peak
from flax_shardmeta._capacity.report import FitReport
from flax_shardmeta._devices.chips import Chip
from flax_shardmeta._devices.gpu import GPUS
from flax_shardmeta._programs.jaxprs import sub_jaxprs

ERROR_BANDS: dict[str, tuple[float, float]] = {
  'tpu': (0.25, 0.41),
  'gpu': (0.33, 0.27),
}
"""The estimate's measured error of the total against the compiled step, by
platform: ``(below, above)``, the most it has come out under and over the
compiled figure (BENCHMARKS.md, "Will it fit": the estimate tables' error
columns, over 24 configurations on v5p:2x2x2 and on h100:1x8: an MLP,
Llama-3 8B and 70B cut to a few layers, a T5-style encoder-decoder, a
mixture-of-experts decoder and a GPT of plain flax layers unrolled in Python,
remat none and full, on two meshes; a test keeps the two the same). A limit
inside that band of the estimate is too close to call. A step with what none
of those models has (``coverage.unmeasured``) is told it is outside them."""


GPU_MATMUL_WORKSPACE = 4 << 20
"""Bytes of the workspace XLA's GPU compiler gives each cuBLAS-Lt matmul (an
``s8[4194304]`` output of every ``__cublas$lt$matmul`` call in programs
compiled for h100; the calls run one at a time, so one is live at the
peak)."""


def error_band(platform: str) -> tuple[float, float]:
  """The estimate's measured ``(below, above)`` error on ``platform``
  (``'tpu'`` or ``'gpu'``; anything else gets the wider of each).

  Example:
    >>> below, above = error_band('tpu')
    >>> 0 < below < 1 and 0 < above
    True
  """
  if platform in ERROR_BANDS:
    return ERROR_BANDS[platform]
  return (
    max(b for b, _ in ERROR_BANDS.values()),
    max(a for _, a in ERROR_BANDS.values()),
  )


@dataclasses.dataclass(frozen=True)
class _Totals:
  """Bytes per chip the walk over a traced step found."""

  by_category: dict[str, int]
  peak: int  # arguments kept all step, plus the peak of live values
  outputs: int
  donated: int
  unplaced: collections.Counter[Key]  # values without a layout live at the peak


def estimate(
  target: Step, args: Sequence[Any], capacity: int | None, chip: Chip | None
) -> FitReport:
  """The estimated :class:`FitReport` of ``target`` (see the module doc)."""
  mesh = target.mesh
  arguments = prepare(target, args)
  traced = target.trace(*arguments.lowered)
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  w = Walk(sizes)
  totals = _walk_step(target, arguments, traced, w)
  on_gpu = chip is not None and chip.name in GPUS
  workspace = GPU_MATMUL_WORKSPACE if on_gpu and _flops(traced.jaxpr.jaxpr) else 0
  rows = _rows(totals, workspace)
  unmeasured_here = unmeasured(traced.jaxpr.jaxpr, mesh, arguments.on_host)
  hbm = capacity if capacity is not None else (chip.hbm_bytes if chip else None)
  flops = _flops(traced.jaxpr.jaxpr) / max(math.prod(mesh.axis_sizes), 1)
  return FitReport(
    source='estimate',
    # Short enough for one printed line of 100 columns.
    method='no compiler for this mesh: arguments by the plan, activations by '
    'walking the traced step',
    mesh=dict(sizes),
    devices=f'an abstract mesh of {math.prod(mesh.axis_sizes)} devices'
    + (f' ({chip.name})' if chip else ''),
    chip=chip,
    rows=rows,
    total_bytes=sum(r.bytes for r in rows),
    hbm_bytes=hbm,
    memory_analysis=None,
    donated_bytes=int(min(totals.donated, totals.outputs)),
    collectives=(),
    flops=flops,
    bytes_accessed=None,
    cost_analysis=None,
    roofline=None,
    notes=_notes(mesh, unmeasured_here),
    unplaced=w.found.listing(totals.unplaced),
    unmeasured=unmeasured_here,
    peak_memory=estimated_peak(rows, arguments, target.names),
  )


def _walk_step(target: Step, arguments: Any, traced: Any, w: Walk) -> _Totals:
  """Walks the traced step: argument bytes by category, the peak, outputs."""
  jaxpr = traced.jaxpr.jaxpr
  donated = [
    bool(getattr(a, 'donated', False))
    for a in jax.tree_util.tree_leaves(traced.args_info)
  ]
  in_specs: list[Spec] = _input_specs(target, arguments.lowered)
  if len(in_specs) != len(jaxpr.invars):
    in_specs = [None for _ in jaxpr.invars]
  # Donated arguments are freed after their last use; the others stay all step.
  flags = donated + [False] * (len(jaxpr.invars) - len(donated))
  leaf_bytes = [
    w.nbytes(v.aval, aval_spec(v.aval) or spec)
    for v, spec in zip(jaxpr.invars, in_specs)
  ]
  kept_bytes = sum(b for b, gone in zip(leaf_bytes, flags) if not gone)
  counted = frozenset(v for v, gone in zip(jaxpr.invars, flags) if gone)
  hints = _output_specs(target, len(jaxpr.outvars))
  out_specs, peak, _, unplaced = walk(
    jaxpr, in_specs, w, counted, top=True, out_hints=hints
  )
  if len(leaf_bytes) != len(arguments.categories):
    leaf_bytes = list(arguments.layout_bytes)  # the same leaves, as laid out
  by_category: dict[str, int] = dict.fromkeys(
    (vocab.PARAMETERS, vocab.OPTIMIZER, vocab.RNG, vocab.INPUTS), 0
  )
  for c, b in zip(arguments.categories, leaf_bytes):
    by_category[c] = by_category.get(c, 0) + b
  outputs = sum(
    w.nbytes(v.aval, aval_spec(v.aval) or spec)
    for v, spec in zip(jaxpr.outvars, out_specs)
  )
  donated_bytes = sum(b for b, d in zip(leaf_bytes, flags) if d)
  return _Totals(by_category, kept_bytes + peak, outputs, donated_bytes, unplaced)


def _rows(t: _Totals, workspace: int) -> tuple[vocab.Row, ...]:
  """The breakdown: exact argument rows and gradients, the estimated rest
  (with ``workspace``, the GPU matmuls' library workspace)."""
  by_category = t.by_category
  not_donated = max(t.outputs - t.donated, 0)
  gradients = by_category[vocab.PARAMETERS] if by_category[vocab.OPTIMIZER] else 0
  known = sum(by_category.values()) + gradients + not_donated
  rng = by_category[vocab.RNG]
  return (
    vocab.Row(vocab.PARAMETERS, by_category[vocab.PARAMETERS], 'exact, by the plan'),
    vocab.Row(vocab.OPTIMIZER, by_category[vocab.OPTIMIZER], 'exact, by the plan'),
    *((vocab.Row(vocab.RNG, rng, 'exact: key arrays and counts'),) if rng else ()),
    vocab.Row(vocab.INPUTS, by_category[vocab.INPUTS], 'exact, by the plan'),
    vocab.Row(vocab.GRADIENTS, gradients, 'exact: laid out like the parameters'),
    vocab.Row(vocab.OUTPUTS, not_donated, 'outputs minus donated arguments'),
    vocab.Row(
      vocab.ACTIVATIONS,
      max(t.peak - known, 0) + workspace,
      'estimated: peak of live values in program order'
      + (', and the 4 MiB cuBLAS workspace' if workspace else ''),
    ),
  )


def _notes(mesh: Any, outside: tuple[str, ...]) -> tuple[str, ...]:
  axis_types = {str(t).split('.')[-1] for t in getattr(mesh, 'axis_types', ())}
  how = (
    'Explicit axes: every value carries its sharding'
    if axis_types == {'Explicit'}
    else 'Auto axes: shardings propagated from the arguments and constraints'
  )
  # The values counted replicated for want of a layout are report.unplaced,
  # listed under the verdict: no note repeats them.
  measured = (
    f"BENCHMARKS.md's measured error does not cover this step: it has "
    f'{", ".join(outside)}, which none of the measured models has'
    if outside
    else 'see BENCHMARKS.md for the measured error'
  )
  return (
    f'estimate ({how}): XLA fuses, reorders and rematerialises on its own, so '
    f'the compiled program may need more or less ({measured})',
  )


def _dot_flops(eqn: Any) -> float:
  (lc, _), _ = eqn.params['dimension_numbers']
  lhs = eqn.invars[0].aval.shape
  out = eqn.outvars[0].aval.shape
  return 2.0 * math.prod(out) * math.prod(lhs[d] for d in lc)


def _flops(jaxpr: Any) -> float:
  """Flops of the matmuls, loop bodies counted ``length`` times."""
  total = 0.0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'dot_general':
      total += _dot_flops(eqn)
    for inner, how in sub_jaxprs(eqn):
      times = eqn.params.get('length', 1) if how == 'scan' else 1
      total += times * _flops(inner)
  return total


def _output_specs(target: Any, n: int) -> list[Spec]:
  """Each output leaf's layout from the step's out_shardings (None if unknown)."""
  given = jit_shardings(target.step, 'out')
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
    if isinstance(spec, PartitionSpec) and shape is not None:
      out.append(tuple(spec) + (None,) * (len(shape) - len(spec)))
    else:
      out.append(None)
  return out
