"""``fit``: does a whole training step fit each chip, and what does it cost?

A step is lowered and compiled for its mesh, which may be the devices of a
TPU pod this machine does not have (``make_mesh(..., topology=...)``); nothing
is allocated. XLA's own memory analysis gives the peak per chip, the plan of
each argument says what the argument bytes are (parameters, optimizer state,
batch), and the optimised HLO gives the collectives and the work per step.
When the compiler refuses the program for lack of memory, that refusal is the
verdict. With no compiler for the target (an ``AbstractMesh``), the figures
are estimated from the plan and the traced program (``_planning.estimate``).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh

from flax_shardmeta._errors import FitError
from flax_shardmeta._planning import cache as cache_lib
from flax_shardmeta._planning import hlo
from flax_shardmeta._planning import report as rep
from flax_shardmeta._planning.chips import Chip, chip_named, chip_of, parse_bytes
from flax_shardmeta._planning.estimate import estimate
from flax_shardmeta._planning.roofline import group, roofline
from flax_shardmeta._planning.step import Arguments, Step, prepare
from flax_shardmeta._planning.topology import describe

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
  ``argument + output - alias + temporaries + generated code``. When the
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
      in ``~/.cache/flax_shardmeta/fit``, see ``FLAX_SHARDMETA_CACHE``).

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
    from flax_shardmeta._planning.chips import CHIPS

    known = ', '.join(c.name for c in CHIPS)
    raise FitError(f'chip={name!r} is not one fit knows; choose from {known}.')
  return found


# Compiling
# ------------------------------------------------------------------------------

_REFUSAL = re.compile(
  r'(?:required for HLO temporaries|Used)\s*\(?([0-9.]+)\s*([KMGT]?)i?B?\)?'
  r'.*?(?:available HBM|of)\s*\(?([0-9.]+)\s*([KMGT]?)i?B?\)?',
  re.S,
)
_UNIT = {'': 1, 'K': 1 << 10, 'M': 1 << 20, 'G': 1 << 30, 'T': 1 << 40}


def parse_refusal(message: str) -> rep.Refusal | None:
  """The compiler's required and available bytes from an out-of-memory error.

  Example:
    >>> r = parse_refusal('RESOURCE_EXHAUSTED: Ran out of memory on HBM, the '
    ...   'total memory required for HLO temporaries (115.85G) exceeds available '
    ...   'HBM (95.74G).')
    >>> round(r.required_bytes / 2**30, 2), round(r.available_bytes / 2**30, 2)
    (115.85, 95.74)
  """
  if 'RESOURCE_EXHAUSTED' not in message and 'Ran out of memory' not in message:
    return None
  first = message.strip().split('\n')[0]
  m = _REFUSAL.search(first)
  if m is None:
    return rep.Refusal(0, 0, first)
  need = float(m.group(1)) * _UNIT[m.group(2)]
  have = float(m.group(3)) * _UNIT[m.group(4)]
  return rep.Refusal(int(need), int(have), first)


def _compile(lowered: Any) -> tuple[Any, rep.Refusal | None, float]:
  start = time.perf_counter()
  try:
    compiled = lowered.compile()
  except Exception as e:  # jax's JaxRuntimeError (XlaRuntimeError before)
    refusal = parse_refusal(str(e))
    if refusal is None:
      raise FitError(
        f'the compiler failed on the step (not for lack of memory): '
        f'{str(e).strip().splitlines()[0]}'
      ) from e
    return None, refusal, time.perf_counter() - start
  return compiled, None, time.perf_counter() - start


def _memory(compiled: Any) -> dict[str, int]:
  stats = compiled.memory_analysis()
  fields = (
    'argument_size_in_bytes',
    'output_size_in_bytes',
    'alias_size_in_bytes',
    'temp_size_in_bytes',
    'generated_code_size_in_bytes',
    'host_argument_size_in_bytes',
    'host_output_size_in_bytes',
    'host_alias_size_in_bytes',
    'host_temp_size_in_bytes',
    'host_generated_code_size_in_bytes',
  )
  return {f: int(getattr(stats, f, 0) or 0) for f in fields}


def _cost(compiled: Any) -> dict[str, float]:
  try:
    cost = compiled.cost_analysis()
  except Exception:  # some backends have none; the report says so
    return {}
  if isinstance(cost, (list, tuple)):  # older jax: one dict per program
    cost = cost[0] if cost else {}
  return {str(k): float(v) for k, v in (cost or {}).items()}


def _input_bytes(compiled: Any, arguments: Arguments) -> list[int]:
  """Bytes per device of each array leaf, as the compiled program holds it."""
  try:
    shardings = jax.tree_util.tree_leaves(compiled.input_shardings[0])
  except Exception:
    return list(arguments.plan_bytes)
  if len(shardings) != len(arguments.shapes):
    return list(arguments.plan_bytes)
  out = []
  for s, (shape, dtype) in zip(shardings, arguments.shapes):
    shard = s.shard_shape(tuple(shape)) if hasattr(s, 'shard_shape') else shape
    out.append(math.prod(shard) * np.dtype(dtype).itemsize)
  return out


def _figures(target: Step, arguments: Arguments, use_cache: bool) -> dict[str, Any]:
  """Compiles (or reads the cache) and returns the program's figures.

  The cache keeps XLA's own figures and the optimised HLO text; the HLO is
  read again by this version's ``hlo.summarize``, so cached collectives and
  loop counts are never those of an older reader.
  """
  lowered = target.lower(*arguments.lowered)
  mesh = target.mesh
  key = cache_lib.key(lowered.as_text(), mesh.devices)
  found = cache_lib.load(key, on_disk=use_cache)
  cached = found is not None
  if found is None:
    compiled, refusal, seconds = _compile(lowered)
    if refusal is not None:
      found = {'refusal': dataclasses.asdict(refusal), 'seconds': seconds}
    else:
      found = {
        'memory': _memory(compiled),
        'cost': _cost(compiled),
        'input_bytes': _input_bytes(compiled, arguments),
        'seconds': seconds,
      }
      cache_lib.store_text(key, compiled.as_text(), on_disk=use_cache)
    cache_lib.store(key, found, on_disk=use_cache)
  figures = dict(found)
  if 'refusal' not in figures:
    text = cache_lib.load_text(key, on_disk=use_cache)
    if text is None:  # a cache entry without its program: compile again
      cache_lib.forget(key)
      return _figures(target, arguments, use_cache)
    summary = hlo.summarize(text, mesh.devices, mesh.axis_names)
    figures['summary'] = summary.to_dict()
  figures['cached'] = cached
  figures['compile_seconds'] = 0.0 if cached else figures['seconds']
  return figures


def _compiled_report(
  target: Step,
  args: Sequence[Any],
  capacity: int | None,
  chip_spec: Chip | None,
  use_cache: bool,
) -> rep.FitReport:
  arguments = prepare(target, args)
  figures = _figures(target, arguments, use_cache)
  mesh = target.mesh
  chip = chip_spec or chip_of(mesh.devices)
  hbm = capacity if capacity is not None else (chip.hbm_bytes if chip else None)
  common = {
    'mesh': dict(zip(mesh.axis_names, mesh.axis_sizes)),
    'devices': describe(mesh.devices),
    'chip': chip,
    'compile_seconds': figures['compile_seconds'],
    'cached': figures['cached'],
  }
  by_category = _sum_by_category(arguments.categories, arguments.plan_bytes)
  if 'refusal' in figures:
    refusal = rep.Refusal(**figures['refusal'])
    return _refused_report(refusal, by_category, capacity, common)
  memory = figures['memory']
  summary = hlo.ProgramSummary.from_dict(figures['summary'])
  by_category = _sum_by_category(arguments.categories, figures['input_bytes'])
  rows = memory_rows(memory, by_category)
  cost = figures['cost']
  flops = cost['flops'] + summary.extra_flops if 'flops' in cost else None
  traffic = cost.get('bytes accessed')
  traffic = traffic + summary.extra_bytes if traffic is not None else None
  collectives = group(summary.collectives, chip)
  notes = _notes(mesh, chip, summary, capacity)
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
    **common,
  )


def _sum_by_category(categories: list[str], sizes: list[int]) -> dict[str, int]:
  out = {rep.PARAMETERS: 0, rep.OPTIMIZER: 0, rep.INPUTS: 0}
  for c, b in zip(categories, sizes):
    out[c] = out.get(c, 0) + int(b)
  return out


def memory_rows(
  memory: dict[str, int], by_category: dict[str, int]
) -> tuple[rep.Row, ...]:
  """The breakdown: argument categories (adding up to XLA's argument bytes),
  outputs not donated, temporaries and generated code."""
  args = memory['argument_size_in_bytes']
  known = sum(by_category.values())
  return (
    rep.Row(rep.PARAMETERS, by_category[rep.PARAMETERS], 'arguments, by the plan'),
    rep.Row(rep.OPTIMIZER, by_category[rep.OPTIMIZER], 'arguments, by the plan'),
    rep.Row(rep.INPUTS, by_category[rep.INPUTS], 'arguments'),
    rep.Row(rep.PADDING, args - known, 'argument bytes XLA adds (padding, layout)'),
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


def _refused_report(
  refusal: rep.Refusal,
  by_category: dict[str, int],
  capacity: int | None,
  common: dict[str, Any],
) -> rep.FitReport:
  known = sum(by_category.values())
  rows = (
    rep.Row(rep.PARAMETERS, by_category[rep.PARAMETERS], 'arguments, by the plan'),
    rep.Row(rep.OPTIMIZER, by_category[rep.OPTIMIZER], 'arguments, by the plan'),
    rep.Row(rep.INPUTS, by_category[rep.INPUTS], 'arguments, by the plan'),
    rep.Row(
      rep.TEMPORARIES,
      max(refusal.required_bytes - known, 0),
      'the rest of what the compiler requires',
    ),
  )
  return rep.FitReport(
    source='compiled',
    method='the compiler refused the program for lack of memory; arguments '
    'from the plan, the rest from its message',
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
  platform = getattr(next(iter(mesh.devices.flat)), 'platform', '')
  if chip is None and platform == 'cpu':
    notes.append(
      "compiled for CPU devices: XLA's CPU figures; pass hbm= for a verdict "
      "and chip= (e.g. 'v5p') for a roofline, or use a TPU topology"
    )
  if chip is None and capacity is None and platform != 'cpu':
    notes.append('unknown device kind: pass hbm= for a verdict')
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
  step, *args = _built(build, layers)
  target = Step.of(step, len(args))
  full = prepare(target, args)
  return extrapolate(small, large, a, b, layers, full)


def _built(build: Callable[[int], Any], n: int) -> tuple[Any, ...]:
  made = build(n)
  if not isinstance(made, (tuple, list)) or not made:
    raise FitError(
      f'the builder returned {type(made).__name__} for {n} layers; with layers=, '
      'fit takes a function num_layers -> (jitted_step, *abstract_args).'
    )
  return tuple(made)


def extrapolate(
  small: rep.FitReport,
  large: rep.FitReport,
  a: int,
  b: int,
  layers: int,
  full: Arguments,
) -> rep.FitReport:
  """The report at ``layers`` from reports at ``a`` and ``b`` layers.

  Every figure is ``f(a) + (f(b) - f(a)) (layers - a) / (b - a)``; the
  argument categories are exact, from the plan of the full model.
  """
  t = (layers - a) / (b - a)

  def line(x: float | None, y: float | None) -> float | None:
    if x is None or y is None:
      return None
    return x + (y - x) * t

  if small.memory_analysis is None or large.memory_analysis is None:
    raise FitError('extrapolation needs two compiled reports with memory figures.')
  memory = {
    k: round(line(small.memory_analysis[k], large.memory_analysis[k]) or 0)
    for k in small.memory_analysis
  }
  by_category = _sum_by_category(full.categories, full.plan_bytes)
  rows = memory_rows(memory, by_category)
  pairs: dict[Any, list[Any]] = {}
  for which, r in ((0, small), (1, large)):
    for c in r.collectives:
      pairs.setdefault((c.kind, c.axes, c.crosses_slices), [None, None])[which] = c
  collectives = []
  for (kind, axes, crosses), (x, y) in pairs.items():
    zero = dataclasses.replace(x or y, count=0, bytes=0.0, seconds=0.0)
    x, y = x or zero, y or zero
    count = round(line(x.count, y.count) or 0)
    seconds = line(x.seconds, y.seconds)
    bytes_ = line(x.bytes, y.bytes) or 0.0
    collectives.append(
      dataclasses.replace(
        x,
        kind=kind,
        axes=axes,
        crosses_slices=crosses,
        count=count,
        bytes=bytes_,
        seconds=seconds,
      )
    )
  flops = line(small.flops, large.flops)
  traffic = line(small.bytes_accessed, large.bytes_accessed)
  chip = large.chip
  return dataclasses.replace(
    large,
    method=f'extrapolated linearly from compiles at {a} and {b} layers to {layers} '
    '(each scanned layer adds the same bytes, collectives and flops); '
    'exact=True compiles all of them',
    rows=rows,
    total_bytes=sum(r.bytes for r in rows),
    memory_analysis=memory,
    donated_bytes=memory['alias_size_in_bytes'],
    collectives=tuple(sorted(collectives, key=lambda c: (c.kind, -c.bytes))),
    flops=flops,
    bytes_accessed=traffic,
    cost_analysis=None,
    roofline=roofline(chip, flops or 0.0, traffic or 0.0, collectives)
    if flops is not None
    else None,
    loops=(),
    compile_seconds=small.compile_seconds + large.compile_seconds,
    cached=small.cached and large.cached,
  )
