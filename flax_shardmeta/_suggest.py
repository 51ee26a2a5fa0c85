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

from flax_shardmeta._errors import FitError, FlaxShardmetaError, ShardingError
from flax_shardmeta._hosts.mesh import make_mesh
from flax_shardmeta._planning import presets as presets_lib
from flax_shardmeta._planning.chips import chip_named, chip_of, parse_bytes
from flax_shardmeta._planning.fit import fit
from flax_shardmeta._planning.fit_format import format_seconds
from flax_shardmeta._planning.format import format_bytes
from flax_shardmeta._planning.presets import RulePreset
from flax_shardmeta._planning.report import OPTIMIZER, PARAMETERS, FitReport
from flax_shardmeta._planning.step import Step, prepare
from flax_shardmeta._planning.topology import topology_devices
from flax_shardmeta._specs import format_spec

Build = Callable[[Any, Sequence[tuple[str, Any]], str], Sequence[Any]]
"""``build(mesh, rules, remat) -> (step, *abstract_args)``: what ``fit`` takes."""

# Axes that should stay inside one host: their collectives run every layer.
_INSIDE_A_HOST = ('model', 'expert')


@dataclasses.dataclass
class Candidate:
  """One layout tried: a preset, a split of the chips over its axes, a remat.

  Attributes:
    preset: the rule preset.
    shape: mesh axis -> size.
    remat: the remat policy.
    report: the compiled :class:`FitReport` (None if not compiled).
    rejected: why it was rejected without compiling (None otherwise).
    lower_bound: parameters + optimizer state + gradients per chip, exact.
    estimate: the estimated total per chip (for ordering), if made.
    reason: one line on how it compares (set when ranked).

  Example:
    >>> import flax_shardmeta as fsm
    >>> c = fsm.Candidate(fsm.RULE_PRESETS['tp'], {'data': 2, 'model': 4}, 'none')
    >>> c.label, c.fits
    ('tp data=2 model=4, remat none', None)
  """

  preset: RulePreset
  shape: dict[str, int]
  remat: str
  report: FitReport | None = None
  rejected: str | None = None
  lower_bound: int | None = None
  estimate: int | None = None
  reason: str = ''
  _topology: str | None = dataclasses.field(default=None, repr=False)
  _num_slices: int = dataclasses.field(default=1, repr=False)
  _tokens: int = dataclasses.field(default=0, repr=False)

  @property
  def label(self) -> str:
    """``'fsdp+tp data=2 fsdp=16 model=4, remat none'``."""
    mesh = ' '.join(f'{k}={v}' for k, v in self.shape.items())
    return f'{self.preset.name} {mesh}, remat {self.remat}'

  @property
  def fits(self) -> bool | None:
    """Whether the compiled step fits (None if not compiled)."""
    return None if self.report is None else self.report.fits

  @property
  def total_bytes(self) -> int | None:
    """Bytes per chip of the compiled step."""
    return None if self.report is None else self.report.total_bytes

  @property
  def step_s(self) -> float | None:
    """Estimated step time (roofline, perfect overlap)."""
    if self.report is None or self.report.roofline is None:
      return None
    return self.report.roofline.step_s

  @property
  def tokens_per_second_per_chip(self) -> float | None:
    """Tokens (or examples) per second per chip at the estimated step time."""
    step, chips = self.step_s, math.prod(self.shape.values())
    if not step or not self._tokens:
      return None
    return self._tokens / step / chips

  def make_mesh_call(self) -> str:
    """The ``fsm.make_mesh(...)`` call that builds this candidate's mesh."""
    sizes = tuple(self.shape.values())
    names = tuple(self.shape)
    where = f", topology='{self._topology}'" if self._topology else ''
    if self._num_slices > 1:
      where += f', num_slices={self._num_slices}'
    return (
      f'fsm.make_mesh({sizes}, {names}{where},\n'
      f'              axis_types=(jax.sharding.AxisType.Auto,) * {len(names)})'
    )

  def explain(self, other: Candidate | None = None) -> str:
    """Why this candidate beats ``other`` (the next one, when ranked), category by
    category, then the mesh and rules to paste into a training script."""
    other = other if other is not None else self._next
    lines = [f'{self.label}']
    if self.report is not None:
      lines.append(f'  {_summary(self)}')
    if other is not None and other.report is not None and self.report is not None:
      lines.append(f'against {other.label}:')
      for row in self.report.rows:
        theirs = other.report.row(row.name)
        if row.bytes or theirs:
          lines.append(
            f'  {row.name:24s} {format_bytes(row.bytes):>11s} vs '
            f'{format_bytes(theirs):>11s} ({_signed(row.bytes - theirs)})'
          )
      lines.append(
        f'  {"total per chip":24s} {format_bytes(self.total_bytes or 0):>11s} vs '
        f'{format_bytes(other.total_bytes or 0):>11s}'
      )
      mine, theirs = self.report.collective_bytes, other.report.collective_bytes
      lines.append(
        f'  {"collectives per step":24s} {format_bytes(int(mine)):>11s} vs '
        f'{format_bytes(int(theirs)):>11s}'
      )
      if self.step_s and other.step_s:
        lines.append(
          f'  {"step time (estimate)":24s} {format_seconds(self.step_s):>11s} vs '
          f'{format_seconds(other.step_s):>11s} ({other.step_s / self.step_s:.2f}x)'
        )
    lines += [
      '',
      'mesh and rules for the training script:',
      f'  mesh = {self.make_mesh_call()}',
      f'  rules = {presets_lib.rules_text(self.preset.rules)}',
    ]
    if self.remat != 'none':
      lines.append(f'  remat policy: {self.remat!r} on each layer')
    return '\n'.join(lines)

  _next: Candidate | None = dataclasses.field(default=None, repr=False)

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form."""
    return {
      'preset': self.preset.name,
      'mesh': dict(self.shape),
      'remat': self.remat,
      'fits': self.fits,
      'total_bytes': self.total_bytes,
      'largest': None if self.report is None else self.report.largest_row.name,
      'headroom_bytes': None if self.report is None else self.report.headroom_bytes,
      'collective_bytes': None if self.report is None else self.report.collective_bytes,
      'step_s': self.step_s,
      'tokens_per_second_per_chip': self.tokens_per_second_per_chip,
      'reason': self.reason,
      'rejected': self.rejected,
      'lower_bound_bytes': self.lower_bound,
      'estimate_bytes': self.estimate,
    }


def _signed(n: int) -> str:
  return ('+' if n >= 0 else '-') + format_bytes(abs(n))


def _summary(c: Candidate) -> str:
  r = c.report
  if r is None:
    return c.rejected or 'not compiled'
  big = r.largest_row
  parts = [
    f'{format_bytes(r.total_bytes)} per chip ({big.name} {format_bytes(big.bytes)})',
    'fits' if r.fits else 'does not fit',
  ]
  if c.step_s:
    parts.append(f'step ~{format_seconds(c.step_s)}')
  return ', '.join(parts)


class Suggestions(list):
  """What :func:`suggest` returns: compiled candidates, best first.

  A list of :class:`Candidate` (those that fit first, then by estimated step
  time, then by headroom); ``rejected`` holds those rejected without
  compiling and why, ``skipped`` those beyond ``max_candidates``. ``print``
  shows the ranked table; ``to_dict()`` is JSON.

  Attributes:
    rejected: candidates rejected by the exact cheap checks, with the reason.
    skipped: viable candidates not compiled (beyond ``max_candidates``).
    hbm_bytes: the memory per chip judged against.
    seconds: how long the search took.

  Example:
    >>> import flax_shardmeta as fsm
    >>> c = fsm.Candidate(fsm.RULE_PRESETS['fsdp'], {'data': 1, 'fsdp': 8}, 'none',
    ...                   rejected='the batch of 6 does not divide over 8 batch shards')
    >>> found = fsm.Suggestions([], [c], [], hbm_bytes=2**30, seconds=0.0)
    >>> found.fitting, [r.rejected for r in found.rejected]
    ([], ['the batch of 6 does not divide over 8 batch shards'])
  """

  def __init__(
    self,
    ranked: Sequence[Candidate],
    rejected: Sequence[Candidate],
    skipped: Sequence[Candidate],
    hbm_bytes: int | None,
    seconds: float,
  ):
    super().__init__(ranked)
    self.rejected = list(rejected)
    self.skipped = list(skipped)
    self.hbm_bytes = hbm_bytes
    self.seconds = seconds

  @property
  def fitting(self) -> list[Candidate]:
    """The compiled candidates that fit, best first."""
    return [c for c in self if c.fits]

  @property
  def closest(self) -> Candidate | None:
    """When nothing fits: the compiled candidate needing the least memory."""
    compiled = [c for c in self if c.report is not None]
    return min(compiled, key=lambda c: c.total_bytes or 0) if compiled else None

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form (see the CLI's ``suggest --format json``)."""
    return {
      'hbm_bytes': self.hbm_bytes,
      'seconds': self.seconds,
      'ranked': [c.to_dict() for c in self],
      'rejected': [c.to_dict() for c in self.rejected],
      'skipped': [c.to_dict() for c in self.skipped],
    }

  def format(self, top: int | None = None) -> str:
    """The ranked table (the first ``top`` rows), then the rejected ones."""
    rows = [
      (
        '#',
        'mesh',
        'preset',
        'remat',
        'per chip',
        'largest',
        'headroom',
        'collectives',
        'step (est.)',
        'tokens/s/chip',
      )
    ]
    for i, c in enumerate(self[:top] if top else self, 1):
      r = c.report
      if r is None:
        continue
      big = r.largest_row
      tps = c.tokens_per_second_per_chip
      rows.append(
        (
          str(i),
          ' '.join(f'{k}={v}' for k, v in c.shape.items()),
          c.preset.name,
          c.remat,
          format_bytes(r.total_bytes),
          f'{big.name} {format_bytes(big.bytes)}',
          '-' if r.headroom_bytes is None else _signed(r.headroom_bytes),
          format_bytes(int(r.collective_bytes)),
          '-' if not c.step_s else format_seconds(c.step_s),
          '-' if tps is None else f'{tps:,.0f}',
        )
      )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
      '  '.join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows
    ]
    lines.insert(1, '-' * len(lines[0]))
    out = [f'{len(self.fitting)} of {len(self)} compiled layouts fit; best first:']
    for line, c in zip(lines[2:], self[:top] if top else self):
      out.append(line)
      out.append(f'    {c.reason}')
    out = [out[0], lines[0], lines[1], *out[1:]]
    if not self.fitting and self.closest is not None:
      c = self.closest
      short = (c.total_bytes or 0) - (self.hbm_bytes or 0)
      out.append(
        f'nothing fits; closest: {c.label}, {format_bytes(short)} over '
        f'{format_bytes(self.hbm_bytes or 0)}'
      )
    if self.rejected:
      out.append('')
      out.append(f'rejected without compiling ({len(self.rejected)}):')
      out += [f'  {c.label}: {c.rejected}' for c in self.rejected]
    if self.skipped:
      out.append(f'not compiled (beyond max_candidates): {len(self.skipped)}')
    return '\n'.join(out)

  def __str__(self) -> str:
    return self.format()


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
    topology: a TPU pod to compile for, e.g. ``'v5p:4x4x8'`` (needs libtpu).
    num_slices: slices of the topology; the first mesh axis spans them.
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
    :class:`Suggestions`, best first; ``suggestions[0].explain()`` says why.

  Raises:
    FitError: malformed arguments (batch, hbm, max_candidates).

  Example:
    >>> import jax, flax_shardmeta as fsm
    >>> from flax_shardmeta.examples import train
    >>> found = fsm.suggest(train.builder('mlp', batch=64), batch=64, chip='v5p',
    ...                     presets=['fsdp', 'tp'], remat=['none'],
    ...                     max_candidates=2, progress=False, cache=False)
    >>> len(found), found[0].fits, found[0].preset.name in ('fsdp', 'tp')
    (2, True, True)
  """
  start = time.perf_counter()
  if not isinstance(batch, int) or batch < 1:
    raise FitError(f'batch={batch!r}: give the global batch size, at least 1.')
  if not isinstance(max_candidates, int) or max_candidates < 1:
    raise FitError(f'max_candidates={max_candidates!r}: give at least 1.')
  say = _progress(progress)
  chosen = presets_lib.resolve(presets)
  policies = tuple(remat)
  if topology is not None:
    pool = list(topology_devices(topology, num_slices=num_slices))
  else:
    pool = list(devices if devices is not None else jax.devices())
  per_host = len(pool) // max(len({getattr(d, 'process_index', 0) for d in pool}), 1)
  chip_spec = chip_named(chip) if chip else chip_of(pool)
  capacity = parse_bytes(hbm) if hbm is not None else None
  if capacity is None and chip_spec is not None:
    capacity = chip_spec.hbm_bytes
  candidates = [
    Candidate(
      p, dict(zip(p.axes, sizes)), r, _topology=topology, _num_slices=num_slices
    )
    for p in chosen
    for sizes in _factorizations(p.axes, len(pool), per_host, num_slices)
    for r in policies
  ]
  for c in candidates:
    c._tokens = batch * tokens_per_example
  say(f'{len(candidates)} candidates over {len(pool)} devices; checking plans')
  viable = []
  for c in candidates:
    _check(c, build, pool, batch, capacity, chip, num_slices)
    if c.rejected is None:
      viable.append(c)
  rejected = [c for c in candidates if c.rejected is not None]
  chosen_to_compile = _pick(viable, max_candidates, capacity)
  skipped = [c for c in viable if c not in chosen_to_compile]
  for i, c in enumerate(chosen_to_compile, 1):
    t = time.perf_counter()
    mesh = _mesh(c, pool, num_slices)
    step, *args = build(mesh, c.preset.rules, c.remat)
    c.report = fit(step, *args, hbm=capacity, chip=chip, cache=cache)
    verdict = 'fits' if c.report.fits else 'does not fit'
    say(
      f'[{i}/{len(chosen_to_compile)}] {c.label}: '
      f'{format_bytes(c.report.total_bytes)} per chip, {verdict} '
      f'({time.perf_counter() - t:.0f} s{", cached" if c.report.cached else ""})'
    )
  ranked = sorted(chosen_to_compile, key=_rank_key)
  _reasons(ranked)
  return Suggestions(ranked, rejected, skipped, capacity, time.perf_counter() - start)


def _progress(progress: bool | Callable[[str], None]) -> Callable[[str], None]:
  if callable(progress):
    return progress
  if progress:
    return lambda line: print(line, file=sys.stderr, flush=True)
  return lambda line: None


def _mesh(c: Candidate, pool: Sequence[Any], num_slices: int) -> Any:
  sizes, names = tuple(c.shape.values()), tuple(c.shape)
  auto = (jax.sharding.AxisType.Auto,) * len(names)
  dcn = None
  if num_slices > 1:
    dcn = (num_slices,) + (1,) * (len(names) - 1)
  return make_mesh(sizes, names, devices=pool, axis_types=auto, dcn_axis_sizes=dcn)


def _check(
  c: Candidate,
  build: Build,
  pool: Sequence[Any],
  batch: int,
  capacity: int | None,
  chip: str | None,
  num_slices: int,
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
    mesh = _mesh(c, pool, num_slices)
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
  for category, size in zip(arguments.categories, arguments.plan_bytes):
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
    return f'{_summary(c)}; {comm}'
  other = 'the next' if first else 'the one above'
  parts = []
  if c.step_s and ref.step_s:
    parts.append(f"step {c.step_s / ref.step_s:.2f}x {other}'s")
  temp = r.row('temporaries') - ref.report.row('temporaries')
  sign = '+' if temp >= 0 else '-'
  parts.append(f'activations {sign}{format_bytes(abs(temp))} vs {other}')
  parts.append(comm)
  return '; '.join(parts)
