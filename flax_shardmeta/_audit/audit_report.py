"""An Explicit audit's report: sites, notes and the two programs side by side."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from flax_shardmeta._audit.figures import ProgramFigures
from flax_shardmeta._audit.notes import Note
from flax_shardmeta._audit.sites import Site
from flax_shardmeta._specs import format_spec
from flax_shardmeta._units import format_bytes, table
from flax_shardmeta._views import ShownWithTreescope

MORE = 0.10
"""An Explicit figure this much above Auto's is flagged as costing more."""


@dataclasses.dataclass(frozen=True)
class ExplicitAudit(ShownWithTreescope):
  """What moving a step from Auto to Explicit axes takes, and costs.

  Attributes:
    sites: every refused operation, one per line of code and fix, largest
      value first.
    notes: size-1 axes, rules naming one axis twice, calls that cannot see
      Explicit axes.
    mesh: the Explicit mesh.
    auto, explicit: the compiled programs' figures (``explicit`` is None if
      the fixed step did not compile, ``auto`` if the step stops under Auto
      axes too; ``error`` says why).
    error: empty when the fixed step compiled under Explicit axes; else where
      and why it stopped (the sites are those found before that point).
    fixed_step: the step with every fix applied, on the Explicit mesh; takes
      the step's arguments.
    auto_error: where the step stops under Auto axes (its own error, not a
      sharding one), or empty.

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
    >>> mesh = jax.make_mesh((8,), ('model',), axis_types=(AxisType.Auto,))
    >>> x = jax.ShapeDtypeStruct((4, 16), jnp.float32,
    ...                          sharding=NamedSharding(mesh, P(None, 'model')))
    >>> report = fsm.audit_explicit(jnp.sum, x)
    >>> report.sites, report.compiles
    ((), True)
    >>> report.explicit.collectives == report.auto.collectives
    True
  """

  sites: tuple[Site, ...]
  notes: tuple[Note, ...]
  mesh: Any
  auto: ProgramFigures | None
  explicit: ProgramFigures | None
  error: str
  fixed_step: Callable[..., Any] = dataclasses.field(repr=False, compare=False)
  auto_error: str = ''

  @property
  def compiles(self) -> bool:
    """Whether the step with every fix compiled under Explicit axes."""
    return self.explicit is not None and not self.error

  def costs_more(self) -> list[str]:
    """Where the Explicit program spends more than the Auto one (by over
    :data:`MORE`), in words; empty when it does not."""
    if self.explicit is None or self.auto is None:
      return []
    out = []
    a, e = self.auto, self.explicit
    for key in sorted(set(a.collectives) | set(e.collectives)):
      before, after = a.collectives.get(key, 0), e.collectives.get(key, 0)
      if after > before * (1 + MORE) and after - before > 0:
        kind, axes = key
        out.append(
          f'{kind} over {",".join(axes) or "-"}: {format_bytes(after)} per chip per '
          f'step under Explicit, {format_bytes(before)} under Auto'
        )
    for name in ('sharding_ops', 'transposes', 'memory'):
      before, after = getattr(a, name), getattr(e, name)
      if after > before * (1 + MORE) and after > before:
        shown = format_bytes if name == 'memory' else str
        label = name.replace('_ops', ' annotations')
        out.append(
          f'{label}: {shown(after)} under Explicit, {shown(before)} under Auto'
        )
    return out

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form: each site, each note, both programs."""
    return {
      'mesh': dict(zip(self.mesh.axis_names, self.mesh.axis_sizes)),
      'sites': [s.to_dict() for s in self.sites],
      'notes': [n.to_dict() for n in self.notes],
      'compiles': self.compiles,
      'error': self.error,
      'auto_error': self.auto_error,
      'auto': None if self.auto is None else self.auto.to_dict(),
      'explicit': None if self.explicit is None else self.explicit.to_dict(),
      'costs_more': self.costs_more(),
    }

  def __str__(self) -> str:
    return _text(self)

  def _treescope_view(self) -> dict[str, Any]:
    return {
      'sites': {
        f'{s.where} {s.op}': {
          'fix': s.fix,
          'layout': format_spec(s.spec),
          'operands': list(s.operands),
          'reason': s.reason,
          'count': s.count,
        }
        for s in self.sites
      },  # fmt: skip
      'notes': [f'{n.kind}: {n.where}: {n.what}' for n in self.notes],
      'compiles': self.compiles,
      'costs_more': self.costs_more(),
    }


def _text(r: ExplicitAudit) -> str:
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
