"""``fit``: does a whole training step fit each chip, and what does it cost?

A step is lowered and compiled for its mesh, which may be the devices of a
TPU pod this machine does not have (``make_mesh(..., topology=...)``); nothing
is allocated. XLA's own memory analysis gives the peak per chip, the compiled
program's inputs what the argument bytes are (parameters, optimizer state, RNG
state, batch: each leaf's category from its plan), and the optimised HLO the
collectives and the work per step (``_capacity.fit.compiled``). When the compiler
refuses the program for lack of memory, that refusal is the verdict. With no
compiler for the target (an ``AbstractMesh``), the figures are estimated from
the layouts and the traced program (``_capacity.estimate.estimator``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jax.sharding import AbstractMesh

from flax_shardmeta._capacity import vocabulary as vocab
from flax_shardmeta._capacity.estimate.estimator import estimate
from flax_shardmeta._capacity.fit import gpu_verdict as gv, usable as usable_lib
from flax_shardmeta._capacity.fit.compiled import figures
from flax_shardmeta._capacity.fit.donation import donation_notes
from flax_shardmeta._capacity.fit.extrapolate import fit_layers
from flax_shardmeta._capacity.fit.host_report import host_side
from flax_shardmeta._capacity.fit.traced_step import (
  Arguments,
  Step,
  path_category,
  prepare,
)
from flax_shardmeta._capacity.hlo import summary as hlo
from flax_shardmeta._capacity.hlo.roofline import group, roofline
from flax_shardmeta._capacity.peak.holders import compiled_peak
from flax_shardmeta._capacity.report import FitReport
from flax_shardmeta._capacity.why.readable import not_expert_parallel
from flax_shardmeta._devices import gpu
from flax_shardmeta._devices.chips import CHIPS, Chip, chip_named, chip_of
from flax_shardmeta._devices.topology import describe
from flax_shardmeta._errors import FitError, SizeError, message
from flax_shardmeta._programs.memory import ProgramMemory
from flax_shardmeta._units import parse_bytes


def fit(
  step: Callable[..., Any],
  *args: Any,
  hbm: int | str | None = None,
  chip: str | None = None,
  layers: int | None = None,
  exact: bool = False,
  cache: bool = True,
  mem_fraction: float | None = None,
  reserve: int | str | None = None,
  host_memory: int | str | None = None,
) -> FitReport:
  """Compiles ``step`` for its mesh and reports what each chip must hold.

  Nothing is allocated and nothing runs: the arguments are abstract
  (``jax.eval_shape`` trees, annotated or not, or ``ShapeDtypeStruct``s) and
  the mesh may be a TPU pod described by libtpu (``fsm.make_mesh(...,
  topology='v5p:8x8x16')``). Annotated arguments are laid out by their plan
  (a layout problem raises the plan's :class:`ShardingError`, not an XLA
  error); an argument that is itself a box (e.g. ``fsm.LogicalPartitioned(
  batch, ('batch', None))``) is passed unboxed, laid out by its annotation.

  See :class:`FitReport` for what is reported; ``report.total_bytes`` is
  ``argument + output - alias + temporaries + generated code``, and every
  row comes from the compiled program: each argument as it holds it (one
  the step never reads, which jax drops, holds nothing). What lives in host
  memory (an argument or output whose memory kind is ``pinned_host``) is not
  counted on the chip (a note says how much). When the
  compiler refuses the program for lack of HBM, the report says so
  (``fits=False``, with the compiler's required and available figures).

  On GPUs the verdict is against the memory a real jax run gives XLA
  (``report.usable``): ``min(fraction x GPU memory, GPU memory - reserve)``,
  where the fraction is the allocator's (``mem_fraction=``, else
  ``XLA_CLIENT_MEM_FRACTION`` / ``XLA_PYTHON_CLIENT_MEM_FRACTION``, else
  jax's 0.75) and the reserve what the run holds outside XLA's pool (the
  CUDA context, NCCL's communicators; ``_capacity.fit.usable``). The program is
  compiled as that run's compiler would plan it, for the pool. A step that
  does not fit there but whose program, compiled for a larger fraction (at
  most 0.95), fits at it is "FITS ONLY WITH XLA_CLIENT_MEM_FRACTION=x"
  (``report.needed_fraction``; ``fits`` stays False at the run's fraction).

  Args:
    step: a function from :func:`flax_shardmeta.jit` (it brings its mesh,
      rules and shardings), a ``jax.jit`` function (its own ``in_shardings``
      lay out arguments that carry none) or plain function called under
      ``jax.set_mesh(mesh)``. With ``layers``, a builder instead (below).
    *args: the step's arguments, abstract.
    hbm: the memory per chip to judge against (bytes, or text like
      ``'95GiB'``); default: the chip's, when the devices are known. On GPUs,
      the GPU's memory, of which the allocator takes its fraction.
    chip: figures for the verdict and the roofline when the devices do not
      say (an ``AbstractMesh``, CPU devices): ``'v5p'``, ``'h100'``, ...
    layers: with a builder ``step(num_layers) -> (jitted, *args)``, the depth
      to report on. Where the model's program grows with depth (layers
      unrolled in Python) enough for it to be clearly faster, the model is
      compiled at 2 and 4 layers and every figure extrapolated linearly;
      otherwise (layers stacked by ``nn.scan`` / ``nnx.scan``: one compile of
      all of them costs about one of 2) it is compiled whole, once. The
      report's notes say which, and why.
    exact: with ``layers``, compile all of them whatever the programs' sizes.
    cache: reuse figures of the very same program and target (in memory and
      in ``~/.cache/flax_shardmeta/fit``, see ``FLAX_SHARDMETA_CACHE``);
      ``False`` compiles afresh and keeps nothing.
    mem_fraction: GPUs: the allocator fraction the run will use (default: the
      environment's, as jaxlib reads it, else 0.75).
    reserve: GPUs: bytes (or text like ``'3GiB'``) the run holds outside
      XLA's pool per GPU; default: the project's table by the program's
      NCCL communicators.
    host_memory: the RAM of one host (bytes, or text like ``'448GiB'``), that
      what the step keeps in host memory (``report.host``: arguments laid out
      on ``pinned_host``, values a remat policy offloads) is judged against;
      default: the machine type's for known chips (``HOST_RAM``).

  Returns:
    The :class:`FitReport`.

  Raises:
    ShardingError: an argument's annotations cannot be laid out on the mesh.
    NoMeshError: no mesh: ``step`` is not an ``fsm.jit`` function and no
      ``jax.set_mesh`` is active.
    FitError: a malformed ``hbm`` or ``chip``, or a compiler error other
      than running out of memory.

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> mesh = jax.make_mesh((2, 4), ('data', 'model'))
    >>> params = {'w': fsm.Partitioned(
    ...     jax.ShapeDtypeStruct((512, 256), jnp.float32), (None, 'model'))}
    >>> def step(params, x):
    ...   return jnp.tanh(x @ fsm.unbox(params)['w']).sum()
    >>> batch = fsm.Partitioned(jax.ShapeDtypeStruct((64, 512), jnp.float32),
    ...                         ('data', None))
    >>> with jax.set_mesh(mesh):
    ...   report = fsm.fit(jax.jit(step), params, batch, hbm='16MiB', cache=False)
    >>> report.row('parameters'), report.row('batch and other inputs'), report.fits
    (131072, 65536, True)
  """
  capacity = _capacity(hbm)
  host_ram = _capacity(host_memory, 'host_memory')
  chip_spec = _chip(chip)
  run = gv.RunMemory(mem_fraction, reserve)
  usable_lib.check_run(mem_fraction, reserve)  # bad ones are refused at once
  if layers is not None:
    return _fit_layers(step, layers, capacity, chip_spec, exact, cache, run, host_ram)
  target = Step.of(step, len(args))
  if isinstance(target.mesh, AbstractMesh):
    return gv.judged_estimate(estimate(target, args, capacity, chip_spec), run)
  return _compiled_report(target, args, capacity, chip_spec, cache, run, host_ram)


def _capacity(hbm: int | str | None, name: str = 'hbm') -> int | None:
  if hbm is None:
    return None
  try:
    value = parse_bytes(hbm)
  except SizeError as e:
    raise FitError(f'{name}={hbm!r}: {message(e)}') from None
  if value <= 0:
    what = 'per host' if name == 'host_memory' else 'per chip'
    raise FitError(f'{name}={hbm!r}: the memory {what} must be positive.')
  return value


def _chip(name: str | None) -> Chip | None:
  if name is None:
    return None
  found = chip_named(name)
  if found is None:
    known = ', '.join(c.name for c in CHIPS)
    raise FitError(f'chip={name!r} is not one fit knows; choose from {known}.')
  return found


# The compiled report
# ------------------------------------------------------------------------------


def _compiled_report(
  target: Step,
  args: Sequence[Any],
  capacity: int | None,
  chip_spec: Chip | None,
  use_cache: bool,
  run: gv.RunMemory,
  host_ram: int | None = None,
) -> FitReport:
  arguments = prepare(target, args)
  mesh = target.mesh
  chip = chip_spec or chip_of(mesh.devices)
  hbm = capacity if capacity is not None else (chip.hbm_bytes if chip else None)
  if hbm is None:  # a custom GPU: its own description's memory
    hbm = gpu.described_memory(mesh.devices)
  on_gpu = _platform(mesh) == 'gpu' and hbm is not None
  # A real GPU run hands XLA its allocator's pool; so does this compile.
  pool = run.memory(hbm, ()).compile_limit_bytes if on_gpu and hbm else None
  found = figures(target, arguments, use_cache, pool)
  common = {
    'mesh': dict(zip(mesh.axis_names, mesh.axis_sizes)),
    'devices': describe(mesh.devices),
    'chip': chip,
    'compile_seconds': found.compile_seconds,
    'cached': found.cached,
  }
  if found.refusal is not None:
    by_category = _sum_by_category(arguments.categories, _on_chip(arguments))
    return _refused_report(found.refusal, by_category, capacity, common)
  plan = vocab.CompilerPlan.from_found(found.planned)
  memory = found.device_memory  # XLA's, less what is in host memory
  summary = found.summary
  if memory is None or summary is None or found.memory is None:
    raise FitError('the compiled figures hold no memory analysis of the step')
  by_category, told_by_path = _compiled_categories(arguments, found.input_bytes)
  rows = memory_rows(memory, by_category)
  cost = found.cost
  flops, traffic = _work(cost, summary)
  collectives = group(summary.collectives, chip)
  total = sum(r.bytes for r in rows)
  notes = _notes(mesh, chip, summary, hbm) + found.host_notes
  notes += _argument_notes(memory, by_category, told_by_path, found.reader)
  notes += donation_notes(found, memory, target.names)
  notes += tuple(not_expert_parallel(collectives))  # as why()'s findings say
  memory_at_run, needed = None, None
  if on_gpu and hbm:
    memory_at_run = run.memory(hbm, collectives)
    hbm = memory_at_run.usable_bytes
    needed, tried = gv.needed_fraction(
      target, arguments, use_cache, memory_at_run, total
    )
    notes += gv.gpu_notes(memory_at_run, plan, tried, cost)
  notes += gv.remat_notes(plan)
  host, offloads = host_side(found, arguments, target.names, mesh, chip, host_ram)
  notes += offloads
  peak = compiled_peak(rows, memory, found, arguments.categories, target.names)
  return FitReport(
    source='compiled',
    method='compiled for the mesh; figures from XLA (memory_analysis, '
    'cost_analysis) and the optimised HLO',
    rows=rows,
    total_bytes=sum(r.bytes for r in rows),
    hbm_bytes=hbm,
    memory_analysis=found.memory.to_dict(),
    donated_bytes=memory.aliased,
    collectives=collectives,
    flops=flops,
    bytes_accessed=traffic,
    cost_analysis=cost or None,
    roofline=_roofline(chip, flops, traffic, collectives, host),
    loops=summary.loops,
    notes=notes,
    replicated=found.replicated,
    usable=memory_at_run,
    needed_fraction=needed,
    plan=plan,
    peak_memory=peak,
    host=host,
    **common,
  )


def _roofline(
  chip: Chip | None,
  flops: float | None,
  traffic: float | None,
  collectives: Any,
  host: Any,
) -> Any:
  """The step-time estimate, host transfers included where timed."""
  found = None if flops is None else roofline(chip, flops, traffic or 0.0, collectives)
  if found is None or host is None or not host.transfer_s:
    return found
  return dataclasses.replace(found, transfer_s=host.transfer_s)


def _work(
  cost: dict[str, float], summary: hlo.ProgramSummary
) -> tuple[float | None, float | None]:
  """A step's flops and bytes accessed: XLA's cost analysis with what the
  program text adds."""
  flops = None
  if 'flops' in cost:
    # XLA's cost model counts no matmul handed to cuBLAS (GPU programs are
    # compiled so): then the program text's count of one pass is the larger.
    flops = max(cost['flops'], summary.hlo_flops) + summary.extra_flops
  traffic = cost.get('bytes accessed')
  traffic = traffic + summary.extra_bytes if traffic is not None else None
  return flops, traffic


def _sum_by_category(categories: Sequence[str], sizes: Sequence[int]) -> dict[str, int]:
  out: dict[str, int] = dict.fromkeys(
    (vocab.PARAMETERS, vocab.OPTIMIZER, vocab.RNG, vocab.INPUTS), 0
  )
  for c, b in zip(categories, sizes):
    out[c] = out.get(c, 0) + int(b)
  return out


def _on_chip(arguments: Arguments) -> list[int]:
  """Each argument leaf's bytes as laid out on the chip: what lives in host
  memory (its memory kind) is not what the chip lacks room for."""
  hosted = arguments.on_host or [False] * len(arguments.layout_bytes)
  return [0 if h else size for size, h in zip(arguments.layout_bytes, hosted)]


def _compiled_categories(
  arguments: Arguments, inputs: list[list[Any]]
) -> tuple[dict[str, int], bool]:
  """Bytes by category of the compiled program's inputs in device memory
  (those in host memory are not the chip's), and whether the categories had
  to be told from the inputs' paths (when its leaves are not the arguments'
  one for one)."""
  sizes = [0 if len(leaf) > 4 and leaf[4] else int(leaf[1]) for leaf in inputs]
  if len(inputs) == len(arguments.categories):
    return _sum_by_category(arguments.categories, sizes), False
  categories = [path_category(leaf[0], leaf[2]) for leaf in inputs]
  return _sum_by_category(categories, sizes), True


def memory_rows(
  memory: ProgramMemory, by_category: dict[str, int]
) -> tuple[vocab.Row, ...]:
  """The breakdown: argument categories (adding up to XLA's argument bytes),
  outputs not donated, temporaries and generated code."""
  args = memory.arguments
  known = sum(by_category.values())
  rng = by_category.get(vocab.RNG, 0)
  held = 'arguments, as the compiled program holds them'
  return (
    vocab.Row(vocab.PARAMETERS, by_category[vocab.PARAMETERS], held),
    vocab.Row(vocab.OPTIMIZER, by_category[vocab.OPTIMIZER], held),
    *((vocab.Row(vocab.RNG, rng, held),) if rng else ()),
    vocab.Row(vocab.INPUTS, by_category[vocab.INPUTS], held),
    vocab.Row(
      vocab.PADDING, max(args - known, 0), 'argument bytes XLA adds (padding, layout)'
    ),
    vocab.Row(
      vocab.OUTPUTS,
      memory.outputs - memory.aliased,
      'outputs minus donated (aliased) arguments',
    ),
    vocab.Row(
      vocab.TEMPORARIES,
      memory.temporaries,
      'activations for the backward pass, gradients, workspace',
    ),
    vocab.Row(vocab.CODE, memory.generated_code, 'the program itself'),
  )


def _argument_notes(
  memory: ProgramMemory,
  by_category: dict[str, int],
  told_by_path: bool,
  reader: list[str],
) -> tuple[str, ...]:
  notes = []
  over = sum(by_category.values()) - memory.arguments
  if over > 0:  # the argument rows then add up to more than XLA's figure
    notes.append(
      f"the arguments as laid out come to {over:,} bytes more than XLA's "
      'argument figure; argument padding reads 0'
    )
  if told_by_path:
    notes.append(
      "the compiled program's inputs are not the arguments leaf for leaf; "
      'their categories were told from their paths'
    )
  if reader:
    notes.append(
      "the HLO text reader disagrees with XLA's own module ("
      + '; '.join(reader)
      + '): collectives, loops and flops may be wrong; please report it'
    )
  return tuple(notes)


def _refused_report(
  refusal: vocab.Refusal,
  by_category: dict[str, int],
  capacity: int | None,
  common: dict[str, Any],
) -> FitReport:
  known = sum(by_category.values())
  laid_out = 'arguments as laid out (the compiler refused: no program to ask)'
  rng = by_category.get(vocab.RNG, 0)
  rows = (
    vocab.Row(vocab.PARAMETERS, by_category[vocab.PARAMETERS], laid_out),
    vocab.Row(vocab.OPTIMIZER, by_category[vocab.OPTIMIZER], laid_out),
    *((vocab.Row(vocab.RNG, rng, laid_out),) if rng else ()),
    vocab.Row(vocab.INPUTS, by_category[vocab.INPUTS], laid_out),
    vocab.Row(
      vocab.TEMPORARIES,
      max(refusal.required_bytes - known, 0),
      'the rest of what the compiler requires',
    ),
  )
  return FitReport(
    source='compiled',
    method='the compiler refused the program for lack of memory; arguments '
    'as laid out, the rest from its message',
    rows=rows,
    total_bytes=max(refusal.required_bytes, known),
    hbm_bytes=capacity if capacity is not None else refusal.available_bytes,
    memory_analysis=None,
    donated_bytes=0,
    collectives=(),
    flops=None,
    bytes_accessed=None,
    cost_analysis=None,
    roofline=None,
    refusal=refusal,
    notes=(f'compiler: {refusal.message}',),
    **common,
  )


def _platform(mesh: Any) -> str:
  return getattr(next(iter(mesh.devices.flat)), 'platform', '')


def _notes(
  mesh: Any, chip: Chip | None, summary: hlo.ProgramSummary, capacity: int | None
) -> tuple[str, ...]:
  notes = []
  unknown = [name for name, n in summary.loops if n is None]
  if unknown:
    notes.append(
      f'{len(unknown)} loop(s) with a trip count the HLO does not tell were '
      'counted once: collectives and flops inside them are a lower bound'
    )
  platform = _platform(mesh)
  if chip is None and platform == 'cpu':
    notes.append(
      "compiled for CPU devices: XLA's CPU figures; pass hbm= for a verdict "
      "and chip= (e.g. 'v5p') for a roofline, or use a TPU topology"
    )
  if chip is None and capacity is None and platform != 'cpu':
    notes.append('unknown device kind: pass hbm= for a verdict')
  elif chip is None and platform != 'cpu':
    notes.append("unknown device kind: pass chip= (e.g. 'h100') for a roofline")
  return tuple(notes)


# Deep scanned models: compile two depths, extrapolate
# ------------------------------------------------------------------------------


def _fit_layers(
  build: Callable[[int], Any],
  layers: int,
  capacity: int | None,
  chip_spec: Chip | None,
  exact: bool,
  use_cache: bool,
  run: gv.RunMemory,
  host_ram: int | None = None,
) -> FitReport:
  hbm: Any = capacity
  chip_name = chip_spec.name if chip_spec else None

  def at_depth(made: tuple[Any, ...]) -> FitReport:
    step, *args = made
    return fit(
      step,
      *args,
      hbm=hbm,
      chip=chip_name,
      cache=use_cache,
      mem_fraction=run.mem_fraction,
      reserve=run.reserve,
      host_memory=host_ram,
    )

  report, extrapolated = fit_layers(build, layers, at_depth, exact=exact)
  if extrapolated and report.host is not None:
    # The host figures are a shallower model's: not extrapolated, not judged.
    unchecked = 'extrapolated: host memory unchecked (fit with exact=True)'
    report = dataclasses.replace(report, host=None, notes=(*report.notes, unchecked))
  if not extrapolated or report.usable is None:
    return report
  # The fraction the deeper model needs was never compiled for: say what it
  # would be, not that it fits there.
  need = report.usable.needed_fraction(report.total_bytes)
  notes = tuple(n for n in report.notes if not n.startswith('compiled again'))
  if need is not None and not report.fits:
    notes += (
      f'extrapolated: about {usable_lib.FRACTION_VARIABLES[0]}={need:.2f} would '
      'hold it; fit with exact=True to compile for it',
    )
  return dataclasses.replace(report, needed_fraction=None, notes=notes)
