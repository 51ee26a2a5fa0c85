"""``FitReport``: what one training step costs each chip, the verdict, and how
the report reads (its table and its treescope view)."""

from __future__ import annotations

import dataclasses
from typing import Any

from flax_shardmeta._capacity.estimate.unplaced import UnplacedValue
from flax_shardmeta._capacity.fit.host_side import HostMemory
from flax_shardmeta._capacity.fit.usable import (
  FRACTION_VARIABLES,
  UsableMemory,
)
from flax_shardmeta._capacity.hlo.roofline import CollectiveRow, Roofline
from flax_shardmeta._capacity.peak.rows import PeakMemory
from flax_shardmeta._capacity.report_text import format_report, treescope_view
from flax_shardmeta._capacity.vocabulary import (  # `X as X`: read from here too
  ACTIVATIONS as ACTIVATIONS,
  ARGUMENT_ROWS as ARGUMENT_ROWS,
  CODE as CODE,
  GRADIENTS as GRADIENTS,
  INPUTS as INPUTS,
  OPTIMIZER as OPTIMIZER,
  OUTPUTS as OUTPUTS,
  PADDING as PADDING,
  PARAMETERS as PARAMETERS,
  RNG as RNG,
  TEMPORARIES as TEMPORARIES,
  Category as Category,
  CompilerPlan as CompilerPlan,
  Refusal as Refusal,
  Row as Row,
)
from flax_shardmeta._capacity.why.readable import format_unknown_why, format_why
from flax_shardmeta._devices.chips import Chip
from flax_shardmeta._errors import FitError


