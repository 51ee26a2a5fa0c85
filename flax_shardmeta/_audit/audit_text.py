"""An Explicit audit as text: sites, notes and the two programs side by side."""

from __future__ import annotations

from typing import Any

from flax_shardmeta._units import format_bytes, table

# An ExplicitAudit (audit_explicit's, which shows itself through ``text``).
ExplicitAudit = Any

MORE = 0.10
"""An Explicit figure this much above Auto's is flagged as costing more."""


def text(r: ExplicitAudit) -> str:
  mesh = ' x '.join(f'{n}={s}' for n, s in zip(r.mesh.axis_names, r.mesh.axis_sizes))
  n = sum(s.count for s in r.sites)
  lines = [
    f'Explicit axes audit on {mesh}: {len(r.sites)} sites to change '
    f'({n} operations refused), largest value first'
  ]
  for i, s in enumerate(r.sites, 1):
    tags = [f'x{s.count}'] if s.count > 1 else []
    tags += ['with its gradient'] if s.backward else []
    tags += [] if s.from_auto else ['layout: replicated, XLA gave none']
    lines.append(f'{i}. {s.where}  {s.op}' + (f'  ({", ".join(tags)})' if tags else ''))
    lines.append(f'   operands: {", ".join(s.operands) or "-"}')
    lines.append(f'   jax: {s.reason}')
    lines += [f'   {line}' for line in s.fix_lines()]
  if r.notes:
    lines.append('Also:')
    lines += [f'- {n.kind}: {n.where}: {n.what}. Fix: {n.fix}' for n in r.notes]
  if not r.compiles:
    lines += _stopped(r)
    return '\n'.join(lines)
  lines += _what_compiled(r)
  lines.append(
    'With every fix the step compiles under Explicit axes. Per chip per step:'
  )
  assert r.explicit is not None and r.auto is not None
  a, e = r.auto, r.explicit
  rows = [('', 'Auto', 'Explicit')]
  for key in sorted(set(a.collectives) | set(e.collectives)):
    kind, axes = key
    rows.append((
      f'{kind} over {",".join(axes) or "-"}',
      format_bytes(a.collectives.get(key, 0)), format_bytes(e.collectives.get(key, 0)),
    ))  # fmt: skip
  rows += [
    ('sharding annotations', str(a.sharding_ops), str(e.sharding_ops)),
    ('transposes', str(a.transposes), str(e.transposes)),
    ('memory', format_bytes(a.memory), format_bytes(e.memory)),
  ]
  lines += ['  ' + line for line in table(rows, {1, 2})]
  more = r.costs_more()
  lines.append(
    'Explicit costs more: ' + ('; '.join(more) if more else 'nowhere (within 10%)')
  )
  return '\n'.join(lines)


def _what_compiled(r: ExplicitAudit) -> list[str]:
  """What the compiled program holds where it differs from the printed
  fixes: an ``auto_axes`` fix (or one in words) is applied in the trace to
  the refused operation alone, not to the whole expression printed."""
  wrapped = [str(i) for i, s in enumerate(r.sites, 1) if s.how == 'auto_axes']
  words = [str(i) for i, s in enumerate(r.sites, 1) if s.replaces is None]
  out = []
  if wrapped:
    out.append(
      f'Compiled for site {", ".join(wrapped)}: jax.sharding.auto_axes around the '
      'refused operation alone; the printed fix wraps the expression holding it '
      '(the layout XLA gives its value under Auto axes), not compiled as printed.'
    )
  if words:
    out.append(
      f'Compiled for site {", ".join(words)} (a fix in words): the refused '
      "operation given the layout named, where it is (the library's code)."
    )
  return out


def _stopped(r: ExplicitAudit) -> list[str]:
  """Where the step stopped, and what the sites above are then."""
  found = (
    'The sites above are those found before that point'
    if r.sites
    else ('No site was found before that point')
  )
  if r.auto_error:
    return [
      f'The step stops under Auto axes too, for its own reason: {r.auto_error}.',
      f'{found}; nothing was compiled, and the fixes are not proven.',
    ]
  return [
    f'With these fixes the step does not trace or compile under Explicit axes: '
    f'{r.error}.',
    f'{found}; the step is not proven to compile.',
  ]
