"""``fit``: does a whole training step fit each chip, and what does it cost?

A step is lowered and compiled for its mesh, which may be the devices of a
TPU pod this machine does not have (``make_mesh(..., topology=...)``); nothing
is allocated. XLA's own memory analysis gives the peak per chip, the compiled
program's inputs what the argument bytes are (parameters, optimizer state, RNG
state, batch: each leaf's category from its plan), and the optimised HLO the
collectives and the work per step (``_capacity.compiled``). When the compiler
refuses the program for lack of memory, that refusal is the verdict. With no
compiler for the target (an ``AbstractMesh``), the figures are estimated from
the layouts and the traced program (``_capacity.estimate``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jax.sharding import AbstractMesh

from flax_shardmeta._capacity import gpu, hlo, report as rep
from flax_shardmeta._capacity.chips import CHIPS, Chip, chip_named, chip_of, parse_bytes
from flax_shardmeta._capacity.compiled import figures
from flax_shardmeta._capacity.estimate import estimate
from flax_shardmeta._capacity.extrapolate import extrapolate
from flax_shardmeta._capacity.roofline import group, roofline
from flax_shardmeta._capacity.step import Arguments, Step, path_category, prepare
from flax_shardmeta._capacity.topology import describe
from flax_shardmeta._errors import FitError

_EXTRAPOLATE_FROM = (2, 4)


def fit(
  step: Callable[..., Any],
  *args: Any,
  hbm: int | str | None = None,
  chip: str | None = None,
  layers: int | None = None,
  exact: bool = False,
  cache: bool = True,
) -> rep.FitReport:
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
  the step never reads, which jax drops, holds nothing). When the
  compiler refuses the program for lack of HBM, the report says so
  (``fits=False``, with the compiler's required and available figures).

  Args:
    step: a function from :func:`flax_shardmeta.jit` (it brings its mesh,
      rules and shardings), a ``jax.jit`` function or plain function called
      under ``jax.set_mesh(mesh)``. With ``layers``, a builder instead (below).
    *args: the step's arguments, abstract.
    hbm: the memory per chip to judge against (bytes, or text like
      ``'95GiB'``); default: the chip's, when the devices are known TPUs.
    chip: figures for the verdict and the roofline when the devices do not
      say (an ``AbstractMesh``, CPU devices): ``'v5p'``, ``'h100'``, ...
    layers: with a builder ``step(num_layers) -> (jitted, *args)`` for a model
      whose layers are stacked (``nn.scan`` / ``nnx.scan``), the depth to
      report on. The model is compiled at 2 and 4 layers and every figure
      extrapolated linearly (scanned layers add the same per layer); this is
      faster when compile time grows with depth (layers unrolled in Python).
    exact: with ``layers``, compile all of them instead.
    cache: reuse figures of the very same program and target (in memory and
      in ``~/.cache/flax_shardmeta/fit``, see ``FLAX_SHARDMETA_CACHE``);
      ``False`` compiles afresh and keeps nothing.

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
  chip_spec = _chip(chip)
  if layers is not None:
    return _fit_layers(step, layers, capacity, chip_spec, exact, cache)
  target = Step.of(step, len(args))
  if isinstance(target.mesh, AbstractMesh):
    return estimate(target, args, capacity, chip_spec)
  return _compiled_report(target, args, capacity, chip_spec, cache)


def _capacity(hbm: int | str | None) -> int | None:
  if hbm is None:
    return None
  try:
    value = parse_bytes(hbm)
  except FitError as e:
    raise FitError(f'hbm={hbm!r}: {e}') from None
  if value <= 0:
    raise FitError(f'hbm={hbm!r}: the memory per chip must be positive.')
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
) -> rep.FitReport:
  arguments = prepare(target, args)
  found = figures(target, arguments, use_cache)
  mesh = target.mesh
  chip = chip_spec or chip_of(mesh.devices)
  hbm = capacity if capacity is not None else (chip.hbm_bytes if chip else None)
  if hbm is None:  # a custom GPU: its own description's memory
    hbm = gpu.described_memory(mesh.devices)
  common = {
    'mesh': dict(zip(mesh.axis_names, mesh.axis_sizes)),
    'devices': describe(mesh.devices),
    'chip': chip,
    'compile_seconds': found['compile_seconds'],
    'cached': found['cached'],
  }
  if 'refusal' in found:
    refusal = rep.Refusal(**found['refusal'])
    by_category = _sum_by_category(arguments.categories, arguments.layout_bytes)
    return _refused_report(refusal, by_category, capacity, common)
  memory = found['memory']
  summary = hlo.ProgramSummary.from_dict(found['summary'])
  by_category, told_by_path = _compiled_categories(arguments, found['input_bytes'])
  rows = memory_rows(memory, by_category)
  cost = found['cost']
  flops = cost['flops'] + summary.extra_flops if 'flops' in cost else None
  traffic = cost.get('bytes accessed')
  traffic = traffic + summary.extra_bytes if traffic is not None else None
  collectives = group(summary.collectives, chip)
  notes = _notes(mesh, chip, summary, hbm)
  notes += _argument_notes(memory, by_category, told_by_path, found['reader'])
  if _platform(mesh) == 'gpu':
    notes += _gpu_notes(sum(r.bytes for r in rows), hbm, cost)
  return rep.FitReport(
    source='compiled',
    method='compiled for the mesh; figures from XLA (memory_analysis, '
    'cost_analysis) and the optimised HLO',
    rows=rows,
    total_bytes=sum(r.bytes for r in rows),
    hbm_bytes=hbm,
    memory_analysis=memory,
    donated_bytes=memory['alias_size_in_bytes'],
    collectives=collectives,
    flops=flops,
    bytes_accessed=traffic,
    cost_analysis=cost or None,
    roofline=roofline(chip, flops or 0.0, traffic or 0.0, collectives)
    if flops is not None
    else None,
    loops=summary.loops,
    notes=notes,
    replicated=tuple(found.get('replicated', ())),
    **common,
  )


def _sum_by_category(categories: Sequence[str], sizes: Sequence[int]) -> dict[str, int]:
  out = {rep.PARAMETERS: 0, rep.OPTIMIZER: 0, rep.RNG: 0, rep.INPUTS: 0}
  for c, b in zip(categories, sizes):
    out[c] = out.get(c, 0) + int(b)
  return out


def _compiled_categories(
  arguments: Arguments, inputs: list[list[Any]]
) -> tuple[dict[str, int], bool]:
  """Bytes by category of the compiled program's inputs, and whether the
  categories had to be told from the inputs' paths (when its leaves are not
  the arguments' one for one)."""
  sizes = [int(leaf[1]) for leaf in inputs]
  if len(inputs) == len(arguments.categories):
    return _sum_by_category(arguments.categories, sizes), False
  categories = [path_category(leaf[0], leaf[2]) for leaf in inputs]
  return _sum_by_category(categories, sizes), True


