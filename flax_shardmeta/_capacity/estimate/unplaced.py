"""The values the estimate could not lay out: what they are and where they are made.

Under Auto mesh axes the estimate lays out each value inside the step from the
arguments' layouts and the constraints that reach it (``_capacity.estimate.propagate``).
A value nothing reaches is counted replicated, whole on every chip, which can
turn a verdict on its own: so the report names each such value with the scope
and the line of the user's code that makes it, largest first, and says how
much of the peak rests on them: where a constraint
(``fsm.with_logical_constraint``) would tell the layout.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import textwrap
from collections.abc import Iterator
from typing import Any

from flax_shardmeta._arrays import array_bytes
from flax_shardmeta._frames import user_frame
from flax_shardmeta._units import signed_bytes, table

Key = tuple[str, str, tuple[int, ...], str]
"""What makes two values one entry: scope, source line, shape, dtype."""

SHOWN = 10
"""How many values the printed report lists (``report.unplaced`` has all)."""


@dataclasses.dataclass(frozen=True)
class UnplacedValue:
  """Values inside the step that nothing lays out, counted replicated.

  One entry stands for every value made by the same line in the same scope
  with the same shape and dtype (``count`` of them).

  Attributes:
    shape: the value's shape.
    dtype: its dtype's name, e.g. ``'float32'``.
    bytes: bytes per chip of one such value as counted: the whole array.
    scope: jax's name stack where it is made, e.g. ``'jvp(Transformer)/attn'``
      (``jvp(...)`` is the forward pass, ``transpose(...)`` the backward).
    source: ``'file:line'`` of the innermost frame of the user's code that
      makes it (outside jax, flax, optax and flax_shardmeta), ``''`` if none.
    primitive: the operation that makes it, e.g. ``'dot_general'`` (the
      first one's, when the line makes several).
    count: how many values this entry stands for.
    at_peak: how many of them are live at the step's peak.

  Example:
    >>> v = UnplacedValue((8, 1024), 'float32', 32768, 'jvp(mlp)', 'step.py:12',
    ...                   'dot_general', count=2, at_peak=1)
    >>> v.label, v.to_dict()['source'], v.peak_bytes
    ('float32[8,1024]', 'step.py:12', 32768)
  """

  shape: tuple[int, ...]
  dtype: str
  bytes: int
  scope: str
  source: str
  primitive: str
  count: int = 1
  at_peak: int = 0

  @property
  def label(self) -> str:
    """``dtype[shape]``, e.g. ``'float32[8,1024]'``."""
    return f'{self.dtype}[{",".join(str(n) for n in self.shape)}]'

  @property
  def peak_bytes(self) -> int:
    """Bytes of these values live at the peak."""
    return self.bytes * self.at_peak

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form."""
    d = dataclasses.asdict(self)
    d['shape'] = list(self.shape)
    return d


@dataclasses.dataclass
class Found:
  """The values without a layout one walk over a step met, by :data:`Key`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> eqn = jax.make_jaxpr(lambda x: x @ x)(jnp.ones((4, 4))).eqns[0]
    >>> found = Found()
    >>> key = found.add(eqn, eqn.outvars[0].aval)
    >>> [(v.label, v.bytes, v.primitive) for v in found.listing({key: 1})]
    [('float32[4,4]', 64, 'dot_general')]
  """

  values: dict[Key, UnplacedValue] = dataclasses.field(default_factory=dict)
  # The source info of the equations whose sub-programs are being walked,
  # outermost first: a nested jit's equations know only their own frames and
  # scopes, from where its trace began.
  outer: list[Any] = dataclasses.field(default_factory=list)

  @contextlib.contextmanager
  def inside(self, eqn: Any) -> Iterator[None]:
    """Walks the sub-programs of ``eqn`` within its scope and source line."""
    self.outer.append(eqn.source_info)
    try:
      yield
    finally:
      self.outer.pop()

  def add(self, eqn: Any, aval: Any) -> Key:
    """Counts one output of ``eqn`` that has no layout; returns its key."""
    shape = tuple(int(n) for n in aval.shape)
    infos = [*self.outer, eqn.source_info]
    # The innermost line of the user's own: a jnp function's equations know
    # only jax's frames, their caller's equation knows the user's.
    lines = (_as_written(getattr(i, 'traceback', None)) for i in reversed(infos))
    source = next((line for line in lines if line), '')
    key = (_scope(infos), source, shape, str(aval.dtype))
    old = self.values.get(key)
    if old is not None:
      self.values[key] = dataclasses.replace(old, count=old.count + 1)
    else:
      nbytes = array_bytes(shape, aval.dtype)  # replicated: the whole array
      self.values[key] = UnplacedValue(
        shape, str(aval.dtype), nbytes, key[0], source, eqn.primitive.name
      )
    return key

  def listing(
    self, at_peak: collections.Counter[Key] | dict[Key, int]
  ) -> tuple[UnplacedValue, ...]:
    """Every entry, largest first, with how many are live at the peak."""
    out = [
      dataclasses.replace(v, at_peak=min(at_peak.get(k, 0), v.count))
      for k, v in self.values.items()
    ]
    return tuple(
      sorted(out, key=lambda v: (-v.bytes, -v.at_peak, -v.count, v.source, v.scope))
    )


# Where a value is made: the user's line
# ------------------------------------------------------------------------------


def _scope(infos: list[Any]) -> str:
  """The name stack of the innermost of nested source infos, as jax would
  print it had it inlined them (each inner stack goes on its caller's)."""
  stacks: list[Any] = [getattr(i, 'name_stack', None) for i in infos]
  try:
    whole = stacks[0]
    for inner in stacks[1:]:
      whole = whole + inner
    return str(whole or '')
  except TypeError:  # not jax's NameStack: join what each prints
    return '/'.join(str(n) for n in stacks if n)


def _as_written(traceback: Any) -> str:
  """``'file:line'`` of the user's frame, the file as the traceback names it
  (``''`` when the step's own code made no frame of it)."""
  found = user_frame(traceback)
  return f'{found[0]}:{found[1]}' if found else ''


# Reading them in the report
# ------------------------------------------------------------------------------


def peak_bytes(values: tuple[UnplacedValue, ...]) -> int:
  """Bytes of the peak that rest on values nothing lays out."""
  return sum(v.peak_bytes for v in values)


def report_lines(values: tuple[UnplacedValue, ...], total: int) -> list[str]:
  """The line under the verdict saying how much of ``total`` rests on values
  nothing lays out, then the table of the largest (nothing when none).

  Example:
    >>> v = UnplacedValue((1024, 1024), 'float32', 2**22, 'jvp(loss)', 'step.py:7',
    ...                   'gather', at_peak=1)
    >>> print('\\n'.join(report_lines((v,), 2**24)))
    of which 4.00 MiB (25.0%) are values nothing lays out: add a constraint
          (fsm.with_logical_constraint) where they are made
    <BLANKLINE>
    values without a layout (counted replicated), largest first; * = live at the peak
           bytes  count  value               made by  scope      source
      *  4.00 MiB      1  float32[1024,1024]  gather   jvp(loss)  step.py:7
  """
  if not values:
    return []
  rest = min(peak_bytes(values), total)
  if rest:
    said = (
      f'of which {signed_bytes(rest)} ({rest / max(total, 1):.1%}) are values nothing '
      'lays out: add a constraint (fsm.with_logical_constraint) where they are made'
    )
  else:
    said = 'none of it rests on the values nothing lays out: none is live at the peak'
  lines = textwrap.wrap(said, 100, subsequent_indent='      ', break_on_hyphens=False)
  lines += [
    '',
    'values without a layout (counted replicated), largest first; * = live at the peak',
  ]
  lines += _table(values[:SHOWN])
  if len(values) > SHOWN:
    lines.append(f'  ... and {len(values) - SHOWN} more in report.unplaced')
  return lines


def _table(values: tuple[UnplacedValue, ...]) -> list[str]:
  """One row per value, its source last; each source on a line of its own
  when that would make a row wider than 100 columns."""
  head = ('', 'bytes', 'count', 'value', 'made by')
  rows = [
    (
      '*' if v.at_peak else '',
      signed_bytes(v.bytes),
      f'{v.count:,}',
      v.label,
      v.primitive,
    )
    for v in values
  ]
  scopes = [v.scope or '-' for v in values]
  sources = [_shown_path(v.source) or '-' for v in values]
  # Room left for the scope and source columns: indent and separators counted.
  fixed = sum(max(len(r[i]) for r in (head, *rows)) + 2 for i in range(len(head)))
  room = 100 - 2 - fixed
  if max(len(s) for s in scopes) + 2 + max(len(s) for s in sources) <= room:
    cells = [(*r, c, s) for r, c, s in zip(rows, scopes, sources)]
    return ['  ' + line for line in table([(*head, 'scope', 'source'), *cells], {1, 2})]
  cells = [(*r, _clip(c, max(room, 16))) for r, c in zip(rows, scopes)]
  lines = table([(*head, 'scope (source below)'), *cells], {1, 2})
  out = ['  ' + lines[0]]
  for line, source in zip(lines[1:], sources):
    out += [
      '  ' + line,
      *textwrap.wrap(source, 100, initial_indent=' ' * 8, subsequent_indent=' ' * 8),
    ]
  return out


def _clip(text: str, width: int) -> str:
  """``text``, its start cut off to fit ``width`` (the innermost scope stays)."""
  return text if len(text) <= width else '...' + text[-(width - 3) :]


def _shown_path(source: str) -> str:
  """A source line as printed: relative to the working folder when inside it
  (``report.unplaced`` keeps the path as the traceback gives it)."""
  try:
    rel = os.path.relpath(source)
  except ValueError:  # another drive (Windows)
    return source
  return source if rel.startswith('..') else rel
