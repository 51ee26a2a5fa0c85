"""``FitReport``: what one training step costs each chip, and the verdict."""

from __future__ import annotations

import dataclasses
from typing import Any

from flax_shardmeta._planning import fit_format
from flax_shardmeta._planning.chips import Chip
from flax_shardmeta._planning.roofline import CollectiveRow, Roofline

PARAMETERS = 'parameters'
OPTIMIZER = 'optimizer state'
INPUTS = 'batch and other inputs'
PADDING = 'argument padding'
OUTPUTS = 'outputs not donated'
TEMPORARIES = 'temporaries'
CODE = 'generated code'
GRADIENTS = 'gradients'
ACTIVATIONS = 'activations and workspace'

ARGUMENT_ROWS = (PARAMETERS, OPTIMIZER, INPUTS, PADDING)
"""The rows that together are XLA's ``argument_size_in_bytes``."""


@dataclasses.dataclass(frozen=True)
class Row:
  """One line of the per-chip breakdown.

  Attributes:
    name: what the bytes are (``'parameters'``, ``'temporaries'``, ...).
    bytes: bytes per chip.
    note: where the figure comes from.
  """

  name: str
  bytes: int
  note: str = ''

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form."""
    return {'name': self.name, 'bytes': int(self.bytes), 'note': self.note}


@dataclasses.dataclass(frozen=True)
class Refusal:
  """The compiler refused the program for lack of memory.

  Attributes:
    required_bytes: what it said the program needs per chip.
    available_bytes: what it said the chip has.
    message: its message, first line.
  """

  required_bytes: int
  available_bytes: int
  message: str


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

  @property
  def fits(self) -> bool | None:
    """Whether the step fits in ``hbm_bytes`` (None when that is unknown)."""
    if self.refusal is not None:
      return False
    if self.hbm_bytes is None:
      return None
    return self.total_bytes <= self.hbm_bytes

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
    return self.headroom_bytes / self.hbm_bytes

  @property
  def collective_bytes(self) -> float:
    """Bytes per device per step over all collectives."""
    return sum(r.bytes for r in self.collectives)

  def row(self, name: str) -> int:
    """Bytes of the row called ``name`` (0 when there is none)."""
    return sum(r.bytes for r in self.rows if r.name == name)

  @property
  def argument_bytes(self) -> int:
    """The argument rows together (XLA's ``argument_size_in_bytes``)."""
    return sum(r.bytes for r in self.rows if r.name in ARGUMENT_ROWS)

  @property
  def largest_row(self) -> Row:
    """The biggest category."""
    return max(self.rows, key=lambda r: r.bytes)

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
    }

  def __str__(self) -> str:
    return fit_format.format_report(self)

  def _treescope_view(self) -> dict[str, Any]:
    return fit_format.treescope_view(self)

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