def memory_rows(
  memory: dict[str, int], by_category: dict[str, int]
) -> tuple[rep.Row, ...]:
  """The breakdown: argument categories (adding up to XLA's argument bytes),
  outputs not donated, temporaries and generated code."""
  args = memory['argument_size_in_bytes']
  known = sum(by_category.values())
  rng = by_category.get(rep.RNG, 0)
  held = 'arguments, as the compiled program holds them'
  return (
    rep.Row(rep.PARAMETERS, by_category[rep.PARAMETERS], held),
    rep.Row(rep.OPTIMIZER, by_category[rep.OPTIMIZER], held),
    *((rep.Row(rep.RNG, rng, held),) if rng else ()),
    rep.Row(rep.INPUTS, by_category[rep.INPUTS], held),
    rep.Row(
      rep.PADDING, max(args - known, 0), 'argument bytes XLA adds (padding, layout)'
    ),
    rep.Row(
      rep.OUTPUTS,
      memory['output_size_in_bytes'] - memory['alias_size_in_bytes'],
      'outputs minus donated (aliased) arguments',
    ),
    rep.Row(
      rep.TEMPORARIES,
      memory['temp_size_in_bytes'],
      'activations for the backward pass, gradients, workspace',
    ),
    rep.Row(rep.CODE, memory['generated_code_size_in_bytes'], 'the program itself'),
  )


