"""``fsm.suggest``: the best mesh, rules and remat for a model on a pod.

Candidates are every way of splitting the chips over a preset's mesh axes,
times the rule presets, times the remat policies. A preset none of whose
logical names the model uses is skipped with a warning (its layout would be
plain data parallelism). Cheap checks come first and are exact, so they never
reject a layout that could fit: a candidate whose shapes do not divide its
axes, or whose parameters, optimizer state and gradients alone exceed the most
memory it could be given (on GPUs: the usable memory at the largest fraction
``fit`` proposes), is rejected from its plan without compiling. The rest are
ordered by the estimate (``fit`` on an abstract mesh, a second each; one too
close to call counts as fitting) and the most promising ``max_candidates`` are
compiled with ``fit``.

Those that fit (on GPUs: at the run's allocator fraction) rank first, then
those that fit only with a raised ``XLA_CLIENT_MEM_FRACTION`` (the smallest
first), then the rest; within each, by estimated step time, then by headroom.
On GPUs the step time is the roofline's compute and collective time without
its HBM term: a GPU program compiled without a GPU is not autotuned (its
matmuls are cuBLAS calls with their neighbours unfused), so its HBM bytes are
inflated, and remat lowers them. Last, a layout never
ranks above the same mesh and preset with less remat when both fit.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

from flax_shardmeta._capacity.fit import gpu_verdict, usable as usable_lib
from flax_shardmeta._capacity.fit.traced_step import Step, prepare
from flax_shardmeta._capacity.fit.will_it_fit import fit
from flax_shardmeta._capacity.report import OPTIMIZER, PARAMETERS, FitReport
from flax_shardmeta._capacity.suggest import presets as presets_lib, ranking
from flax_shardmeta._capacity.suggest.candidate import (
  Candidate,
  Suggestions,
  verdict_words,
)
from flax_shardmeta._capacity.suggest.presets import RulePreset
from flax_shardmeta._devices.chips import Chip, chip_named, chip_of, parse_bytes
from flax_shardmeta._devices.gpu import described_memory
from flax_shardmeta._devices.topology import device_mesh, topology_devices
from flax_shardmeta._errors import (
  FitError,
  FlaxShardmetaError,
  ShardingError,
  message,
)
from flax_shardmeta._specs import format_spec
from flax_shardmeta._units import format_bytes

Build = Callable[[Any, Sequence[tuple[str, Any]], str], Sequence[Any]]
"""``build(mesh, rules, remat) -> (step, *abstract_args)``: what ``fit`` takes."""

# Axes that should stay inside one host: their collectives run every layer.
_INSIDE_A_HOST = ('model', 'expert')


def _factorizations(
  axes: Sequence[str], n: int, per_host: int, num_slices: int
) -> Iterable[tuple[int, ...]]:
  """Every split of ``n`` chips over ``axes``: model-like axes inside one host
  (together), the first axis spanning the slices; an axis of size 1 other than
  'data' adds nothing another preset lacks, so only pure data parallelism
  keeps one."""

  def split(k: int, i: int) -> Iterable[tuple[int, ...]]:
    if i == len(axes) - 1:
      yield (k,)
      return
    for d in range(1, k + 1):
      if k % d == 0:
        for rest in split(k // d, i + 1):
          yield (d, *rest)

  for sizes in split(n, 0):
    named = dict(zip(axes, sizes))
    inside = math.prod(named[a] for a in _INSIDE_A_HOST if a in named)
    if inside > 1 and per_host % inside:
      continue
    if num_slices > 1 and sizes[0] % num_slices:
      continue
    ones = [a for a, s in named.items() if s == 1 and a != 'data']
    if ones and not (tuple(axes) == ('data', 'fsdp') and named['data'] == n):
      continue
    yield sizes


def suggest(
  build: Build,
  *,
  batch: int,
  tokens_per_example: int = 1,
  topology: str | None = None,
  num_slices: int = 1,
  target_config: str | None = None,
  devices: Sequence[Any] | None = None,
  hbm: int | str | None = None,
  chip: str | None = None,
  presets: Iterable[str | RulePreset] = presets_lib.DEFAULT_PRESETS,
  remat: Iterable[str] = ('none', 'full'),
  max_candidates: int = 8,
  progress: bool | Callable[[str], None] = True,
  cache: bool = True,
  mem_fraction: float | None = None,
  reserve: int | str | None = None,
) -> Suggestions:
  """Searches meshes, rule presets and remat policies for the best layout.

  On GPUs every candidate is judged as :func:`fit` judges it: against the
  memory a real run gives XLA (``mem_fraction`` of the GPU's memory, less
  what of the reserve does not fit beside it). A candidate that fits only
  with a raised ``XLA_CLIENT_MEM_FRACTION`` is marked so and ranks after
  those that fit at the run's fraction, before those that do not fit.

  Args:
    build: ``build(mesh, rules, remat) -> (step, *abstract_args)``, what
      :func:`fit` takes (``flax_shardmeta.examples.train.builder`` makes one
      for the built-in models). Its annotated arguments' logical names decide
      which presets apply: one none of whose names (``batch`` aside) the
      model uses is skipped with a warning.
    batch: the global batch size: every candidate's batch axes must divide it.
    tokens_per_example: tokens per example (the sequence length), for
      tokens/s/chip.
    topology: a TPU pod to compile for, e.g. ``'v5p:4x4x8'`` (needs libtpu),
      or a GPU cluster, ``'h100:4x8'`` (nodes x GPUs per node; the CUDA
      plugin): tensor-parallel axes then stay inside a node (NVLink).
    num_slices: slices of the TPU topology; the first mesh axis spans them.
    target_config: with ``topology='custom:NxG'``, the GPU's description.
    devices: other devices to lay meshes over (default: this machine's).
    hbm: memory per chip to judge against (default: the chip's); on GPUs,
      the GPU's memory, of which the allocator takes its fraction.
    chip: chip figures when the devices do not say (e.g. CPU devices).
    presets: preset names (``'fsdp'``, ``'fsdp+tp'``, ``'tp'``, ``'t5x-1d'``,
      ``'t5x-2d'``, ``'ep'``, ``'ep+tp'``) or :class:`RulePreset` objects.
    remat: remat policies to try, least remat first: a layout never ranks
      above the same mesh and preset with a policy listed before its own
      when both fit.
    max_candidates: at most this many are compiled (the most promising by
      the estimate, spread over the presets and remat policies).
    progress: print progress to stderr (or call this with each line).
    cache: reuse compiled figures (see :func:`fit`).
    mem_fraction: GPUs: the allocator fraction the run will use (default:
      ``XLA_CLIENT_MEM_FRACTION`` from the environment, else jax's 0.75).
    reserve: GPUs: bytes (or text like ``'3GiB'``) the run holds outside
      XLA's pool per GPU (default: the CUDA context and each layout's NCCL
      communicators, see :func:`fit`).

  Returns:
    :class:`Suggestions`, best first; ``suggestions[0].compare()`` says why.

  Raises:
    FitError: malformed arguments (batch, hbm, max_candidates, mem_fraction,
      reserve).

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> def build(mesh, rules, remat):  # built-in models: examples.train.builder
    ...   w = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    ...   params = {'w': fsm.LogicalPartitioned(w, ('embed', 'mlp'))}
    ...   x = jax.ShapeDtypeStruct((64, 1024), jnp.float32)
    ...   x = fsm.LogicalPartitioned(x, ('batch', 'embed'))
    ...   loss = lambda p, x: jnp.tanh(x @ fsm.unbox(p)['w']).sum()
    ...   return fsm.jit(jax.grad(loss), mesh=mesh, rules=rules), params, x
    >>> found = fsm.suggest(build, batch=64, chip='v5p', presets=['fsdp', 'tp'],
    ...                     remat=['none'], max_candidates=2, progress=False)
    >>> len(found), found[0].fits, found[0].preset.name in ('fsdp', 'tp')
    (2, True, True)
  """
  start = time.perf_counter()
  _check_arguments(batch, max_candidates)
  say = _progress(progress)
  pool = _pool(topology, num_slices, devices, target_config)
  spec = chip_named(chip) if chip else chip_of(pool)
  capacity = _capacity(hbm, spec)
  if capacity is None:  # a custom GPU: its own description's memory
    capacity = described_memory(pool)
  where = _Where(pool, topology, num_slices)
  memory = _Memory.of(capacity, where.on_gpu, mem_fraction, reserve)
  policies = tuple(remat)
  resolved = presets_lib.resolve(presets)
  candidates = _candidates(resolved, policies, where, batch * tokens_per_example)
  first = _first_built(build, candidates)
  unused: dict[str, str] = {}
  if first is not None:
    unused = presets_lib.unused_presets(resolved, presets_lib.model_names(first[1][1:]))
    candidates = [c for c in candidates if c.preset.name not in unused]
  say(f'{len(candidates)} candidates over {len(pool)} devices; checking plans')
  runs = {'mem_fraction': mem_fraction, 'reserve': reserve}
  estimate_chip = chip or (spec.name if spec is not None else None)
  for c in candidates:
    built = first[1] if first is not None and c is first[0] else None
    _check(c, build, where, batch, memory, estimate_chip, runs, built)
  viable = [c for c in candidates if c.rejected is None]
  rejected = [c for c in candidates if c.rejected is not None]
  chosen = _pick(viable, max_candidates, memory)
  skipped = [c for c in viable if c not in chosen]
  for i, c in enumerate(chosen, 1):
    t = time.perf_counter()
    step, *args = build(_mesh(c, where), c.preset.rules, c.remat)
    c.report = r = fit(step, *args, hbm=capacity, chip=chip, cache=cache, **runs)
    say(f'[{i}/{len(chosen)}] {c.label}: {_compiled(r, time.perf_counter() - t)}')
  ranked = ranking.rank(chosen, policies)
  ranking.reasons(ranked, policies)
  return Suggestions(
    ranked,
    rejected,
    skipped,
    memory.judged_bytes,
    time.perf_counter() - start,
    usable=memory.usable,
    skipped_presets=unused,
  )


def _check_arguments(batch: Any, max_candidates: Any) -> None:
  if not isinstance(batch, int) or batch < 1:
    raise FitError(f'batch={batch!r}: give the global batch size, at least 1.')
  if not isinstance(max_candidates, int) or max_candidates < 1:
    raise FitError(f'max_candidates={max_candidates!r}: give at least 1.')


def _capacity(hbm: int | str | None, chip: Chip | None) -> int | None:
  """The memory per chip judged against: ``hbm``, else the chip's."""
  if hbm is not None:
    return parse_bytes(hbm)
  return chip.hbm_bytes if chip is not None else None


@dataclasses.dataclass(frozen=True)
class _Memory:
  """What the candidates are judged against.

  Attributes:
    capacity: memory per chip (``hbm=`` or the chip's; GPUs: the GPU's).
    usable: GPUs: a run's usable memory at its fraction, with the reserve of
      the CUDA context alone (or ``reserve=``): the most any layout gets at
      that fraction (its NCCL communicators take more).
  """

  capacity: int | None
  usable: usable_lib.UsableMemory | None

  @classmethod
  def of(
    cls,
    capacity: int | None,
    on_gpu: bool,
    mem_fraction: float | None,
    reserve: int | str | None,
  ) -> _Memory:
    # A bad fraction or reserve is refused at once, GPU or not.
    usable_lib.check_run(mem_fraction, reserve)
    if not on_gpu or capacity is None:
      return cls(capacity, None)
    run = gpu_verdict.RunMemory(mem_fraction, reserve)
    return cls(capacity, run.memory(capacity, ()))

  @property
  def judged_bytes(self) -> int | None:
    """The memory a layout is judged to fit in: usable memory on GPUs."""
    return self.usable.usable_bytes if self.usable is not None else self.capacity

  @property
  def most_bytes(self) -> int | None:
    """The most memory any layout could be judged to fit in: on GPUs at the
    largest fraction ``fit`` proposes (or the run's, when larger)."""
    if self.usable is None:
      return self.capacity
    top = max(self.usable.fraction, usable_lib.MAX_FRACTION)
    return self.usable.with_fraction(top, 'the largest fraction').usable_bytes

  def most_text(self) -> str:
    """What :attr:`most_bytes` is, in words."""
    most = format_bytes(self.most_bytes or 0)
    if self.usable is None:
      return most
    top = max(self.usable.fraction, usable_lib.MAX_FRACTION)
    name = usable_lib.FRACTION_VARIABLES[0]
    return (
      f'{most}, the most a run can give XLA ({name}={top:.2f}, the largest '
      f'fraction fit proposes, of {format_bytes(self.usable.device_bytes)}, '
      f'{format_bytes(self.usable.reserve_bytes)} held outside its pool)'
    )


def _compiled(r: FitReport, seconds: float) -> str:
  """How a compiled candidate came out, for the progress line."""
  cached = ', cached' if r.cached else ''
  return (
    f'{format_bytes(r.total_bytes)} per chip, {verdict_words(r)} '
    f'({seconds:.0f} s{cached})'
  )


@dataclasses.dataclass(frozen=True)
class _Where:
  """The devices candidates are laid over, and the pod they come from."""

  pool: Sequence[Any]
  topology: str | None
  num_slices: int

  @property
  def per_host(self) -> int:
    hosts = {getattr(d, 'process_index', 0) for d in self.pool}
    return len(self.pool) // max(len(hosts), 1)

  @property
  def on_gpu(self) -> bool:
    """GPU devices (``fit`` compiles their programs without a GPU)."""
    return bool(self.pool) and getattr(self.pool[0], 'platform', '') == 'gpu'


def _pool(
  topology: str | None,
  num_slices: int,
  devices: Sequence[Any] | None,
  target_config: str | None,
) -> list[Any]:
  if topology is not None:
    return list(
      topology_devices(topology, num_slices=num_slices, target_config=target_config)
    )
  return list(devices if devices is not None else jax.devices())


def _candidates(
  presets: Sequence[RulePreset],
  policies: Sequence[str],
  where: _Where,
  tokens: int,
) -> list[Candidate]:
  """Every preset, split of the chips over its axes, and remat policy."""
  n = len(where.pool)
  return [
    Candidate(
      p,
      dict(zip(p.axes, sizes)),
      r,
      _topology=where.topology,
      _num_slices=where.num_slices,
      _tokens=tokens,
      _gpu=where.on_gpu,
    )
    for p in presets
    for sizes in _factorizations(p.axes, n, where.per_host, where.num_slices)
    for r in policies
  ]


# Presets the model has no names for
# ------------------------------------------------------------------------------


def _first_built(
  build: Build, candidates: Sequence[Candidate]
) -> tuple[Candidate, tuple[Any, ...]] | None:
  """The first candidate the build lays out on its abstract mesh, and what it
  returned (its shapes may not divide another's axes; those are rejected by
  their own check)."""
  for c in candidates:
    try:
      return c, tuple(build(_abstract_mesh(c), c.preset.rules, c.remat))
    except ShardingError:
      continue
  return None


# The cheap checks and the estimate
# ------------------------------------------------------------------------------


def _progress(progress: bool | Callable[[str], None]) -> Callable[[str], None]:
  if callable(progress):
    return progress
  if progress:
    return lambda line: print(line, file=sys.stderr, flush=True)
  return lambda line: None


def _mesh(c: Candidate, where: _Where) -> Any:
  """The candidate's mesh over the pool, its first axis spanning the slices."""
  sizes, names = tuple(c.shape.values()), tuple(c.shape)
  auto = (jax.sharding.AxisType.Auto,) * len(names)
  dcn = None
  if where.num_slices > 1:
    dcn = (where.num_slices,) + (1,) * (len(names) - 1)
  return device_mesh(sizes, names, where.pool, auto, dcn_axis_sizes=dcn)


def _abstract_mesh(c: Candidate) -> jax.sharding.AbstractMesh:
  return jax.sharding.AbstractMesh(
    tuple(c.shape.values()),
    tuple(c.shape),
    axis_types=(jax.sharding.AxisType.Auto,) * len(c.shape),
  )


def _check(
  c: Candidate,
  build: Build,
  where: _Where,
  batch: int,
  memory: _Memory,
  chip: str | None,
  runs: dict[str, Any],
  built: Sequence[Any] | None = None,
) -> None:
  """The exact cheap checks (batch and shapes divide, the state fits the most
  memory the layout could be given), then the estimate."""
  batch_ways = math.prod(
    c.shape[a]
    for name, target in c.preset.rules
    if name == 'batch'
    for a in ((target,) if isinstance(target, str) else tuple(target or ()))
  )
  if batch % batch_ways:
    c.rejected = f'the batch of {batch} does not divide over {batch_ways} batch shards'
    return
  try:
    mesh = _mesh(c, where)
  except FlaxShardmetaError as e:
    c.rejected = f'no such mesh here: {message(e)}'
    return
  del mesh  # it exists: the candidate can be compiled
  try:
    # The build itself may lay the arguments out (fsm.jit's in_shardings).
    if built is None:
      built = tuple(build(_abstract_mesh(c), c.preset.rules, c.remat))
    step, *args = built
    arguments = prepare(Step.of(step, len(args)), args)
  except ShardingError as e:
    first = e.problems[0]
    c.rejected = (
      f'shapes do not divide: {first.path} {first.shape} -> {format_spec(first.spec)}'
      f' ({len({q.path for q in e.problems})} array(s))'
    )
    return
  by_category = dict.fromkeys((PARAMETERS, OPTIMIZER), 0)
  for category, size in zip(arguments.categories, arguments.layout_bytes):
    if category in by_category:
      by_category[category] += size
  # Gradients are laid out like the parameters.
  c.lower_bound = 2 * by_category[PARAMETERS] + by_category[OPTIMIZER]
  most = memory.most_bytes
  if most is not None and c.lower_bound > most:
    c.rejected = (
      f'parameters, optimizer state and gradients alone need '
      f'{format_bytes(c.lower_bound)} per chip, over {memory.most_text()}'
    )
    return
  estimated = fit(step, *args, hbm=memory.capacity, chip=chip, **runs)
  c.estimate = estimated.total_bytes
  c.estimate_verdict = estimated.verdict_kind


def _pick(viable: list[Candidate], n: int, memory: _Memory) -> list[Candidate]:
  """The ``n`` most promising: estimated to fit (or too close to call) first,
  then those a raised fraction may hold, no remat before remat, then least
  memory; taken in turn from each (preset, remat) group."""

  def key(c: Candidate) -> tuple[Any, ...]:
    return (_estimated_tier(c, memory), c.remat != 'none', c.estimate or 0)

  groups: dict[tuple[str, str], list[Candidate]] = {}
  for c in sorted(viable, key=key):
    groups.setdefault((c.preset.name, c.remat), []).append(c)
  order = sorted(groups.values(), key=lambda g: key(g[0]))
  picked: list[Candidate] = []
  for round_ in itertools.zip_longest(*order):
    for c in round_:
      if c is not None and len(picked) < n:
        picked.append(c)
  return picked


def _estimated_tier(c: Candidate, memory: _Memory) -> int:
  """0: the estimate fits, is too close to call or has no verdict; 1 (GPUs):
  over the run's usable memory, within what a raised fraction gives; 2: over."""
  if c.estimate_verdict != 'does_not_fit':
    return 0
  most = memory.most_bytes
  if memory.usable is not None and most is not None and (c.estimate or 0) <= most:
    return 1
  return 2
