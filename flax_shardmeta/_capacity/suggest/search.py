"""The layouts ``fsm.suggest`` searches, and the exact cheap checks before any compile.

The device pool and its splits over a preset's mesh axes (model-like axes
inside one host, the first axis spanning the slices), the memory candidates
are judged against, and the checks that reject a candidate from its plan
alone (the batch or a shape does not divide, or the state cannot fit the most
memory the layout could be given) before ``fit``'s estimate orders the rest.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

from flax_shardmeta._capacity.fit import gpu_verdict, usable as usable_lib
from flax_shardmeta._capacity.fit.fit import fit
from flax_shardmeta._capacity.fit.traced_step import Step, prepare
from flax_shardmeta._capacity.report import OPTIMIZER, PARAMETERS
from flax_shardmeta._capacity.suggest.candidate import Candidate
from flax_shardmeta._capacity.suggest.offload_presets import (
  OFFLOAD_PRESETS,
  OffloadPreset,
)
from flax_shardmeta._capacity.suggest.presets import RulePreset
from flax_shardmeta._devices.chips import Chip
from flax_shardmeta._devices.topology import device_mesh, topology_devices
from flax_shardmeta._errors import (
  FitError,
  FlaxShardmetaError,
  ShardingError,
  SizeError,
  message,
)
from flax_shardmeta._programs.hosts import devices_per_host
from flax_shardmeta._specs import format_spec
from flax_shardmeta._units import format_bytes, parse_bytes

Build = Callable[..., Sequence[Any]]
"""``build(mesh, rules, remat) -> (step, *abstract_args)``: what ``fit`` takes;
``build(mesh, rules, remat, offload)`` for a candidate that offloads, and the
model's knobs as keyword arguments (``build(..., capacity_factor=1.25)``)."""


def built(build: Build, mesh: Any, c: Candidate) -> tuple[Any, ...]:
  """What ``build`` makes for candidate ``c`` on ``mesh``: its offload preset
  is passed only when it offloads, so builds without offload keep their three
  arguments; its knobs as keyword arguments."""
  knobs = dict(c.knobs)
  if c.offload.offloads:
    return tuple(build(mesh, c.preset.rules, c.remat, c.offload, **knobs))
  return tuple(build(mesh, c.preset.rules, c.remat, **knobs))


def knob_grid(knobs: Any) -> list[tuple[tuple[str, Any], ...]]:
  """Every combination of the knobs' values, in the order given
  (``[()]``: no knobs).

  Raises:
    FitError: knobs that are not a mapping of names to non-empty value lists.

  Example:
    >>> knob_grid({'capacity_factor': [1.0, 2.0]})
    [(('capacity_factor', 1.0),), (('capacity_factor', 2.0),)]
  """
  if not knobs:
    return [()]
  if not hasattr(knobs, 'items'):
    raise FitError(
      f'knobs={knobs!r}: expected a mapping of knob names to the values to try, '
      "e.g. knobs={'capacity_factor': [1.0, 1.25, 2.0]}"
    )
  axes = []
  for name, values in knobs.items():
    listed = list(values) if isinstance(values, (list, tuple, range)) else None
    if not isinstance(name, str) or not name.isidentifier() or not listed:
      raise FitError(
        f'knobs[{name!r}]={values!r}: a knob is a keyword argument name of the build '
        'with a non-empty list of values to try, e.g. '
        "knobs={'capacity_factor': [1.0, 1.25, 2.0]}"
      )
    axes.append([(name, v) for v in listed])
  return [tuple(combo) for combo in itertools.product(*axes)]


def check_knob_build(build: Build, grid: Sequence[tuple[tuple[str, Any], ...]]) -> None:
  """Knobs need a build that takes them as keyword arguments."""
  if grid == [()]:
    return
  knobs = dict(grid[0])
  try:
    inspect.signature(build).bind(None, (), 'none', **knobs)
  except TypeError:
    raise FitError(
      f'knobs {sorted(knobs)}: the build does not take them as keyword arguments; '
      'a knob is passed to the build as build(mesh, rules, remat, name=value) '
      '(flax_shardmeta.examples.train.builder takes capacity_factor for the '
      'mixture-of-experts models)'
    ) from None


def check_offload_build(build: Build, offloads: Sequence[OffloadPreset]) -> None:
  """Offload candidates need a build that takes the preset."""
  if not any(o.offloads for o in offloads):
    return
  try:
    inspect.signature(build).bind(None, (), 'none', offloads[-1])
  except TypeError:
    raise FitError(
      f'offload={[o.name for o in offloads]}: the build takes (mesh, rules, remat); '
      'to try offloads it must take a fourth argument, the fsm.OffloadPreset, and '
      'lay the step out as it says (optimizer state in host memory: '
      'fsm.in_host_memory; named activations: a remat policy that offloads them). '
      'flax_shardmeta.examples.train.builder does so for the built-in models.'
    ) from None
  except ValueError:  # no signature to read (a builtin): try it as it is
    return


# Axes that should stay inside one host: their collectives run every layer,
# on the critical path. An expert axis may span hosts: its all-to-alls are
# what expert parallelism pays, over the network where it must (why() names
# the link).
_INSIDE_A_HOST = ('model',)


def factorizations(
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


def judged_capacity(hbm: int | str | None, chip: Chip | None) -> int | None:
  """The memory per chip judged against: ``hbm``, else the chip's."""
  if hbm is not None:
    try:
      return parse_bytes(hbm)
    except SizeError as e:
      raise FitError(f'hbm={hbm!r}: {message(e)}') from None
  return chip.hbm_bytes if chip is not None else None


@dataclasses.dataclass(frozen=True)
class Memory:
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
  ) -> Memory:
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