def _argument_notes(
  memory: dict[str, int],
  by_category: dict[str, int],
  told_by_path: bool,
  reader: list[str],
) -> tuple[str, ...]:
  notes = []
  over = sum(by_category.values()) - memory['argument_size_in_bytes']
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
  refusal: rep.Refusal,
  by_category: dict[str, int],
  capacity: int | None,
  common: dict[str, Any],
) -> rep.FitReport:
  known = sum(by_category.values())
  laid_out = 'arguments as laid out (the compiler refused: no program to ask)'
  rng = by_category.get(rep.RNG, 0)
  rows = (
    rep.Row(rep.PARAMETERS, by_category[rep.PARAMETERS], laid_out),
    rep.Row(rep.OPTIMIZER, by_category[rep.OPTIMIZER], laid_out),
    *((rep.Row(rep.RNG, rng, laid_out),) if rng else ()),
    rep.Row(rep.INPUTS, by_category[rep.INPUTS], laid_out),
    rep.Row(
      rep.TEMPORARIES,
      max(refusal.required_bytes - known, 0),
      'the rest of what the compiler requires',
    ),
  )
  return rep.FitReport(
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


def _gpu_notes(total: int, hbm: int | None, cost: dict[str, float]) -> tuple[str, ...]:
  """What a GPU compile does not say by itself."""
  notes = [
    "XLA's GPU compiler does not check a program against the GPU's memory (it "
    'compiles oversized ones): the verdict is this comparison of its figures '
    "with the GPU's; compiled without a GPU, so without autotuning (matmuls in "
    "XLA's default fusions)"
  ]
  if hbm and 0.75 * hbm < total <= hbm:
    need = min(0.95, (total / hbm) + 0.02)
    notes.append(
      f"the step needs {total / hbm:.0%} of the GPU's memory, more than the 75% "
      'jax preallocates by default: run it with XLA_PYTHON_CLIENT_MEM_FRACTION='
      f'{need:.2f}'
    )
  if not cost:
    notes.append('no cost model for this program: flops and HBM bytes unknown')
  return tuple(notes)


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
) -> rep.FitReport:
  if not isinstance(layers, int) or layers < 1:
    raise FitError(f'layers={layers!r}: give the number of layers, at least 1.')
  hbm: Any = capacity
  chip_name = chip_spec.name if chip_spec else None

  def run(n: int) -> rep.FitReport:
    step, *args = _built(build, n)
    return fit(step, *args, hbm=hbm, chip=chip_name, cache=use_cache)

  a, b = _EXTRAPOLATE_FROM
  if exact or layers <= b:
    report = run(layers)
    return dataclasses.replace(report, method=report.method + f' ({layers} layers)')
  small, large = run(a), run(b)
  if small.refusal is not None or large.refusal is not None:
    refused = small if small.refusal is not None else large
    depth = a if small.refusal is not None else b
    return dataclasses.replace(
      refused,
      method=f'the compiler refused the model already at {depth} of {layers} '
      'layers; deeper only needs more',
    )
  # The full model is never compiled, but its layout must exist: its plan
  # raises what cannot be laid out, as fit at that depth would.
  step, *args = _built(build, layers)
  prepare(Step.of(step, len(args)), args)
  return extrapolate(small, large, a, b, layers)


def _built(build: Callable[[int], Any], n: int) -> tuple[Any, ...]:
  made = build(n)
  if not isinstance(made, (tuple, list)) or not made:
    raise FitError(
      f'the builder returned {type(made).__name__} for {n} layers; with layers=, '
      'fit takes a function num_layers -> (jitted_step, *abstract_args).'
    )
  return tuple(made)
