"""Refusals as the user reads them: one site per line of their code and fix.

A site is where the user edits: their own ``file:line`` (never a library
frame), the operation, its operands' layouts, jax's reason, and the fix: the
whole statement to write in place of the lines ``replaces`` names, with
every refused call in it fixed (``rewrite``): ``out_sharding=P(...)`` added
to a call that takes one, a Linen layer made with a ``dot_general`` that has
one (at the line making the layer), the expression under
``jax.sharding.auto_axes`` with its operands passed in, or a ``reshard`` of a
loop's initial carry. Where the code cannot be read, the fix is said in
words. The forward operation and the ones autodiff made of it (named
``transpose`` in jax's name stack) share one site.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from jax.sharding import PartitionSpec

from flax_shardmeta._audit.intercept import Refused
from flax_shardmeta._audit.rewrite import (
  Edit,
  edit_of,
  fixed_statement,
  imports_needed,
)
from flax_shardmeta._frames import import_path
from flax_shardmeta._specs import format_spec

# What jax calls a primitive, in the words of the jnp/lax call that made it.
_OP_NAMES = {
  'dot_general': 'contraction (dot_general)',
  'select_n': 'jnp.where (select_n)',
  'jnp.getitem': 'indexing x[i] (jnp.getitem)',
}


@dataclasses.dataclass(frozen=True)
class Site:
  """One place in the user's code that Explicit axes refuse.

  Attributes:
    where: the user's ``file:line`` ('?' when no frame of theirs is known).
    op: the operation (jax's primitive).
    operands: the operands' layouts, as jax prints them (``f32[8@data,16]``).
    reason: jax's reason, one line.
    spec: the layout that keeps today's: XLA's under Auto where known.
    how: the fix's kind: ``'out_sharding'``, ``'sharding'``, ``'auto_axes'``,
      ``'reshard'``.
    fix: the code that replaces the lines ``replaces`` of ``where``'s file
      (the whole statement, unindented); in words when ``replaces`` is None.
    count: operations refused there (the backward pass's included).
    backward: whether some of them are autodiff's.
    from_auto: whether ``spec`` is the layout XLA gives the value under Auto.
    value_bytes: bytes of the refused results.
    gradient_only: the forward operation types; only its gradient is refused.
    replaces: the (first, last) lines the fix replaces: the statement holding
      ``where``, or the one making the Linen layer called there.
    imports: imports the fix needs that its file does not make.
  """

  where: str
  op: str
  operands: tuple[str, ...]
  reason: str
  spec: PartitionSpec
  how: str
  fix: str
  count: int
  backward: bool
  from_auto: bool
  value_bytes: int
  gradient_only: bool = False
  replaces: tuple[int, int] | None = None
  imports: tuple[str, ...] = ()

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form."""
    d = dataclasses.asdict(self)
    d['spec'] = format_spec(self.spec)
    d['operands'] = list(self.operands)
    d['replaces'] = None if self.replaces is None else list(self.replaces)
    d['imports'] = list(self.imports)
    return d

  def fix_lines(self) -> list[str]:
    """The fix as the report prints it: which lines it replaces, the code,
    and the imports it needs."""
    if self.replaces is None:
      return [f'fix: {self.fix}']
    first, last = self.replaces
    lines = f'line {first}' if first == last else f'lines {first}-{last}'
    line = int(self.where.rsplit(':', 1)[1])
    made = '' if first <= line <= last else ' (where the layer called here is made)'
    out = [f'fix, replacing {lines}{made}: {self.fix}']
    if self.imports:
      out.append(f'fix needs: {"; ".join(self.imports)}')
    return out


def sites(refused: Iterable[Refused]) -> list[Site]:
  """Refusals grouped by line, operation and the statement fixed; largest
  value first.

  The fix is the forward operation's where there is one: written at the
  user's line, autodiff gives its gradient the layouts that go with it. All
  refused calls of one statement are fixed in its one fix.
  """
  refused = list(refused)
  forward = {_place(r) for r in refused if not r.gradient}
  edits: dict[int, Edit | None] = {}
  for r in refused:
    if not r.gradient or _place(r) not in forward:
      edits[id(r)] = _edit(r)
  statements: dict[tuple[str, tuple[int, int, int, int]], list[Edit]] = {}
  for r in refused:
    e = edits.get(id(r))
    if e is not None:
      statements.setdefault((r.key[0], e.statement), []).append(e)
  # A follower (a gradient) joins its forward operation's statement.
  target: dict[tuple[str, int, str], Any] = {}
  groups: dict[tuple[Any, ...], list[Refused]] = {}
  for r in sorted(refused, key=lambda r: r.gradient):
    if id(r) in edits:
      e = edits[id(r)]
      at = None if e is None else e.statement
      target.setdefault(_place(r), at)
    else:
      at = target.get(_place(r))
    groups.setdefault((*_place(r), at), []).append(r)
  out = [_site(rs, at, statements) for (*_, at), rs in groups.items()]
  return sorted(out, key=lambda s: (-s.value_bytes, s.where))


def _place(r: Refused) -> tuple[str, int, str]:
  return (r.key[0], r.key[1], r.op)


def _edit(r: Refused) -> Edit | None:
  if r.key[0] == '?':
    return None
  edit = edit_of(
    r.key[0], r.position, r.how, format_spec(r.spec), r.layer, r.op, len(r.operands)
  )
  if edit is None or edit.kind != 'auto_axes':
    return edit
  if r.layer is not None:
    return None  # a flax layer's call under auto_axes: said in words
  # auto_axes wraps the user's expression: its layout is that of the value
  # the expression makes, which a library call's (optax's, a flax layer's)
  # need not share with the operation refused inside it.
  if r.value_spec is not None:
    return dataclasses.replace(edit, spec=format_spec(r.value_spec))
  return None if r.inner is not None else edit


def _site(
  rs: Sequence[Refused], at: Any,
  statements: dict[tuple[str, tuple[int, int, int, int]], list[Edit]],
) -> Site:  # fmt: skip
  first = next((r for r in rs if not r.gradient), rs[0])
  file, line = first.key[0], first.key[1]
  where = f'{import_path(file)}:{line}' if file != '?' else '?'
  replaces, imports = None, ()
  if at is not None:
    fix = fixed_statement(file, at, statements[(file, at)])
    replaces, imports = (at[0], at[1]), imports_needed(file, fix)
  else:
    fix = in_words(first.op, first.how, first.spec, first.layer, first.inner)
  return Site(
    where, first.op, first.operands, first.reason, first.spec, first.how, fix,
    len(rs), any(r.gradient for r in rs), first.from_auto,
    sum(r.value_bytes for r in rs), all(r.gradient for r in rs), replaces, imports,
  )  # fmt: skip


def in_words(
  op: str, how: str, spec: PartitionSpec, layer: str | None = None,
  inner: str | None = None,
) -> str:  # fmt: skip
  """The fix said in words, where the refused call cannot be found in the
  code (no source, or a call spread where it cannot be told apart).

  Example:
    >>> from jax.sharding import PartitionSpec as P
    >>> in_words('dot_general', 'out_sharding', P('data'))
    "give the contraction (dot_general) on this line out_sharding=P('data')"
  """
  text = format_spec(spec)
  if how == 'reshard':
    return (
      "start the loop's carry with the layout its body gives it: "
      f'jax.lax.scan(f, jax.sharding.reshard(init, {text}), xs)'
    )
  if layer is not None and layer in ('linen.Dense', 'linen.DenseGeneral'):
    value = f'functools.partial(jax.lax.dot_general, out_sharding={text})'
    name = layer.split('.', 1)[1]
    return f'where the {name} is made: nn.{name}(..., dot_general={value})'
  what = _OP_NAMES.get(op, op)
  if inner is not None and layer is not None:
    return (
      f'the {what} refused is inside {inner}, called on this line: that layer '
      f'takes no out_sharding; do its work in code of yours giving the {what} '
      f'out_sharding={text} (e.g. table.at[ids].get(out_sharding={text}) for '
      'a gather)'
    )
  if inner is not None and how == 'auto_axes':
    # The layout known is the inner operation's, not this line's value's.
    return (
      f'the {what} refused is inside {inner}, called on this line; wrap that '
      f'call in jax.sharding.auto_axes(lambda a, b: ..., out_sharding=...)(a, '
      f'b), its operands passed in as arguments, with the layout of the value '
      f'the call returns (the {what} inside gives its result {text})'
    )
  if how in ('out_sharding', 'sharding') and not (layer or '').startswith('nnx.'):
    return f'give the {what} on this line out_sharding={text}'
  if layer is not None:
    return f'call the {layer} on this line with out_sharding={text}'
  return (
    f'wrap the {what} on this line in jax.sharding.auto_axes(lambda a, b: ..., '
    f'out_sharding={text})(a, b), its operands a, b passed in as arguments'
  )