@dataclasses.dataclass(frozen=True)
class FitReport:
  """What one step of a program costs each chip: memory, collectives, time.

  Made by :func:`flax_shardmeta.fit`. ``print(report)`` shows a table,
  ``report.to_dict()`` is JSON, and in a notebook the report renders with
  treescope.

  Memory per chip (``total_bytes``) is the peak the chip must hold::

    argument + output - alias + temporaries + generated code

  with XLA's own figures (``memory_analysis``): arguments (parameters,
  optimizer state, batch) stay live for the whole step, donated arguments
  share their buffers with the outputs (``alias``), and the temporaries are
  the activations kept for the backward pass, the gradients and the
  workspace at the program's peak.

  Attributes:
    source: ``'compiled'`` (XLA's figures) or ``'estimate'`` (no compiler
      for the target: from the plan and the traced program).
    method: how the figures were made, in a sentence.
    mesh: axis name -> size.
    devices: the devices compiled for, e.g. ``'TPU v5, 128 devices in 32
      hosts'``.
    chip: the chip figures used for the verdict and the roofline, if known.
    rows: the per-chip breakdown; the rows add up to ``total_bytes``, and
      the argument rows to XLA's argument bytes.
    total_bytes: the peak per chip (see above).
    hbm_bytes: the memory judged against (``hbm=`` or the chip's), if known.
    memory_analysis: XLA's figures, unaltered (None for estimates and
      refusals).
    donated_bytes: argument bytes reused for outputs (XLA's alias bytes).
    collectives: per step and device, grouped by kind and mesh axes.
    flops: flops per step and device, loop trips included.
    bytes_accessed: HBM bytes per step and device, loop trips included.
    cost_analysis: XLA's ``cost_analysis()``, unaltered (it counts each loop
      body once).
    roofline: a step-time estimate, if the chip is known.
    refusal: set when the compiler refused the program for lack of memory.
    loops: ``(loop, trip count)`` of the program's loops.
    compile_seconds: how long compiling took (0 for cached figures).
    cached: the figures came from the cache.
    notes: anything else worth knowing, one sentence each.
    replicated: dimensions the step's constraints replicated because their
      mesh axes do not divide them (``replicate_indivisible``), one line each.
    unplaced: estimates only: the values inside the step nothing lays out,
      counted replicated, largest first, each with the line that makes it
      (``unplaced_bytes`` of the total rests on them); empty when compiled.
    usable: GPUs: the memory a real jax run gives XLA (device memory,
      allocator fraction, pool, reserve, usable); ``hbm_bytes`` is then its
      usable bytes.
    needed_fraction: GPUs, when the step does not fit at the run's fraction
      but its program compiled for a larger one (at most 0.95) fits there:
      that fraction (``XLA_CLIENT_MEM_FRACTION``).
    error_band: estimates only: the estimate's measured error on this
      platform, ``(below, above)``: the most it came out under and over the
      compiled total; a limit inside that band gets no verdict (``fits`` is
      None: too close to call without compiling).
    plan: what the compiler planned against and whether it rematerialized.
    unmeasured: estimates only: what in the step none of the models its
      error was measured on has (BENCHMARKS.md), e.g. ``'shard_map (per-device
      code)'``; where any, the verdict says the band does not cover it.
    peak_memory: what holds the peak, row by row (:meth:`peak`).
    host: what the step keeps in host memory (arguments on ``pinned_host``,
      values a remat policy offloads), per chip and per host, against the
      host's RAM; None when it keeps nothing there.

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> mesh = jax.make_mesh((8,), ('data',))
    >>> step = fsm.jit(lambda x: (x * 2).sum(), mesh=mesh,
    ...                in_shardings=(jax.P('data'),))
    >>> report = fsm.fit(step, jax.ShapeDtypeStruct((1024,), jnp.float32),
    ...                  hbm='1MiB', cache=False)
    >>> report.source, report.fits, report.row('batch and other inputs')
    ('compiled', True, 512)
  """

  source: str
  method: str
  mesh: dict[str, int]
  devices: str
  chip: Chip | None
  rows: tuple[Row, ...]
  total_bytes: int
  hbm_bytes: int | None
  memory_analysis: dict[str, int] | None
  donated_bytes: int
  collectives: tuple[CollectiveRow, ...]
  flops: float | None
  bytes_accessed: float | None
  cost_analysis: dict[str, float] | None
  roofline: Roofline | None
  refusal: Refusal | None = None
  loops: tuple[tuple[str, int | None], ...] = ()
  compile_seconds: float = 0.0
  cached: bool = False
  notes: tuple[str, ...] = ()
  unplaced: tuple[UnplacedValue, ...] = ()
  replicated: tuple[str, ...] = ()
  usable: UsableMemory | None = None
  needed_fraction: float | None = None
  error_band: tuple[float, float] | None = None
  plan: CompilerPlan | None = None
  unmeasured: tuple[str, ...] = ()
  peak_memory: PeakMemory | None = dataclasses.field(default=None, repr=False)
  host: HostMemory | None = None

  def peak(self) -> PeakMemory:
    """What holds the peak: :attr:`total_bytes` split by parameter, optimizer
    slot, input, output, activation line, gradient, collective buffer and
    workspace (the rows add up to the total), where in the step it falls,
    and the operation at it. ``.diff(other.peak())`` compares two steps.

    Raises:
      FitError: the report has no rows to split (a refused compile).
    """
    if self.peak_memory is None:
      raise FitError(
        'this report has no peak to split (the compiler refused the step): '
        'fit a smaller step, or a larger mesh, to see what holds its memory'
      )
    return self.peak_memory

  @property
  def fits(self) -> bool | None:
    """Whether the step fits in ``hbm_bytes`` (on GPUs: the usable memory at
    the run's fraction). None when that is unknown, or when an estimate is
    within its error of it (too close to call without compiling)."""
    if self.refusal is not None:
      return False
    if self.host is not None and self.host.fits is False:
      return False  # the hosts lack room, whatever the chips have
    if self.hbm_bytes is None or self.too_close_to_call:
      return None
    return self.total_bytes <= self.hbm_bytes

  @property
  def host_bytes(self) -> int:
    """Bytes each chip keeps in host memory (0 when none; see ``host``)."""
    return self.host.per_chip_bytes if self.host is not None else 0

  @property
  def fits_device(self) -> bool | None:
    """The chips' side of the verdict alone (``fits`` also needs the hosts')."""
    if self.refusal is not None:
      return False
    if self.hbm_bytes is None or self.too_close_to_call:
      return None
    return self.total_bytes <= self.hbm_bytes

  @property
  def too_close_to_call(self) -> bool:
    """An estimate whose total is within its measured error of the limit:
    the compiled step could land on either side."""
    if self.error_band is None or self.hbm_bytes is None or self.refusal:
      return False
    below, above = self.error_band
    # estimate = compiled x (1 + error), error in [-below, +above]
    low = self.total_bytes / (1 + above)
    high = self.total_bytes / max(1 - below, 1e-9)
    return low <= self.hbm_bytes <= high

  @property
  def verdict_kind(self) -> str:
    """``'fits'``, ``'fits_with_fraction'`` (GPUs: only with a raised
    ``XLA_CLIENT_MEM_FRACTION``), ``'does_not_fit'``, ``'too_close'`` or
    ``'unknown'``."""
    if self.too_close_to_call:
      return 'too_close'
    fits = self.fits
    if fits is None:
      return 'unknown'
    if fits:
      return 'fits'
    return 'fits_with_fraction' if self.needed_fraction else 'does_not_fit'

  @property
  def verdict_words(self) -> str:
    """The verdict in a few words, with the fraction it holds at on GPUs:
    ``'fits at XLA_CLIENT_MEM_FRACTION=0.75'``, ``'fits only with
    XLA_CLIENT_MEM_FRACTION=0.88'``, ``'does not fit'``, ...

    Example:
      >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
      >>> step = jax.jit(lambda x: x * 2)
      >>> x = jax.ShapeDtypeStruct((256,), jnp.float32)
      >>> with jax.set_mesh(jax.make_mesh((8,), ('data',))):
      ...   report = fsm.fit(step, x, hbm='1KiB', cache=False)
      >>> report.verdict_words
      'does not fit'
    """
    name = FRACTION_VARIABLES[0]
    at = f' at {name}={self.usable.fraction:.2f}' if self.usable is not None else ''
    kind = self.verdict_kind
    if kind == 'fits_with_fraction':
      return f'fits only with {name}={self.needed_fraction:.2f}'
    words = {
      'fits': f'fits{at}',
      'too_close': 'too close to call',
      'unknown': 'no verdict (memory unknown)',
    }
    return words.get(kind, f'does not fit{at}')

  @property
  def headroom_bytes(self) -> int | None:
    """``hbm_bytes - total_bytes`` (negative when it does not fit)."""
    if self.hbm_bytes is None:
      return None
    return self.hbm_bytes - self.total_bytes

  @property
  def headroom(self) -> float | None:
    """Headroom as a fraction of ``hbm_bytes``."""
    if self.hbm_bytes is None or self.headroom_bytes is None:
      return None
    # A GPU whose reserve leaves XLA nothing has no memory to be a share of.
    return self.headroom_bytes / max(self.hbm_bytes, 1)

  @property
  def collective_bytes(self) -> float:
    """Bytes per device per step over all collectives."""
    return sum(r.bytes for r in self.collectives)

  def row(self, name: str) -> int:
    """Bytes of the row ``name``: a ``Category`` or its text, e.g.
    ``'parameters'`` (0 when there is none)."""
    try:
      key = Category(name)
    except ValueError:
      known = ', '.join(repr(c.value) for c in Category)
      raise FitError(f'no report row is called {name!r}; the rows: {known}') from None
    return sum(r.bytes for r in self.rows if r.name == key)

  def why(self, top: int = 8) -> str:
    """Why each collective is there, grouped by reason, largest bytes first,
    ending with what looks unexpected (see ``FitReport.collectives``' rows:
    reason, parameters, sources). An estimate compiled nothing: it says
    its collectives are unknown, and how to get them."""
    if self.source == 'estimate':
      return format_unknown_why(self.replicated)
    return format_why(self.collectives, self.replicated, top, self.host)

  @property
  def argument_bytes(self) -> int:
    """The argument rows together (XLA's ``argument_size_in_bytes``)."""
    return sum(r.bytes for r in self.rows if r.name in ARGUMENT_ROWS)

  @property
  def largest_row(self) -> Row:
    """The biggest category."""
    return max(self.rows, key=lambda r: r.bytes)

  @property
  def unplaced_bytes(self) -> int:
    """Bytes of the total that rest on values nothing lays out (estimates)."""
    return min(sum(v.peak_bytes for v in self.unplaced), self.total_bytes)

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form (see the CLI's ``fit --format json``)."""
    return {
      'source': self.source,
      'method': self.method,
      'mesh': dict(self.mesh),
      'devices': self.devices,
      'chip': self.chip.to_dict() if self.chip else None,
      'rows': [r.to_dict() for r in self.rows],
      'total_bytes': int(self.total_bytes),
      'hbm_bytes': self.hbm_bytes,
      'fits': self.fits,
      'headroom_bytes': self.headroom_bytes,
      'memory_analysis': self.memory_analysis,
      'donated_bytes': int(self.donated_bytes),
      'collectives': [r.to_dict() for r in self.collectives],
      'flops': self.flops,
      'bytes_accessed': self.bytes_accessed,
      'cost_analysis': self.cost_analysis,
      'roofline': self.roofline.to_dict() if self.roofline else None,
      'refusal': dataclasses.asdict(self.refusal) if self.refusal else None,
      'loops': [list(loop) for loop in self.loops],
      'compile_seconds': self.compile_seconds,
      'cached': self.cached,
      'notes': list(self.notes),
      'unplaced': [v.to_dict() for v in self.unplaced],
      'verdict': self.verdict_kind,
      'usable_memory': self.usable.to_dict() if self.usable else None,
      'needed_fraction': self.needed_fraction,
      'error_band': list(self.error_band) if self.error_band else None,
      'unmeasured': list(self.unmeasured),
      'compiler_plan': self.plan.to_dict() if self.plan else None,
      'peak': self.peak_memory.to_dict() if self.peak_memory else None,
      'host': self.host.to_dict() if self.host else None,
      'host_bytes': self.host_bytes,
    }

  def __str__(self) -> str:
    return format_report(self)

  def _treescope_view(self) -> dict[str, Any]:
    return treescope_view(self)

  def __treescope_repr__(self, path: str, subtree_renderer: Any) -> Any:
    import treescope  # only for notebooks: keeps the CLI start-up light

    return treescope.repr_lib.render_object_constructor(
      object_type=type(self),
      attributes=self._treescope_view(),
      path=path,
      subtree_renderer=subtree_renderer,
    )

  def _repr_html_(self) -> str:
    import treescope

    return treescope.render_to_html(self._treescope_view())
