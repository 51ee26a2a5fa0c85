"""Who holds each byte of a step's peak: fit's rows split by argument path,
output path and the temporaries XLA's buffer assignment has alive at the
peak, each told by why's reading of the program (``hlo.attribution``).

Every group splits one of fit's rows exactly, so the rows add up to fit's
total: the arguments by leaf (what XLA adds is ``argument padding``), the
outputs not donated by leaf (the result tuple's pointers are the rest), the
temporaries by value at the heap's peak (the heap's holes are ``heap
fragmentation``; what ``memory_analysis`` counts beyond the buffer
assignment, a TPU's runtime scratch, is ``compiler scratch``), and the
generated code. A peak compiled at two depths is extrapolated row by row
(``extrapolated``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from flax_shardmeta._capacity import vocabulary as vocab
from flax_shardmeta._capacity.hlo.attribution import Attributor, plan_path
from flax_shardmeta._capacity.peak.rows import PeakMemory, PeakRow, merge_rows
from flax_shardmeta._capacity.peak.values import ValueReader
from flax_shardmeta._programs.buffers import Buffers, Value
from flax_shardmeta._programs.memory import ProgramMemory


def peak_memory(
  rows: Sequence[vocab.Row],
  memory: ProgramMemory,
  inputs: Sequence[Sequence[Any]],
  categories: Sequence[str],
  names: Sequence[str],
  outputs: Sequence[Sequence[Any]] | None,
  output_bytes: Sequence[Sequence[Any]],
  aliases: dict[int, int],
  buffers: Buffers | None,
  attributor: Attributor | None,
) -> PeakMemory:
  """What holds the peak of a compiled step whose report has ``rows``.

  Args:
    rows: the report's rows (their bytes add up to its total).
    memory: XLA's memory analysis of device memory.
    inputs: per input leaf ``(path, bytes, is a key, shape, on the host)``.
    categories: per input leaf its report category, or () to tell them from
      the paths.
    names: the step's argument names (paths begin with them).
    outputs: per output leaf ``(path, shape)``.
    output_bytes: per output leaf ``(bytes, on the host)``.
    aliases: output position -> the donated argument it reuses.
    buffers: the buffer assignment's temporaries (None: not dumped).
    attributor: why's reader of the program, for the temporaries.
  """
  by_row = {r.name: r.bytes for r in rows}
  out = _argument_rows(inputs, categories, names, by_row)
  out += _output_rows(outputs, output_bytes, aliases, by_row.get(vocab.OUTPUTS, 0))
  temps, phase, at, notes = _temporary_rows(
    buffers, attributor, by_row.get(vocab.TEMPORARIES, 0)
  )
  out += temps
  code = by_row.get(vocab.CODE, 0)
  if code:
    out.append(PeakRow('generated code', 'the program itself', '', code))
  method = (
    "XLA's buffer assignment and live ranges of the compiled step"
    if buffers is not None
    else "XLA's memory analysis (no buffer assignment: temporaries unsplit)"
  )
  total = sum(r.bytes for r in rows)
  return PeakMemory(merge_rows(out), total, phase, at, method, tuple(notes))


def compiled_peak(
  rows: Sequence[vocab.Row],
  memory: ProgramMemory,
  found: Any,
  categories: Sequence[str],
  names: Sequence[str],
) -> PeakMemory:
  """:func:`peak_memory` of a compiled fit's figures (``found``)."""
  return peak_memory(
    rows, memory, found.input_bytes, categories, names, found.outputs,
    found.output_bytes, found.aliases, found.buffers, found.attributor,
  )  # fmt: skip


