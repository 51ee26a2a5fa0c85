"""``fsm.suggest`` and what it returns, ``Suggestions``: the best mesh, rules,
remat and offload for a model on a pod.

Candidates are every way of splitting the chips over a preset's mesh axes,
times the rule presets, times the remat policies, times the offload presets
(none unless asked for).
 A preset none of whose
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
inflated, and remat lowers them. At an equal step time a layout without
offload ranks first, so an offload never ranks above a layout that fits
without one at an equal or better step time (its host transfers count in its
step time where the host link's bandwidth is known; each offload's reason
says what it moves and what that costs). Last, a layout never ranks above
the same mesh, preset and offload with less remat when both fit.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from flax_shardmeta._capacity.fit.fit import fit
from flax_shardmeta._capacity.fit.usable import FRACTION_VARIABLES, UsableMemory
from flax_shardmeta._capacity.report import FitReport
from flax_shardmeta._capacity.suggest import presets as presets_lib, ranking
from flax_shardmeta._capacity.suggest.candidate import Candidate, signed
from flax_shardmeta._capacity.suggest.offload_presets import (
  OffloadPreset,
  resolve_offload,
)
from flax_shardmeta._capacity.suggest.presets import RulePreset
from flax_shardmeta._capacity.suggest.search import (
  Build,
  Memory,
  Where,
  built,
  candidate_mesh,
  candidates_of,
  check,
  check_knob_build,
  check_offload_build,
  device_pool,
  first_built,
  judged_capacity,
  knob_grid,
  pick,
)
from flax_shardmeta._devices.chips import chip_named, chip_of
from flax_shardmeta._devices.gpu import described_memory
from flax_shardmeta._errors import (
  FitError,
)
from flax_shardmeta._units import format_bytes, format_seconds


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
  offload: Iterable[str | OffloadPreset] = ('none',),
  max_candidates: int = 8,
  progress: bool | Callable[[str], None] = True,
  cache: bool = True,
  mem_fraction: float | None = None,
  reserve: int | str | None = None,
  host_memory: int | str | None = None,
  knobs: Mapping[str, Sequence[Any]] | None = None,
) -> Suggestions:
  """Searches meshes, rule presets, remat policies and offloads for the best
  layout.

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
      ``'t5x-2d'``, ``'ep'``, ``'ep+tp'``, ``'ep+fsdp'``) or
      :class:`RulePreset` objects. A mixture-of-experts model ranks over
      ``['fsdp', 'ep', 'ep+fsdp']``: no expert parallelism (MaxText's
      default), the experts over their own axis, and that axis shared with
      FSDP, each at every expert degree the chips split into.
    remat: remat policies to try, least remat first: a layout never ranks
      above the same mesh and preset with a policy listed before its own
      when both fit.
    offload: offload presets to try (``'none'``, ``'optimizer'``,
      ``'activations'``, ``'optimizer+activations'``, or
      :class:`OffloadPreset` objects); a candidate that offloads is built
      with ``build(mesh, rules, remat, offload)``, and judged by its device
      memory, its host memory against ``host_memory``, and its step time
      with the transfers.
    knobs: the model's own settings to try, as a grid:
      ``{'capacity_factor': [1.0, 1.25, 2.0]}`` builds every layout once per
      value, passed to the build as a keyword argument
      (``build(mesh, rules, remat, capacity_factor=1.25)``); several knobs
      multiply. A build with a ``knob_notes(**knobs) -> str`` attribute says
      what a setting costs beside memory and time (the built-in MoE: the share
      of tokens a capacity factor drops at uniform routing), in the
      candidate's reason.
    max_candidates: at most this many are compiled (the most promising by
      the estimate, spread over the presets and remat policies).
    progress: print progress to stderr (or call this with each line).
    cache: reuse compiled figures (see :func:`fit`).
    mem_fraction: GPUs: the allocator fraction the run will use (default:
      ``XLA_CLIENT_MEM_FRACTION`` from the environment, else jax's 0.75).
    reserve: GPUs: bytes (or text like ``'3GiB'``) the run holds outside
      XLA's pool per GPU (default: the CUDA context and each layout's NCCL
      communicators, see :func:`fit`).
    host_memory: the RAM of one host that offload candidates are judged
      against (default: the machine type's of the chip, see :func:`fit`).

  Returns:
    :class:`Suggestions`, best first; ``suggestions[0].compare()`` says why.

  Raises:
    FitError: malformed arguments (batch, hbm, max_candidates, mem_fraction,
      reserve, offload), or offload asked of a build that cannot take it.

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
  pool = device_pool(topology, num_slices, devices, target_config)
  spec = chip_named(chip) if chip else chip_of(pool)
  capacity = judged_capacity(hbm, spec)
  if capacity is None:  # a custom GPU: its own description's memory
    capacity = described_memory(pool)
  where = Where(pool, topology, num_slices)
  memory = Memory.of(capacity, where.on_gpu, mem_fraction, reserve)
  policies = tuple(remat)
  resolved = presets_lib.resolve(presets)
  offloads = resolve_offload(offload)
  check_offload_build(build, offloads)
  grid = knob_grid(knobs)
  check_knob_build(build, grid)
  tokens = batch * tokens_per_example
  candidates = candidates_of(resolved, policies, where, tokens, offloads, grid)
  notes = getattr(build, 'knob_notes', None)
  if callable(notes) and grid != [()]:
    for c in candidates:
      c.knob_notes = str(notes(**dict(c.knobs)) or '')
  first = first_built(build, candidates)
  unused: dict[str, str] = {}
  if first is not None:
    unused = presets_lib.unused_presets(resolved, presets_lib.model_names(first[1][1:]))
    candidates = [c for c in candidates if c.preset.name not in unused]
  say(f'{len(candidates)} candidates over {len(pool)} devices; checking plans')
  runs = {'mem_fraction': mem_fraction, 'reserve': reserve}
  if host_memory is not None:
    runs['host_memory'] = host_memory
  estimate_chip = chip or (spec.name if spec is not None else None)
  for c in candidates:
    made = first[1] if first is not None and c is first[0] else None
    check(c, build, where, batch, memory, estimate_chip, runs, made)
  viable = [c for c in candidates if c.rejected is None]
  rejected = [c for c in candidates if c.rejected is not None]
  chosen = pick(viable, max_candidates, memory)
  skipped = [c for c in viable if c not in chosen]
  for i, c in enumerate(chosen, 1):
    t = time.perf_counter()
    step, *args = built(build, candidate_mesh(c, where), c)
    c.report = r = fit(step, *args, hbm=capacity, chip=chip, cache=cache, **runs)
    say(f'[{i}/{len(chosen)}] {c.label}: {_compiled(r, time.perf_counter() - t)}')
  ranked = ranking.rank(chosen, policies)
  ranking.reasons(ranked, policies)
  for c in ranked:
    if c.knob_notes:
      c.reason = f'{c.reason}; {c.knob_notes}' if c.reason else c.knob_notes
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


def _compiled(r: FitReport, seconds: float) -> str:
  """How a compiled candidate came out, for the progress line."""
  cached = ', cached' if r.cached else ''
  return (
    f'{format_bytes(r.total_bytes)} per chip, {r.verdict_words} '
    f'({seconds:.0f} s{cached})'
  )


def _progress(progress: bool | Callable[[str], None]) -> Callable[[str], None]:
  if callable(progress):
    return progress
  if progress:
    return lambda line: print(line, file=sys.stderr, flush=True)
  return lambda line: None


def _fits_cell(r: FitReport) -> str:
  kind = r.verdict_kind
  if kind == 'fits_with_fraction':
    return f'only at {r.needed_fraction:.2f}'
  return {'fits': 'yes', 'does_not_fit': 'no'}.get(kind, '?')


def _host_cell(r: FitReport) -> str:
  host = r.host
  if host is None:
    return '-'
  held = format_bytes(host.per_host_bytes)
  return held if host.fits is not False else f'{held} (over)'


def ranking_text(gpu: bool) -> str:
  """How the table is ranked, in a sentence (``gpu``: compile-only GPU programs).

  Example:
    >>> 'without its HBM term' in ranking_text(True), ranking_text(False)[:30]
    (True, 'ranked: those that fit first, ')
  """
  if not gpu:
    return (
      'ranked: those that fit first, then by the roofline step time (to three '
      'significant digits), then by headroom'
    )
  name = FRACTION_VARIABLES[0]
  return (
    "ranked: those that fit at the run's fraction first, then those that fit "
    f'only with a raised {name} (smallest first), then the rest; within each '
    'by compute and collective time, the roofline without its HBM term (GPU '
    'programs compiled here are not autotuned, so their HBM bytes are '
    'inflated: shown, not ranked), then by headroom; more remat never ranks '
    'above the same layout with less when both fit'
  )


class Suggestions(list):
  """What :func:`suggest` returns: compiled candidates, best first.

  A list of :class:`Candidate` (those that fit first, then, on GPUs, those
  that fit only with a raised ``XLA_CLIENT_MEM_FRACTION``, then the rest;
  within each by estimated step time, then by headroom); ``rejected`` holds
  those rejected without compiling and why, ``skipped`` those beyond
  ``max_candidates``. ``print`` shows the ranked table; ``to_dict()`` is JSON.

  Attributes:
    rejected: candidates rejected by the exact cheap checks, with the reason.
    skipped: viable candidates not compiled (beyond ``max_candidates``).
    hbm_bytes: the memory per chip judged against: on GPUs the usable memory
      at the run's fraction (with the CUDA context's reserve; each layout's
      NCCL communicators take more, in its report).
    seconds: how long the search took.
    usable: GPUs: that usable memory's rows (GPU memory, fraction, reserve).
    skipped_presets: presets skipped because the model uses none of their
      logical names, by name, with why.

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
    usable: UsableMemory | None = None,
    skipped_presets: dict[str, str] | None = None,
  ):
    super().__init__(ranked)
    self.rejected = list(rejected)
    self.skipped = list(skipped)
    self.hbm_bytes = hbm_bytes
    self.seconds = seconds
    self.usable = usable
    self.skipped_presets = dict(skipped_presets or {})

  @property
  def fitting(self) -> list[Candidate]:
    """The compiled candidates that fit (on GPUs: at the run's fraction),
    best first."""
    return [c for c in self if c.fits]

  @property
  def fitting_with_fraction(self) -> list[Candidate]:
    """GPUs: those that fit only with a raised ``XLA_CLIENT_MEM_FRACTION``
    (``c.report.needed_fraction``), best first."""
    return [c for c in self if c.verdict == 'fits_with_fraction']

  @property
  def closest(self) -> Candidate | None:
    """When nothing fits: the compiled candidate needing the least memory."""
    compiled = [c for c in self if c.report is not None]
    return min(compiled, key=lambda c: c.total_bytes or 0) if compiled else None

  @property
  def ranked_by(self) -> str:
    """How the list is ranked, in a sentence."""
    return ranking_text(self.usable is not None)

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form (see the CLI's ``suggest --format json``)."""
    return {
      'hbm_bytes': self.hbm_bytes,
      'usable_memory': self.usable.to_dict() if self.usable else None,
      'seconds': self.seconds,
      'ranked_by': self.ranked_by,
      'ranked': [c.to_dict() for c in self],
      'rejected': [c.to_dict() for c in self.rejected],
      'skipped': [c.to_dict() for c in self.skipped],
      'skipped_presets': dict(self.skipped_presets),
    }

  def format(self, top: int | None = None) -> str:
    """The ranked table (the first ``top`` rows), then the rejected ones."""
    gpu = self.usable is not None
    hosted = any(c.offload.offloads for c in self)
    knobbed = any(c.knobs for c in self)
    head = ['#', 'mesh', 'preset', 'remat', *(['offload'] if hosted else [])]
    head += ['knobs'] if knobbed else []
    head += ['per chip', 'largest', 'headroom']
    shown = [(c, c.report) for c in (self[:top] if top else self) if c.report]
    # A mixture-of-experts model's tokens moved to their experts and back.
    routed = any(c.routing_bytes for c, _ in shown)
    head += [*(['host (per host)'] if hosted else []), 'fits', 'collectives']
    head += [*(['routing'] if routed else []), 'step (est.)']
    head += ['HBM traffic'] if gpu else []
    rows: list[tuple[str, ...]] = [(*head, 'tokens/s/chip')]
    for i, (c, r) in enumerate(shown, 1):
      big = r.largest_row
      tps = c.tokens_per_second_per_chip
      traffic = '-' if r.bytes_accessed is None else format_bytes(int(r.bytes_accessed))
      rows.append(
        (
          str(i),
          ' '.join(f'{k}={v}' for k, v in c.shape.items()),
          c.preset.name,
          c.remat,
          *([c.offload.name] if hosted else []),
          *([' '.join(f'{k}={v}' for k, v in c.knobs)] if knobbed else []),
          format_bytes(r.total_bytes),
          f'{big.name} {format_bytes(big.bytes)}',
          '-' if r.headroom_bytes is None else signed(r.headroom_bytes),
          *([_host_cell(r)] if hosted else []),
          _fits_cell(r),
          format_bytes(int(r.collective_bytes)),
          *([format_bytes(c.routing_bytes or 0)] if routed else []),
          '-' if not c.rank_s else format_seconds(c.rank_s),
          *([traffic] if gpu else []),
          '-' if tps is None else f'{tps:,.0f}',
        )
      )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
      '  '.join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows
    ]
    out = [f'{len(self.fitting)} of {len(self)} compiled layouts fit; best first:']
    out += self._judged_lines()
    out += [lines[0], '-' * len(lines[0])]
    for line, (c, _) in zip(lines[1:], shown):
      out.append(line)
      out.append(f'    {c.reason}')
    out += self._nothing_fits_lines()
    if self.skipped_presets:
      out.append('')
      out.append(f'presets skipped ({len(self.skipped_presets)}):')
      out += [f'  {name}: {why}' for name, why in self.skipped_presets.items()]
    if self.rejected:
      out.append('')
      out.append(f'rejected without compiling ({len(self.rejected)}):')
      out += [f'  {c.label}: {c.rejected}' for c in self.rejected]
    if self.skipped:
      out.append(f'not compiled (beyond max_candidates): {len(self.skipped)}')
    return '\n'.join(out)

  def _judged_lines(self) -> list[str]:
    """GPUs: what the verdicts are against and how the table is ranked."""
    u = self.usable
    if u is None:
      return []
    name = FRACTION_VARIABLES[0]
    lines = [
      f'judged against usable GPU memory at {name}={u.fraction:.2f} '
      f'({u.fraction_from}): {format_bytes(u.usable_bytes)} of '
      f'{format_bytes(u.device_bytes)} (at most: each layout judged with its own '
      'NCCL reserve beside the pool)',
    ]
    more = self.fitting_with_fraction
    if more:
      lines.append(
        f'{len(more)} more fit only with a raised {name} ("only at" under fits)'
      )
    lines.append(ranking_text(True))
    return lines

  def _nothing_fits_lines(self) -> list[str]:
    if self.fitting or self.closest is None:
      return []
    raised = self.fitting_with_fraction
    best = raised[0].report if raised else None
    if best is not None:
      return [
        f"nothing fits at the run's fraction; best with a raised one: "
        f'{raised[0].label}, {best.verdict_words}'
      ]
    c = self.closest
    r = c.report
    if r is not None and r.fits_device and r.host is not None and r.host.fits is False:
      return [f'nothing fits; closest: {c.label}, {r.host.verdict()}']
    limit = r.hbm_bytes if r is not None and r.hbm_bytes is not None else None
    limit = self.hbm_bytes if limit is None else limit
    what = ' usable' if r is not None and r.usable is not None else ''
    short = (c.total_bytes or 0) - (limit or 0)
    return [
      f'nothing fits; closest: {c.label}, {format_bytes(short)} over '
      f'{format_bytes(limit or 0)}{what}'
    ]

  def __str__(self) -> str:
    return self.format()
