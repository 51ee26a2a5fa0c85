"""``report.why()``: why each collective of a step is there, and what looks
unexpected.

The rows of a ``FitReport`` carry their attribution (``hlo_attribution``):
reason, parameters, the user's line and module scope. This module groups them
by reason, largest bytes first, and ends with what deserves a look: reshards
of computed values that no constraint asked for, dimensions replicated
because they do not divide, parameters gathered by more than one collective
per step.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence
from typing import Any

from flax_shardmeta._capacity.hlo.attribution import REASONS
from flax_shardmeta._capacity.hlo.roofline import CollectiveRow
from flax_shardmeta._units import format_bytes, table

_MEANING = {
  'parameter': 'gathering parameters for use (FSDP, or a layout the matmul wants)',
  'gradient': "reducing or scattering parameters' gradients",
  'routing': 'moving tokens to their experts and back (dispatch, experts, combine)',
  'activation': 'resharding values computed in the step',
  'explicit': "collectives the step's code calls (ppermute, psum... in shard_map)",
  'other': 'scalars, the loss and metrics',
  'unknown': 'the data flow does not tell',
  '': 'not attributed',
}


def format_why(
  collectives: Sequence[CollectiveRow],
  replicated: Sequence[str] = (),
  top: int = 8,
  host: Any = None,
) -> str:
  """The readable table of :meth:`FitReport.why`; with ``host`` (the
  report's :class:`HostMemory`), the copies between host and chip memory
  too, as their own kind, ``offload``.

  Example:
    >>> rows = [CollectiveRow('all-gather', ('data',), 4, 2**30, reason='parameter',
    ...                       parameters=('params/w',), sources=('model.py:9',))]
    >>> format_why(rows).splitlines()[1][:56]
    'parameter: 1.00 GiB per chip per step in 4 collectives: '
  """
  moved = offload_lines(host, top)
  if not collectives and not replicated and not moved:
    return 'Why each collective is there: the step runs none.'
  lines = ['Why each collective is there (per chip, per step; largest first):']
  if not collectives:
    lines.append('the step runs none.')
  by_reason: dict[str, list[CollectiveRow]] = {}
  for row in collectives:
    by_reason.setdefault(row.reason, []).append(row)
  order = sorted(by_reason, key=lambda r: -sum(x.bytes for x in by_reason[r]))
  for reason in order:
    rows = sorted(by_reason[reason], key=lambda r: -r.bytes)
    total = sum(r.bytes for r in rows)
    count = sum(r.count for r in rows)
    lines.append(
      f'{reason or "unattributed"}: {format_bytes(int(total))} per chip per step in '
      f'{count:,} collectives: {_MEANING.get(reason, "")}'
    )
    shown = [('  kind', 'over', 'link', 'count', 'bytes', 'what', 'where')]
    for r in rows[:top]:
      shown.append(
        (
          f'  {r.kind}',
          r.over,
          r.link or '-',
          f'{r.count:,}',
          format_bytes(int(r.bytes)),
          _what(r),
          _where(r),
        )
      )
    lines += table(shown, {3, 4})
    if len(rows) > top:
      rest = sum(r.bytes for r in rows[top:])
      lines.append(f'  ... {len(rows) - top} more rows, {format_bytes(int(rest))}')
  lines += moved
  lines += ['', 'What looks unexpected:']
  found = unexpected(collectives, replicated)
  for f in found or ['nothing: every reshard was asked for.']:
    lines += textwrap.wrap(
      f'- {f}', 100, subsequent_indent='  ', break_on_hyphens=False
    )
  return '\n'.join(lines)


def offload_lines(host: Any, top: int = 8) -> list[str]:
  """The step's copies between host and chip memory (``host``: a
  :class:`HostMemory`), as a group of :func:`format_why`: by argument path
  and by offloaded checkpoint name; empty when it moves nothing.

  Example:
    >>> from flax_shardmeta._capacity.fit.host_side import HostMemory, HostRow
    >>> h = HostMemory(2**20, (HostRow('argument', 'opt/mu', '', 2**20),), 4, 1,
    ...                None, '', '', to_device_bytes=2**20, to_host_bytes=2**20)
    >>> offload_lines(h)[0][:45]
    'offload: 1.00 MiB to the chip and 1.00 MiB to'
  """
  if host is None or not (host.to_device_bytes or host.to_host_bytes):
    return []
  lines = [
    f'offload: {format_bytes(host.to_device_bytes)} to the chip and '
    f'{format_bytes(host.to_host_bytes)} to the host per chip per step: moving '
    f'what the step keeps in host memory ({host.time_words()})'
  ]
  shown = [('  kind', 'what', 'where', 'bytes', 'moved')]
  for r in list(host.rows)[:top]:
    each = (
      'out in the forward pass, in for the backward'
      if r.kind == 'offloaded activations'
      else 'in and out each step'
      if r.kind == 'argument'
      else 'written each step'
      if r.kind == 'output'
      else 'between host and chip'
    )
    shown.append((f'  {r.kind}', r.what, r.where or '-', format_bytes(r.bytes), each))
  lines += table(shown, {3})
  return lines


def format_unknown_why(replicated: Sequence[str] = ()) -> str:
  """What :meth:`FitReport.why` says of an estimate: no program was compiled,
  so which collectives run is unknown.

  Example:
    >>> format_unknown_why().splitlines()[0]
    'Why each collective is there: unknown without compiling.'
  """
  lines = [
    'Why each collective is there: unknown without compiling.',
    'This report is an estimate (no compiler for the mesh): which collectives '
    'XLA inserts, and why, is only known once the step is compiled. Compile it '
    'for the devices: fsm.fit on a mesh of real devices, or of a TPU topology '
    "(topology='v5p:4x4x4', the tpu extra) or a GPU cluster "
    "(topology='h100:4x8', the gpu extra); then report.why().",
  ]
  lines = [w for line in lines for w in textwrap.wrap(line, 100)]
  if replicated:
    lines += ['', 'What looks unexpected:']
    lines += [
      f'- replicated because a dimension does not divide: {t}' for t in replicated
    ]
  return '\n'.join(lines)


def unexpected(
  collectives: Sequence[CollectiveRow], replicated: Sequence[str] = ()
) -> list[str]:
  """The findings :func:`format_why` ends with, largest first."""
  found = not_expert_parallel(collectives)
  # All-reduces of partial sums are a sharded contraction's own; reshards
  # (gathers, all-to-alls, permutes) are layout changes somebody chose.
  unasked = sorted(
    (
      r
      for r in collectives
      if r.reason == 'activation'
      and r.asked_by != 'constraint'
      and r.kind != 'all-reduce'
    ),
    key=lambda r: -r.bytes,
  )
  for r in unasked[:3]:
    found.append(
      f'{r.kind} over {r.over}, {format_bytes(int(r.bytes))}/step, reshards a value '
      f'made at {_where(r)} ({r.change or "layout change"}, for {r.asked_by or "?"}) '
      'that no constraint asked for: a constraint on that value '
      '(fsm.with_logical_constraint) fixes its layout where you choose'
    )
  unknown = [r for r in collectives if r.reason == 'unknown']
  if unknown:
    total = sum(r.bytes for r in unknown)
    found.append(
      f'{format_bytes(int(total))}/step in {len(unknown)} rows moves values whose '
      'use the data flow does not tell (no parameter, output or computation '
      'reached): they are listed as unknown rather than guessed'
    )
  for text in replicated:
    found.append(
      f'replicated because a dimension does not divide: {text}; the fix: make '
      "that dimension a multiple of the axis's size (pad it), or map its name to "
      'an axis whose size divides it'
    )
  gathers: dict[str, int] = {}
  for r in collectives:
    if r.reason == 'parameter':
      for p in r.parameters:
        gathers[p] = gathers.get(p, 0) + r.instructions
  for path, n in sorted(gathers.items(), key=lambda kv: -kv[1]):
    if n > 1:
      found.append(
        f'{path} is gathered by {n} collectives per step (e.g. forward and backward, '
        'or several uses): XLA gathers it again rather than keep it whole; '
        'expected with remat, otherwise check the layouts its uses want'
      )
      if len(found) > 8:
        break
  return found


def not_expert_parallel(collectives: Sequence[CollectiveRow]) -> list[str]:
  """The finding for parameters laid out over an axis on a dimension their
  use batches over (a mixture-of-experts layer's experts) that XLA gathers
  whole over that axis for use: each chip then computes every expert.

  Example:
    >>> gather = CollectiveRow('all-gather', ('expert',), 2, 2**20, reason='parameter',
    ...   parameters=('params/w1',), change='batched dim 0 over expert -> whole')
    >>> not_expert_parallel([gather])[0][:58]
    'not expert-parallel: params/w1 is laid out over expert on '
  """
  gathered: dict[str, float] = {}
  axes: set[str] = set()
  for r in collectives:
    if r.reason == 'parameter' and r.change.startswith('batched dim'):
      for path in r.parameters:
        gathered[path] = gathered.get(path, 0.0) + r.bytes
      axes.update(r.change.split(' over ', 1)[1].split(' ', 1)[0].split('+'))
  if not gathered:
    return []
  reduced = sum(
    r.bytes
    for r in collectives
    if r.reason == 'gradient'
    and set(r.parameters) & set(gathered)
    and set(r.axes) & axes
  )
  paths = sorted(gathered)
  named = ', '.join(paths[:4]) + (f' (+{len(paths) - 4})' if len(paths) > 4 else '')
  over = '+'.join(sorted(axes))
  verb = 'is' if len(paths) == 1 else 'are'
  grads = (
    f' and reduces the gradients over {over} ({format_bytes(int(reduced))}/step)'
    if reduced
    else ''
  )
  return [
    f'not expert-parallel: {named} {verb} laid out over {over} on a dimension '
    f'{"its matmul batches" if len(paths) == 1 else "their matmuls batch"} over '
    '(the experts), '
    f'yet XLA gathers {"it" if len(paths) == 1 else "them"} whole over {over} for '
    f'use ({format_bytes(int(sum(gathered.values())))}/step){grads}: every chip '
    'computes every expert and the tokens stay where they are. The fix: constrain '
    f"the routed tokens' expert dimension to {over} (fsm.with_logical_constraint on "
    "the dispatched tokens, the experts' logical name on that dimension), so that "
    'XLA moves the tokens and not the weights; or route with shard_map and '
    'jax.lax.all_to_all / ragged_all_to_all'
  ]


def _what(r: CollectiveRow) -> str:
  first = next(iter(r.parameters), None)
  if first is not None:
    more = f' (+{len(r.parameters) - 1})' if len(r.parameters) > 1 else ''
    ring = [part for part in r.change.split('; ') if 'windowed einsum' in part]
    return first + more + (f', {ring[0]}' if ring else '')
  if r.reason == 'activation':
    return r.change + (' (constraint)' if r.asked_by == 'constraint' else '')
  if r.reason == 'routing':
    return r.change
  if r.reason == 'explicit':
    return f'{r.asked_by}: {r.change}' if r.change else r.asked_by
  return '-'


def _where(r: CollectiveRow) -> str:
  source = next(iter(r.sources), '?')
  scope = scopes_text(r.scopes) if len(r.scopes) > 1 else _inner(r.scope)
  return f'{source} ({scope})' if scope else source


def _inner(scope: str) -> str:
  return '/'.join(scope.split('/')[-2:])  # the innermost modules say enough


def scopes_text(scopes: Sequence[str]) -> str:
  """Several module scopes of one row, said as such: layers (scopes that
  differ in one part) as ``'6 layers: block_0 .. block_5'``, else their
  number and the first.

  Example:
    >>> scopes_text(['M/block_10/mlp', 'M/block_2/mlp', 'M/block_0/mlp'])
    '3 layers: block_0/mlp .. block_10/mlp'
    >>> scopes_text(['M/enc', 'M/dec/attn'])
    '2 scopes: M/enc, ...'
  """
  # In the layers' own order (block_2 before block_10), not XLA's.
  scopes = sorted(
    scopes, key=lambda s: [(len(d), d) for d in re.findall(r'\d+|\D+', s)]
  )
  split = [s.split('/') for s in scopes]
  n = len(scopes)
  same_depth = len({len(p) for p in split}) == 1
  differ = [i for i in range(len(split[0])) if len({p[i] for p in split}) > 1]
  if same_depth and len(differ) == 1:
    first, last = ('/'.join(split[k][differ[0] :]) for k in (0, -1))
    return f'{n} layers: {first} .. {last}'
  return f'{n} scopes: {_inner(scopes[0])}, ...'


def why_dict(collectives: Sequence[CollectiveRow], replicated: Sequence[str]) -> Any:
  """JSON-ready form of :func:`format_why` (for ``--format json``)."""
  return {
    'reasons': {
      reason: sum(r.bytes for r in collectives if r.reason == reason)
      for reason in REASONS
    },
    'unexpected': unexpected(collectives, replicated),
  }
