"""The record of what holds a step's peak (:class:`PeakMemory`), its rows, its
text, its JSON and treescope forms, and two of them side by side
(:class:`PeakDiff`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from flax_shardmeta._capacity.peak.experts import (
  ROLE_SHRINKS,
  ROLE_TEXT,
  ROUTING_ROLES,
  MoeLayerPeak,
  moe_layers,
  moe_text,
)
from flax_shardmeta._units import format_bytes, table
from flax_shardmeta._views import ShownWithTreescope

# What a row's bytes are, in the order the text lists the groups.
ARGUMENT_KINDS = (
  'parameter',
  'optimizer state',
  'RNG state',
  'batch and other inputs',
  'argument padding',
)
TEMPORARY_KINDS = (
  'activation',
  'backward',
  'gradient',
  'optimizer update',
  'parameter copy',
  'input copy',
  'offload',
  'collective',
  'workspace',
  'temporary',
  'heap fragmentation',
  'compiler scratch',
)
KINDS = (*ARGUMENT_KINDS, 'output', *TEMPORARY_KINDS, 'generated code')
"""Every row kind. ``'activation'``: a value of the forward pass alive at
the peak (saved for the backward pass); ``'backward'``: a value the backward
pass computes that is no parameter's gradient (an activation's gradient);
``'gradient'``: a parameter's gradient; ``'optimizer update'``: a value of the
update that reaches a parameter's or its optimizer state's new value;
``'parameter copy'``: a parameter gathered, cast or copied; ``'input copy'``:
another argument (the batch, optimizer state) cast or moved; ``'offload'``:
a chip's buffer of a copy between host and chip memory (an argument laid out
in host memory coming in, by its path; an offloaded activation going out or
coming back, by its checkpoint name); ``'collective'``:
a collective's buffer; ``'workspace'``: a library kernel's scratch (cuBLAS,
cuDNN); ``'temporary'``: a temporary nothing names; ``'heap fragmentation'``:
XLA's heap not covered by the values alive at the peak (alignment, holes);
``'compiler scratch'``: temporary memory XLA reports beyond its buffer
assignment."""

PHASES = ('forward', 'backward', 'optimizer update')
"""Where in the step the peak can fall."""


@dataclasses.dataclass(frozen=True)
class PeakRow:
  """Bytes per chip of one thing alive at the peak.

  Attributes:
    kind: one of :data:`KINDS`.
    what: a parameter's or input's path (``params/layers/w1``), or what a
      temporary is (``dot_general``, ``all-reduce: gradient of params/w``).
    where: the user's line (``model.py:42``); ``''`` for arguments.
    bytes: bytes per chip.
    scope: the module scope from jax's name stack, where known.
    layers: values a scan stacks over its layers: how many (else 0).
    shape: the buffer's shape as XLA holds it on a chip, where known.
    checkpoint: an activation's name from ``checkpoint_name`` at its line
      (what a remat policy saves or offloads by name), where it has one.
    role: a mixture-of-experts value's routing role, one of
      :data:`ROUTING_ROLES` (``''`` for any other value).

  Example:
    >>> import flax_shardmeta as fsm
    >>> row = fsm.PeakRow('activation', 'dot_general', 'model.py:42', 2**20,
    ...                   'Model/mlp', layers=32)
    >>> row.named, row.key()
    (True, ('activation', 'dot_general', 'model.py:42', 'Model/mlp'))
  """

  kind: str
  what: str
  where: str
  bytes: int
  scope: str = ''
  layers: int = 0
  shape: str = ''
  checkpoint: str = ''
  role: str = ''

  @property
  def named(self) -> bool:
    """Whether the row says what or where it is."""
    return bool(self.what or self.where)

  def key(self) -> tuple[str, str, str, str]:
    """What a row is the same row as, across two configurations."""
    return (self.kind, self.what, self.where, self.scope)

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, data: dict[str, Any]) -> PeakRow:
    return cls(
      **{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
    )


@dataclasses.dataclass(frozen=True)
class PeakMemory(ShownWithTreescope):
  """What holds a step's memory per chip at its peak: ``fsm.fit``'s total
  split row by row (:meth:`FitReport.peak`).

  Attributes:
    rows: largest first; their bytes add up to ``total_bytes``.
    total_bytes: ``FitReport.total_bytes``.
    phase: where in the step the peak falls (one of :data:`PHASES`), ``''``
      where unknown.
    at: the operation XLA's schedule runs at the peak, its user's line and
      scope (``'fusion.12 at model.py:42 (Model/mlp)'``).
    method: how the rows were found.
    notes: what could not be named, and why.

  Example:
    >>> import flax_shardmeta as fsm
    >>> rows = (fsm.PeakRow('parameter', 'params/w', '', 3072),
    ...         fsm.PeakRow('activation', 'tanh', 'model.py:7', 1024))
    >>> peak = fsm.PeakMemory(rows, 4096, 'backward', 'fusion.3', 'XLA')
    >>> peak.by_kind(), peak.named_fraction
    ({'parameter': 3072, 'activation': 1024}, 1.0)
  """

  rows: tuple[PeakRow, ...]
  total_bytes: int
  phase: str = ''
  at: str = ''
  method: str = ''
  notes: tuple[str, ...] = ()

  def by_kind(self) -> dict[str, int]:
    """Bytes per kind, in :data:`KINDS` order (kinds with rows only)."""
    out: dict[str, int] = {}
    for kind in KINDS:
      total = sum(r.bytes for r in self.rows if r.kind == kind)
      if any(r.kind == kind for r in self.rows):
        out[kind] = total
    return out

  def by_role(self) -> dict[str, int]:
    """Bytes per routing role of a mixture-of-experts step (:data:`ROUTING_ROLES`
    order, roles with rows only): its dispatch and combine buffers, the
    experts' activations and the routing masks, every layer together."""
    out: dict[str, int] = {}
    for role in ROUTING_ROLES:
      rows = [r for r in self.rows if r.role == role]
      if rows:
        out[role] = sum(r.bytes for r in rows)
    return out

  def moe_layers(self) -> tuple[MoeLayerPeak, ...]:
    """The mixture-of-experts layers' routing bytes at the peak, per layer:
    one entry per scope and stacking (a scan's stacked values over its
    layers, the layer it runs or an unrolled layer on its own), largest
    first.

    Example:
      >>> import flax_shardmeta as fsm
      >>> rows = (fsm.PeakRow('activation', 'dot_general', 'moe.py:9', 4096,
      ...                     'Moe/layers', layers=4, role='dispatch'),
      ...         fsm.PeakRow('activation', 'mul', 'moe.py:10', 512,
      ...                     'Moe/layers', role='experts'))
      >>> [(m.layers, m.bytes) for m in fsm.PeakMemory(rows, 4608).moe_layers()]
      [(4, {'dispatch': 1024}), (1, {'experts': 512})]
    """
    return moe_layers(self.rows)

  def temporaries(self) -> tuple[PeakRow, ...]:
    """The rows of temporary memory (values, heap, scratch)."""
    return tuple(r for r in self.rows if r.kind in TEMPORARY_KINDS)

  @property
  def named_fraction(self) -> float:
    """Of the temporaries' bytes, the share in rows that say what or where
    they are (heap fragmentation and compiler scratch are named by kind)."""
    temps = self.temporaries()
    total = sum(r.bytes for r in temps)
    if total <= 0:
      return 1.0
    unnamed = sum(r.bytes for r in temps if r.kind == 'temporary' and not r.named)
    return 1.0 - unnamed / total

  def largest(self, n: int = 3) -> tuple[PeakRow, ...]:
    """The ``n`` largest rows."""
    return tuple(sorted(self.rows, key=lambda r: -r.bytes)[:n])

  def advice(self, n: int = 3) -> list[str]:
    """Lines naming the ``n`` largest rows a change can shrink, and what
    would shrink each (``report.peak().advice()``; a report that does not
    fit prints them under its verdict).

    Example:
      >>> import flax_shardmeta as fsm
      >>> big = fsm.PeakRow('activation', 'dot_general', 'model.py:42', 3 << 30)
      >>> advice = fsm.PeakMemory((big,), 3 << 30).advice()
      >>> advice[1].startswith('  3.00 GiB  activation dot_general at model.py:42')
      True
      >>> 'remat' in advice[1]
      True
    """
    rows = [r for r in self.largest(len(self.rows)) if r.kind in _SHRINKS][:n]
    if not rows:
      return []
    lines = ['largest at the peak (fsm.fit(...).peak() lists every row):']
    for r in rows:
      at = f' at {r.where}' if r.where else ''
      what = f'{r.kind} {_what(r)}{at}'
      shrink = ROLE_SHRINKS.get(r.role) or _SHRINKS[r.kind]
      lines.append(f'  {format_bytes(r.bytes)}  {what}: {shrink}')
    return lines

  def diff(self, other: PeakMemory) -> PeakDiff:
    """``self`` (before) against ``other`` (after), row by row: the rows'
    changes add up to the change in total.

    Example:
      >>> a = PeakMemory((PeakRow('activation', 'tanh', 'm.py:3', 800),), 800)
      >>> b = PeakMemory((PeakRow('activation', 'tanh', 'm.py:3', 200),), 200)
      >>> a.diff(b).change
      -600
    """
    return PeakDiff.of(self, other)

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form (``--peak --format json``; read back by
    :meth:`from_dict`, as ``--against`` does)."""
    return {
      'total_bytes': self.total_bytes,
      'phase': self.phase,
      'at': self.at,
      'method': self.method,
      'notes': list(self.notes),
      'by_kind': self.by_kind(),
      'by_role': self.by_role(),
      'moe_layers': [m.to_dict() for m in self.moe_layers()],
      'named_fraction': round(self.named_fraction, 4),
      'rows': [r.to_dict() for r in self.rows],
    }

  @classmethod
  def from_dict(cls, data: dict[str, Any]) -> PeakMemory:
    """The record of :meth:`to_dict`'s form (a ``FitReport``'s JSON holds it
    under ``'peak'``)."""
    if isinstance(data.get('peak'), dict):  # a whole report's JSON
      data = data['peak']
    return cls(
      tuple(PeakRow.from_dict(r) for r in data['rows']),
      int(data['total_bytes']),
      str(data.get('phase', '')),
      str(data.get('at', '')),
      str(data.get('method', '')),
      tuple(data.get('notes', ())),
    )

  def format(self, top: int = 8) -> str:
    """The rows grouped by kind, each group's total first, its largest
    ``top`` rows under it."""
    lines = [
      f'What holds the peak: {format_bytes(self.total_bytes)} per chip'
      + (f' ({self.method})' if self.method else '')
    ]
    if self.phase or self.at:
      lines.append(
        f'peak in the {_PHASE_TEXT.get(self.phase, "step")}'
        + (f', at {self.at}' if self.at else '')
      )
    cells: list[tuple[str, ...]] = []
    for kind, total in sorted(self.by_kind().items(), key=lambda kv: -kv[1]):
      rows = sorted((r for r in self.rows if r.kind == kind), key=lambda r: -r.bytes)
      cells.append((kind, format_bytes(total), f'{len(rows)} row(s)', ''))
      for r in rows[:top]:
        cells.append(('  ' + _what(r), format_bytes(r.bytes), r.where, r.scope))
      if len(rows) > top:
        rest = sum(r.bytes for r in rows[top:])
        cells.append((f'  ... {len(rows) - top} more', format_bytes(rest), '', ''))
    lines += table(cells, {1}) if cells else []
    lines += moe_text(self.moe_layers())
    lines += [f'note: {n}' for n in self.notes]
    return '\n'.join(lines)

  def __str__(self) -> str:
    return self.format()

  def _treescope_view(self) -> dict[str, Any]:
    view: dict[str, Any] = {'total': format_bytes(self.total_bytes)}
    if self.phase:
      view['phase'] = self.phase
    if self.at:
      view['at'] = self.at
    for kind, total in sorted(self.by_kind().items(), key=lambda kv: -kv[1]):
      rows = sorted((r for r in self.rows if r.kind == kind), key=lambda r: -r.bytes)
      view[f'{kind} ({format_bytes(total)})'] = {
        _what(r) + (f' @ {r.where}' if r.where else ''): format_bytes(r.bytes)
        for r in rows[:20]
      }
    return view


_SAVED = "remat (remat='full', or a policy saving less), or a smaller batch"
_SHARDED = (
  'shard it over more devices: a rules preset with fsdp (fsm.suggest ranks them)'
)
_SHRINKS = {
  'activation': _SAVED,
  'backward': 'a smaller batch, or remat of the layer that makes it',
  'parameter': _SHARDED,
  'parameter copy': 'a layout that gathers less at once (fsm.suggest), or remat',
  'optimizer state': f'{_SHARDED}; or an optimizer with less state (adafactor)',
  'gradient': _SHARDED,
  'optimizer update': _SHARDED,
  'collective': 'a layout that moves less at once (fsm.why says why it is there)',
  'batch and other inputs': 'a smaller batch per chip, or more data parallelism',
  'input copy': 'a smaller batch per chip',
  'offload': (
    'a copy XLA schedules early is on the chip for longer: remat instead, or '
    'a layout that needs less'
  ),
  'output': 'donate the arguments the step returns (donate_argnums=)',
}
"""What would shrink a row of each kind, as a does-not-fit verdict says it."""

_PHASE_TEXT = {'forward': 'forward pass', 'backward': 'backward pass'}
_PHASE_TEXT['optimizer update'] = 'optimizer update'


def _what(r: PeakRow) -> str:
  text = r.what or '(unnamed)'
  if r.checkpoint:
    text += f" '{r.checkpoint}'"
  if r.role:
    text += f' ({ROLE_TEXT.get(r.role, r.role)})'
  return f'{text} x {r.layers} layers' if r.layers else text


@dataclasses.dataclass(frozen=True)
class DiffRow:
  """One row before and after a change (0 where it is absent)."""

  kind: str
  what: str
  where: str
  before: int
  after: int
  scope: str = ''
  checkpoint: str = ''  # the activation's checkpoint_name, on either side

  @property
  def change(self) -> int:
    return self.after - self.before

  def to_dict(self) -> dict[str, Any]:
    return {**dataclasses.asdict(self), 'change': self.change}


@dataclasses.dataclass(frozen=True)
class PeakDiff(ShownWithTreescope):
  """Two peaks side by side: what a change (a remat policy, a batch, a mesh,
  a preset, a dtype) moved, row by row. The rows' changes add up to
  :attr:`change`.

  Attributes:
    rows: largest change first.
    before, after: the two totals.

  Example:
    >>> import flax_shardmeta as fsm
    >>> saved = fsm.PeakRow('activation', 'tanh', 'model.py:7', 800)
    >>> a = fsm.PeakMemory((saved, fsm.PeakRow('parameter', 'w', '', 100)), 900)
    >>> b = fsm.PeakMemory((fsm.PeakRow('parameter', 'w', '', 100),), 100)
    >>> d = a.diff(b)
    >>> d.change, [(r.what, r.change) for r in d.rows]
    (-800, [('tanh', -800)])
  """

  rows: tuple[DiffRow, ...]
  before: int
  after: int

  @property
  def change(self) -> int:
    return self.after - self.before

  @classmethod
  def of(cls, before: PeakMemory, after: PeakMemory) -> PeakDiff:
    merged: dict[tuple[str, str, str, str], list[int]] = {}
    names: dict[tuple[str, str, str, str], str] = {}
    for side, peak in enumerate((before, after)):
      for r in peak.rows:
        merged.setdefault(r.key(), [0, 0])[side] += r.bytes
        if r.checkpoint:
          names.setdefault(r.key(), r.checkpoint)
    rows = [
      DiffRow(kind, what, where, b, a, scope, names.get((kind, what, where, scope), ''))
      for (kind, what, where, scope), (b, a) in merged.items()
      if a != b
    ]
    rows.sort(key=lambda r: (-abs(r.change), r.kind, r.what))
    return cls(tuple(rows), before.total_bytes, after.total_bytes)

  def by_kind(self) -> dict[str, int]:
    """The change per kind."""
    out: dict[str, int] = {}
    for r in self.rows:
      out[r.kind] = out.get(r.kind, 0) + r.change
    return out

  def format(self, top: int = 12) -> str:
    head = (
      f'peak {format_bytes(self.before)} -> {format_bytes(self.after)} per chip '
      f'({_signed(self.change)})'
    )
    cells = [
      (r.kind, (r.what or '(unnamed)') + (f" '{r.checkpoint}'" if r.checkpoint else ''),
       r.where, format_bytes(r.before),
       format_bytes(r.after), _signed(r.change))
      for r in self.rows[:top]
    ]  # fmt: skip
    lines = [head, *(table(cells, {3, 4, 5}) if cells else [])]
    if len(self.rows) > top:
      rest = sum(r.change for r in self.rows[top:])
      lines.append(f'... {len(self.rows) - top} more rows, {_signed(rest)}')
    return '\n'.join(lines)

  def __str__(self) -> str:
    return self.format()

  def _treescope_view(self) -> dict[str, Any]:
    return {
      'change': _signed(self.change),
      **{
        f'{r.kind}: {r.what or "(unnamed)"}'
        + (f' @ {r.where}' if r.where else ''): _signed(r.change)
        for r in self.rows[:30]
      },
    }

  def to_dict(self) -> dict[str, Any]:
    return {
      'before': self.before,
      'after': self.after,
      'change': self.change,
      'by_kind': self.by_kind(),
      'rows': [r.to_dict() for r in self.rows],
    }


def _signed(n: int) -> str:
  """``+1.50 MiB`` / ``-3.25 MiB``: a change, always with its sign."""
  return ('+' if n >= 0 else '-') + format_bytes(abs(n))


def merge_rows(rows: Sequence[PeakRow]) -> tuple[PeakRow, ...]:
  """Rows of the same kind, what, where, scope, layer count and checkpoint
  name as one (a value split in pieces, one parameter's several buffers),
  largest first."""
  merged: dict[tuple[Any, ...], PeakRow] = {}
  for r in rows:
    key = (*r.key(), r.layers, r.checkpoint)
    found = merged.get(key)
    if found is not None:
      r = dataclasses.replace(found, bytes=found.bytes + r.bytes)
    merged[key] = r
  return tuple(sorted(merged.values(), key=lambda r: (-r.bytes, r.kind, r.what)))