@dataclasses.dataclass(frozen=True)
class Where:
  """The devices candidates are laid over, and the pod they come from."""

  pool: Sequence[Any]
  topology: str | None
  num_slices: int

  @property
  def per_host(self) -> int:
    return devices_per_host(self.pool)

  @property
  def on_gpu(self) -> bool:
    """GPU devices (``fit`` compiles their programs without a GPU)."""
    return bool(self.pool) and getattr(self.pool[0], 'platform', '') == 'gpu'


def device_pool(
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


def candidates_of(
  presets: Sequence[RulePreset],
  policies: Sequence[str],
  where: Where,
  tokens: int,
  offloads: Sequence[OffloadPreset] = (),
  knobs: Sequence[tuple[tuple[str, Any], ...]] = ((),),
) -> list[Candidate]:
  """Every preset, split of the chips over its axes, remat policy, offload
  preset and combination of the model's knobs."""
  n = len(where.pool)
  return [
    Candidate(
      p,
      dict(zip(p.axes, sizes)),
      r,
      offload=o,
      knobs=k,
      _topology=where.topology,
      _num_slices=where.num_slices,
      _tokens=tokens,
      _gpu=where.on_gpu,
    )
    for p in presets
    for sizes in factorizations(p.axes, n, where.per_host, where.num_slices)
    for r in policies
    for o in (offloads or (OFFLOAD_PRESETS['none'],))
    for k in knobs
  ]


# Presets the model has no names for
# ------------------------------------------------------------------------------


def first_built(
  build: Build, candidates: Sequence[Candidate]
) -> tuple[Candidate, tuple[Any, ...]] | None:
  """The first candidate the build lays out on its abstract mesh, and what it
  returned (its shapes may not divide another's axes; those are rejected by
  their own check)."""
  for c in candidates:
    try:
      return c, built(build, abstract_mesh(c), c)
    except ShardingError:
      continue
  return None


def candidate_mesh(c: Candidate, where: Where) -> Any:
  """The candidate's mesh over the pool, its first axis spanning the slices."""
  sizes, names = tuple(c.shape.values()), tuple(c.shape)
  auto = (jax.sharding.AxisType.Auto,) * len(names)
  dcn = None
  if where.num_slices > 1:
    dcn = (where.num_slices,) + (1,) * (len(names) - 1)
  return device_mesh(sizes, names, where.pool, auto, dcn_axis_sizes=dcn)


def abstract_mesh(c: Candidate) -> jax.sharding.AbstractMesh:
  return jax.sharding.AbstractMesh(
    tuple(c.shape.values()),
    tuple(c.shape),
    axis_types=(jax.sharding.AxisType.Auto,) * len(c.shape),
  )


def check(
  c: Candidate,
  build: Build,
  where: Where,
  batch: int,
  memory: Memory,
  chip: str | None,
  runs: dict[str, Any],
  made: Sequence[Any] | None = None,
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
    mesh = candidate_mesh(c, where)
  except FlaxShardmetaError as e:
    c.rejected = f'no such mesh here: {message(e)}'
    return
  del mesh  # it exists: the candidate can be compiled
  try:
    # The build itself may lay the arguments out (fsm.jit's in_shardings).
    made = built(build, abstract_mesh(c), c) if made is None else made
    step, *args = made
    arguments = prepare(Step.of(step, len(args)), args)
  except ShardingError as e:
    first = e.problems[0]
    c.rejected = (
      f'shapes do not divide: {first.path} {first.shape} -> {format_spec(first.spec)}'
      f' ({len({q.path for q in e.problems})} array(s))'
    )
    return
  by_category = dict.fromkeys((PARAMETERS, OPTIMIZER), 0)
  hosted = arguments.on_host or [False] * len(arguments.layout_bytes)
  for category, size, on_host in zip(
    arguments.categories, arguments.layout_bytes, hosted
  ):
    if category in by_category and not on_host:  # host memory is not the chip's
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


def pick(viable: list[Candidate], n: int, memory: Memory) -> list[Candidate]:
  """The ``n`` most promising: estimated to fit (or too close to call) first,
  then those a raised fraction may hold, no remat before remat, no offload
  before offload, then least memory; taken in turn from each (preset, remat,
  offload, knobs) group, each preset's best group before any preset's second
  (a knob's values differ less than two presets do)."""

  def key(c: Candidate) -> tuple[Any, ...]:
    tier = _estimated_tier(c, memory)
    return (tier, c.remat != 'none', c.offload.offloads, c.estimate or 0)

  groups: dict[tuple[Any, ...], list[Candidate]] = {}
  for c in sorted(viable, key=key):
    groups.setdefault((c.preset.name, c.remat, c.offload.name, c.knobs), []).append(c)
  order = sorted(groups.values(), key=lambda g: key(g[0]))
  seen: dict[str, int] = {}
  nth = []  # each group's place among its preset's groups
  for g in order:
    nth.append(seen.get(g[0].preset.name, 0))
    seen[g[0].preset.name] = nth[-1] + 1
  order = [order[i] for i in sorted(range(len(order)), key=lambda i: (nth[i], i))]
  picked: list[Candidate] = []
  for round_ in itertools.zip_longest(*order):
    for c in round_:
      if c is not None and len(picked) < n:
        picked.append(c)
  return picked


def _estimated_tier(c: Candidate, memory: Memory) -> int:
  """0: the estimate fits, is too close to call or has no verdict; 1 (GPUs):
  over the run's usable memory, within what a raised fraction gives; 2: over."""
  if c.estimate_verdict != 'does_not_fit':
    return 0
  most = memory.most_bytes
  if memory.usable is not None and most is not None and (c.estimate or 0) <= most:
    return 1
  return 2