def estimated_peak(
  rows: Sequence[vocab.Row], arguments: Any, names: Sequence[str]
) -> PeakMemory:
  """The peak of an estimate (no compiled program): the arguments by leaf as
  laid out, the rest as the estimate's rows, which nothing splits further.

  Args:
    rows: the estimate's rows.
    arguments: the step's ``traced_step.Arguments``.
    names: the step's argument names.
  """
  import jax

  leaves, _ = jax.tree_util.tree_flatten_with_path(arguments.lowered)
  hosted = arguments.on_host or [False] * len(leaves)
  inputs = [
    (jax.tree_util.keystr(path), size, False, list(getattr(leaf, 'shape', ())), host)
    for (path, leaf), size, host in zip(leaves, arguments.layout_bytes, hosted)
  ]
  categories = arguments.categories if len(inputs) == len(arguments.categories) else ()
  by_row = {r.name: r.bytes for r in rows}
  out = _argument_rows(inputs, categories, names, by_row)
  unknown = []
  for r in rows:
    if r.name in vocab.ARGUMENT_ROWS or not r.bytes:
      continue
    kind = _ESTIMATED.get(r.name, 'temporary')
    out.append(PeakRow(kind, f'{r.name} (estimated: not split)', '', r.bytes))
    unknown.append(str(r.name))
  notes = (
    'an estimate: no compiled program, so no buffer assignment; the arguments '
    f'are split by leaf, {", ".join(unknown) or "nothing else"} not by holder '
    '(compile for the target to see them)',
  )
  method = 'estimated from the plan and a walk of the traced step'
  return PeakMemory(merge_rows(out), sum(r.bytes for r in rows), '', '', method, notes)


_ESTIMATED: dict[str, str] = {
  vocab.OUTPUTS: 'output',
  vocab.GRADIENTS: 'gradient',
  vocab.ACTIVATIONS: 'activation',
  vocab.TEMPORARIES: 'temporary',
  vocab.CODE: 'generated code',
}


# Arguments and outputs
# ------------------------------------------------------------------------------

_KIND_OF: dict[str, str] = {
  vocab.PARAMETERS: 'parameter',
  vocab.OPTIMIZER: 'optimizer state',
  vocab.RNG: 'RNG state',
  vocab.INPUTS: 'batch and other inputs',
}


def _argument_rows(
  inputs: Sequence[Sequence[Any]],
  categories: Sequence[str],
  names: Sequence[str],
  by_row: dict[str, int],
) -> list[PeakRow]:
  """A row per argument leaf in device memory; what XLA adds is padding."""
  from flax_shardmeta._capacity.fit.traced_step import path_category

  told = list(categories) if len(categories) == len(inputs) else []
  out = []
  for i, leaf in enumerate(inputs):
    size, hosted = int(leaf[1]), len(leaf) > 4 and bool(leaf[4])
    if size <= 0 or hosted:
      continue
    category = told[i] if told else path_category(leaf[0], leaf[2])
    kind = _KIND_OF.get(category, 'batch and other inputs')
    out.append(PeakRow(kind, plan_path(leaf[0], names), '', size, shape=_shape(leaf)))
  # The argument rows of the report are XLA's argument figure; padding and
  # layout are what the leaves do not account for.
  held = sum(by_row.get(c, 0) for c in vocab.ARGUMENT_ROWS)
  rest = held - sum(r.bytes for r in out)
  if rest:
    out.append(PeakRow('argument padding', 'bytes XLA adds to the arguments', '', rest))
  return out


def _shape(leaf: Sequence[Any]) -> str:
  return 'x'.join(str(d) for d in leaf[3]) if len(leaf) > 3 and leaf[3] else ''


def _output_rows(
  outputs: Sequence[Sequence[Any]] | None,
  output_bytes: Sequence[Sequence[Any]],
  aliases: dict[int, int],
  held: int,
) -> list[PeakRow]:
  """A row per output leaf that reuses no donated argument."""
  out = []
  paths = [str(o[0]) for o in outputs] if outputs else []
  for i, leaf in enumerate(output_bytes):
    size, hosted = int(leaf[0]), len(leaf) > 1 and bool(leaf[1])
    if i in aliases or size <= 0 or hosted:
      continue
    what = f'output{paths[i]}' if i < len(paths) else f'output {i}'
    out.append(PeakRow('output', what, '', size))
  rest = held - sum(r.bytes for r in out)
  if rest:
    what = (
      'the result tuple (a pointer per output)' if rest > 0 else 'outputs XLA donated'
    )
    out.append(PeakRow('output', what, '', rest))
  return out


