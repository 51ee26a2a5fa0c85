"""``fsm.suggest``: the best mesh, rules and remat for a model on a pod.

Candidates are every way of splitting the chips over a preset's mesh axes,
times the rule presets, times the remat policies. Cheap checks come first and
are exact, so they never reject a layout that would fit: a candidate whose
shapes do not divide its axes, or whose parameters, optimizer state and
gradients alone exceed the HBM, is rejected from its plan without compiling.
The rest are ordered by the estimate (``fit`` on an abstract mesh, a second
each) and the most promising ``max_candidates`` are compiled with ``fit``.
Those that fit rank first, then by estimated step time (the roofline), then
by headroom.
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

from flax_shardmeta._capacity import presets as presets_lib
from flax_shardmeta._capacity.candidate import Candidate, Suggestions, summary
from flax_shardmeta._capacity.chips import Chip, chip_named, chip_of, parse_bytes
from flax_shardmeta._capacity.fit import fit
from flax_shardmeta._capacity.gpu import described_memory
from flax_shardmeta._capacity.presets import RulePreset
from flax_shardmeta._capacity.report import OPTIMIZER, PARAMETERS, FitReport
from flax_shardmeta._capacity.step import Step, prepare
from flax_shardmeta._capacity.topology import device_mesh, topology_devices
from flax_shardmeta._errors import FitError, FlaxShardmetaError, ShardingError
from flax_shardmeta._planning.format import format_bytes
from flax_shardmeta._specs import format_spec

Build = Callable[[Any, Sequence[tuple[str, Any]], str], Sequence[Any]]
"""``build(mesh, rules, remat) -> (step, *abstract_args)``: what ``fit`` takes."""

# Axes that should stay inside one host: their collectives run every layer.
_INSIDE_A_HOST = ('model', 'expert')


def _factorizations(
  axes: Sequence[str], n: int, per_host: int, num_slices: int
) -> Iterable[tuple[int, ...]]:
  """Every split of ``n`` chips over ``axes``: model-like axes inside one host,
  the first axis spanning the slices; an axis of size 1 other than 'data'
  adds nothing another preset lacks, so only pure data parallelism keeps one."""

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
    if any(named[a] > 1 and per_host % named[a] for a in _INSIDE_A_HOST if a in named):
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
) -> Suggestions:
  """Searches meshes, rule presets and remat policies for the best layout.

  Args:
    build: ``build(mesh, rules, remat) -> (step, *abstract_args)``, what
      :func:`fit` takes (``flax_shardmeta.examples.train.builder`` makes one
      for the built-in models).
    batch: the global batch size: every candidate's batch axes must divide it.
    tokens_per_example: tokens per example (the sequence length), for
      tokens/s/chip.
    topology: a TPU pod to compile for, e.g. ``'v5p:4x4x8'`` (needs libtpu),
      or a GPU cluster, ``'h100:4x8'`` (nodes x GPUs per node; the CUDA
      plugin): tensor-parallel axes then stay inside a node (NVLink).
    num_slices: slices of the TPU topology; the first mesh axis spans them.
    target_config: with ``topology='custom:NxG'``, the GPU's description.
    devices: other devices to lay meshes over (default: this machine's).
    hbm: memory per chip to judge against (default: the chip's).
    chip: chip figures when the devices do not say (e.g. CPU devices).
    presets: preset names (``'fsdp'``, ``'fsdp+tp'``, ``'tp'``, ``'t5x-1d'``,
      ``'t5x-2d'``, ``'ep'``) or :class:`RulePreset` objects.
    remat: remat policies to try.
    max_candidates: at most this many are compiled (the most promising by
      the estimate, spread over the presets and remat policies).
    progress: print progress to stderr (or call this with each line).
    cache: reuse compiled figures (see :func:`fit`).

  Returns:
    :class:`Suggestions`, best first; ``suggestions[0].compare()`` says why.

  Raises:
    FitError: malformed arguments (batch, hbm, max_candidates).

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
  capacity = _capacity(hbm, chip_named(chip) if chip else chip_of(pool))
  if capacity is None:  # a custom GPU: its own description's memory
    capacity = described_memory(pool)
  where = _Where(pool, topology, num_slices)
  candidates = _candidates(presets, remat, where, batch * tokens_per_example)
  say(f'{len(candidates)} candidates over {len(pool)} devices; checking plans')
  for c in candidates:
    _check(c, build, where, batch, capacity, chip)
  viable = [c for c in candidates if c.rejected is None]
  rejected = [c for c in candidates if c.rejected is not None]
  chosen = _pick(viable, max_candidates, capacity)
  skipped = [c for c in viable if c not in chosen]
  for i, c in enumerate(chosen, 1):
    t = time.perf_counter()
    step, *args = build(_mesh(c, where), c.preset.rules, c.remat)
    c.report = r = fit(step, *args, hbm=capacity, chip=chip, cache=cache)
    say(f'[{i}/{len(chosen)}] {c.label}: {_compiled(r, time.perf_counter() - t)}')
  ranked = sorted(chosen, key=_rank_key)
  _reasons(ranked)
  return Suggestions(ranked, rejected, skipped, capacity, time.perf_counter() - start)


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


def _compiled(r: FitReport, seconds: float) -> str:
  """How a compiled candidate came out, for the progress line."""
  verdict = 'fits' if r.fits else 'does not fit'
  cached = ', cached' if r.cached else ''
  return f'{format_bytes(r.total_bytes)} per chip, {verdict} ({seconds:.0f} s{cached})'


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
  presets: Iterable[str | RulePreset], remat: Iterable[str], where: _Where, tokens: int
) -> list[Candidate]:
  """Every preset, split of the chips over its axes, and remat policy."""
  policies = tuple(remat)
  n = len(where.pool)
  return [
    Candidate(
      p,
      dict(zip(p.axes, sizes)),
      r,
      _topology=where.topology,
      _num_slices=where.num_slices,
      _tokens=tokens,
    )
    for p in presets_lib.resolve(presets)
    for sizes in _factorizations(p.axes, n, where.per_host, where.num_slices)
    for r in policies
  ]


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


def _check(
  c: Candidate,
  build: Build,
  where: _Where,
  batch: int,
  capacity: int | None,
  chip: str | None,
) -> None:
  """The exact cheap checks: batch and shapes divide, the state fits."""
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
    c.rejected = f'no such mesh here: {e}'
    return
  del mesh  # it exists: the candidate can be compiled
  abstract = jax.sharding.AbstractMesh(
    tuple(c.shape.values()),
    tuple(c.shape),
    axis_types=(jax.sharding.AxisType.Auto,) * len(c.shape),
  )
  step, *args = build(abstract, c.preset.rules, c.remat)
  try:
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
  if capacity is not None and c.lower_bound > capacity:
    c.rejected = (
      f'parameters, optimizer state and gradients alone need '
      f'{format_bytes(c.lower_bound)} per chip, over {format_bytes(capacity)}'
    )
    return
  c.estimate = fit(step, *args, chip=chip).total_bytes


def _pick(viable: list[Candidate], n: int, capacity: int | None) -> list[Candidate]:
  """The ``n`` most promising: estimated to fit first, no remat before remat,
  then least memory; taken in turn from each (preset, remat) group."""

  def key(c: Candidate) -> tuple[Any, ...]:
    likely_out = capacity is not None and (c.estimate or 0) > capacity
    return (likely_out, c.remat != 'none', c.estimate or 0)

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


def _rank_key(c: Candidate) -> tuple[Any, ...]:
  r = c.report
  if r is None:
    return (True, math.inf, 0)
  step = c.step_s if c.step_s is not None else math.inf
  # The step time is an estimate: ones equal to three significant digits (as
  # printed) are a tie, and the headroom decides.
  if math.isfinite(step):
    step = float(f'{step:.3g}')
  return (not r.fits, step, -(r.headroom_bytes or 0))


def _reasons(ranked: list[Candidate]) -> None:
  """A one-line reason per candidate, against the one ranked just above it
  (the first against the second)."""
  for i, c in enumerate(ranked):
    ref = ranked[1] if i == 0 and len(ranked) > 1 else (ranked[i - 1] if i else None)
    c._next = ranked[i + 1] if i + 1 < len(ranked) else None
    c.reason = _reason(c, ref, first=i == 0)


def _reason(c: Candidate, ref: Candidate | None, first: bool) -> str:
  r = c.report
  if r is None:
    return c.rejected or 'not compiled'
  kinds = sorted(r.collectives, key=lambda x: -x.bytes)
  top = kinds[0] if kinds else None
  comm = (
    f'{top.kind}s {format_bytes(int(top.bytes))} per step over {top.over}'
    if top is not None
    else 'no collectives'
  )
  if not r.fits:
    return f'needs {format_bytes(-(r.headroom_bytes or 0))} more than the HBM; {comm}'
  if ref is None or ref.report is None:
    return f'{summary(c)}; {comm}'
  other = 'the next' if first else 'the one above'
  parts = []
  if c.step_s and ref.step_s:
    parts.append(f"step {c.step_s / ref.step_s:.2f}x {other}'s")
  temp = r.row('temporaries') - ref.report.row('temporaries')
  sign = '+' if temp >= 0 else '-'
  parts.append(f'activations {sign}{format_bytes(abs(temp))} vs {other}')
  parts.append(comm)
  return '; '.join(parts)
