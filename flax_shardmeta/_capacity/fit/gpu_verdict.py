"""fit's verdict on GPUs: the memory a real jax run gives XLA, the program
compiled for it, the larger fraction that would hold a step, and what the
compiler did to meet its budget.

``_capacity.fit.usable`` says what a run's memory is; this module applies it to a
step: it compiles the step again for a candidate fraction (each its own
program: XLA schedules and rematerializes for the memory it is handed) and
words the notes a GPU report carries.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax_shardmeta._capacity import vocabulary as vocab
from flax_shardmeta._capacity.estimate.estimator import error_band
from flax_shardmeta._capacity.fit import usable as usable_lib
from flax_shardmeta._capacity.fit.compiled import figures
from flax_shardmeta._capacity.fit.traced_step import Arguments, Step
from flax_shardmeta._capacity.report import FitReport
from flax_shardmeta._devices import gpu
from flax_shardmeta._units import signed_bytes


@dataclasses.dataclass(frozen=True)
class RunMemory:
  """What a real GPU run's allocator is given: ``fit``'s own arguments.

  Example:
    >>> m = RunMemory(0.9, '2GiB').memory(80 * 2**30, ())
    >>> m.fraction, m.usable_bytes / 2**30
    (0.9, 72.0)
  """

  mem_fraction: float | None
  reserve: int | str | None

  def memory(self, device_bytes: int, collectives: Any) -> usable_lib.UsableMemory:
    fraction, source = usable_lib.run_fraction(self.mem_fraction)
    size, why = usable_lib.reserve_for(collectives, self.reserve)
    return usable_lib.UsableMemory(device_bytes, fraction, source, size, why)


def judged_estimate(report: FitReport, run: RunMemory) -> FitReport:
  """An estimate's verdict: against a GPU's usable memory, and only outside
  the estimate's measured error."""
  chip = report.chip
  on_gpu = chip is not None and chip.name in gpu.GPUS
  band = error_band('gpu' if on_gpu else 'tpu')
  if not on_gpu or report.hbm_bytes is None:
    return dataclasses.replace(report, error_band=band)
  # No program to read communicators from: one per mesh axis it splits.
  axes = [usable_lib.Communicator(a) for a, n in report.mesh.items() if n > 1]
  memory = run.memory(report.hbm_bytes, axes)
  return dataclasses.replace(
    report, usable=memory, hbm_bytes=memory.usable_bytes, error_band=band
  )


def needed_fraction(
  target: Step,
  arguments: Arguments,
  use_cache: bool,
  memory: usable_lib.UsableMemory,
  total: int,
) -> tuple[float | None, list[tuple[float, int, int]]]:
  """The fraction (at most 0.95) whose own compile fits, and each compile
  tried: ``(fraction, its total, its usable bytes)``.

  A larger pool is a different program (XLA schedules and rematerializes for
  the memory it is handed), so each candidate fraction is compiled for and
  judged by its own program, at most twice."""
  tried: list[tuple[float, int, int]] = []
  if total <= memory.usable_bytes:
    return None, tried
  x = memory.needed_fraction(total)
  for _ in range(2):
    if x is None:
      return None, tried
    at = memory.with_fraction(x, 'mem_fraction=')
    found = figures(target, arguments, use_cache, at.compile_limit_bytes)
    if found.device_memory is None:  # refused
      return None, tried
    total_x = found.device_memory.step_total
    tried.append((x, total_x, at.usable_bytes))
    if total_x <= at.usable_bytes:
      return x, tried
    later = at.needed_fraction(total_x)
    x = later if later is not None and later > x else None
  return None, tried


def gpu_notes(
  memory: usable_lib.UsableMemory,
  plan: vocab.CompilerPlan | None,
  tried: list[tuple[float, int, int]],
  cost: dict[str, float],
) -> tuple[str, ...]:
  """What a GPU compile does not say by itself."""
  notes = [
    "XLA's GPU compiler does not check a program against the GPU's memory (it "
    'compiles oversized ones): the verdict compares its total with the usable '
    'memory of a real run (the rows above: the allocator pool, less what of '
    'the reserve does not fit beside it)'
  ]
  if plan is not None and plan.cublas_matmuls:
    notes.append(
      'compiled without a GPU, with its matmuls as cuBLAS calls: the most memory '
      "a run's autotuning can pick (it may fuse some into Triton kernels, "
      'which needs less)'
    )
  elif plan is not None:
    notes.append(
      'compiled without a GPU, with its matmuls in Triton fusions (this XLA '
      "refused the option for cuBLAS calls): the least memory a run's "
      'autotuning can pick, so a real run may need more (9% more on '
      "BENCHMARKS.md's GPU truth check)"
    )
  pool = signed_bytes(memory.compile_limit_bytes)
  if plan is not None and plan.retargeted:
    notes.append(
      f'compiled as a run at fraction {usable_lib.fraction_text(memory.fraction)} '
      'compiles it: XLA '
      f'planned its schedule and rematerialization against the {pool} pool'
    )
  else:
    notes.append(
      "jax gave no way to hand XLA the run's pool: it planned against 80% of "
      'the described GPU memory, so near the limit a real compile may differ'
    )
  current, old = usable_lib.FRACTION_VARIABLES
  for x, total, room in tried:
    outcome = 'fits' if total <= room else 'does not fit'
    notes.append(
      f'compiled again for {current}={x:.2f} ({old} in older jax): needs '
      f'{signed_bytes(total)} of its {signed_bytes(room)} usable, {outcome}'
    )
  if not cost:
    notes.append('no cost model for this program: flops and HBM bytes unknown')
  return tuple(notes)


def remat_notes(plan: vocab.CompilerPlan | None) -> tuple[str, ...]:
  if plan is None or not plan.rematerialized:
    return ()
  budget = (
    f'the {signed_bytes(plan.budget_bytes)} it was handed'
    if plan.budget_bytes
    else "the device's memory"
  )
  if not plan.remat_instructions:
    return (
      f'XLA tried to rematerialize to fit {budget} and found nothing to '
      'recompute: the step needs the memory above',
    )
  saved = (
    f', saving {signed_bytes(plan.remat_saved_bytes)}' if plan.remat_saved_bytes else ''
  )
  if plan.remat_target_bytes:
    return (
      f'XLA rematerialized {plan.remat_instructions:,} instruction(s) trying to '
      f'fit {budget}{saved}, and could not reach its '
      f'{signed_bytes(plan.remat_target_bytes)} target: the step pays recompute '
      'it did not ask for and still needs the memory above',
    )
  note = (
    f'XLA rematerialized {plan.remat_instructions:,} instruction(s) to fit '
    f'{budget}{saved}: the step pays recompute it did not ask for (a larger '
    'memory fraction, a smaller batch or a remat policy of your own avoids it)'
  )
  return (note,)