# Temporaries
# ------------------------------------------------------------------------------


def _temporary_rows(
  buffers: Buffers | None, attributor: Attributor | None, held: int
) -> tuple[list[PeakRow], str, str, list[str]]:
  """Rows of the values alive at the heap's peak; the phase and operation
  at the peak; notes on what is not named."""
  if buffers is None or attributor is None:
    note = (
      'XLA wrote no buffer assignment for this program: its temporaries are one row'
    )
    rows = [PeakRow('temporary', '', '', held)] if held else []
    return rows, '', '', [note]
  reader = ValueReader(attributor)
  out = [reader.row(v, size) for v, size in _own_bytes(buffers.at_peak) if size > 0]
  holes = buffers.temporaries - buffers.live_bytes
  if holes:
    what = "XLA's heap not covered by the values alive at the peak"
    out.append(PeakRow('heap fragmentation', what, '', holes))
  scratch = held - buffers.temporaries
  if scratch:
    what = 'temporary memory XLA counts beyond its buffer assignment'
    out.append(PeakRow('compiler scratch', what, '', scratch))
  phase, at = reader.peak(buffers.peak_instruction)
  unnamed = [r for r in out if r.kind == 'temporary' and not r.named]
  notes = []
  if unnamed:
    size = sum(r.bytes for r in unnamed)
    notes.append(
      f'{len(unnamed)} temporaries ({size:,} bytes) are values the program '
      'text does not hold (their instruction was not found): unnamed'
    )
  return out, phase, at, notes


def _own_bytes(values: Sequence[Value]) -> list[tuple[Value, int]]:
  """Each value with the bytes no value before it covers (the values of one
  buffer share it: the first, the largest, holds it)."""
  out = []
  taken: dict[int, list[tuple[int, int]]] = {}
  for v in sorted(values, key=lambda v: (-v.bytes, v.offset, v.name, v.index)):
    start, stop = v.offset, v.offset + v.bytes
    own = v.bytes
    for a, b in taken.get(v.allocation, []):
      own -= max(0, min(b, stop) - max(a, start))
    taken.setdefault(v.allocation, []).append((start, stop))
    out.append((v, max(own, 0)))
  return out


def extrapolated(
  small: PeakMemory, large: PeakMemory, a: int, b: int, layers: int, total: int
) -> PeakMemory:
  """The peak at ``layers`` from the peaks of compiles at ``a`` and ``b``
  layers, row by row on the same line as fit's figures; rows stacked over
  ``b`` layers say ``layers``. What rounding leaves goes to the heap's row.

  Example:
    >>> row = lambda n: PeakRow('activation', 'tanh', 'm.py:3', n, layers=0)
    >>> x = extrapolated(PeakMemory((row(100),), 100), PeakMemory((row(160),), 160),
    ...                  2, 4, 32, 1000)
    >>> x.rows[0].bytes, x.total_bytes
    (1000, 1000)
  """
  t = (layers - a) / (b - a)
  before = {r.key(): r.bytes for r in small.rows}
  rows = []
  for r in large.rows:
    x = before.get(r.key(), 0)
    size = max(round(x + (r.bytes - x) * t), 0)
    stacked = layers if r.layers == b else r.layers
    rows.append(dataclasses.replace(r, bytes=size, layers=stacked))
  rest = total - sum(r.bytes for r in rows)
  if rest:
    what = 'what extrapolating the rows one by one leaves (rounding)'
    rows.append(PeakRow('heap fragmentation', what, '', rest))
  note = f'extrapolated row by row from compiles at {a} and {b} layers'
  return PeakMemory(
    merge_rows(rows), total, large.phase, large.at, large.method, (*large.notes, note)
  )
