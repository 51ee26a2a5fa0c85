"""Refusals as the user reads them: one site per line of their code and fix.

A site is where the user edits: their own ``file:line`` (never a library
frame), the operation, its operands' layouts, jax's reason, and the code that
keeps today's layout written at that line: the line itself with
``out_sharding=P(...)`` added to its call when the operation takes one, else
the call wrapped in ``jax.sharding.auto_axes``, or a ``reshard`` of a loop
carry. The forward operation and the ones autodiff made of it (named
``transpose`` in jax's name stack) share one site.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import linecache
from collections.abc import Iterable
from typing import Any

from jax.sharding import PartitionSpec

from flax_shardmeta._audit.intercept import Refused
from flax_shardmeta._frames import import_path
from flax_shardmeta._specs import format_spec

# What jax calls a primitive, in the words of the jnp/lax call that made it.
_OP_NAMES = {
  'dot_general': 'contraction (dot_general)',
  'select_n': 'jnp.where (select_n)',
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
    fix: the code to write at that line.
    count: operations refused there (the backward pass's included).
    backward: whether some of them are autodiff's.
    from_auto: whether ``spec`` is the layout XLA gives the value under Auto.
    value_bytes: bytes of the refused results.
    gradient_only: the forward operation types; only its gradient is refused.
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

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form."""
    d = dataclasses.asdict(self)
    d['spec'] = format_spec(self.spec)
    d['operands'] = list(self.operands)
    return d


def sites(refused: Iterable[Refused]) -> list[Site]:
  """Refusals grouped by line and operation; largest value first.

  The fix is the forward operation's where there is one: written at the
  user's line, autodiff gives its gradient the layouts that go with it.
  """
  groups: dict[tuple[str, int, str], list[Refused]] = {}
  for r in refused:
    groups.setdefault((r.key[0], r.key[1], r.op), []).append(r)
  out = []
  for (file, line, op), rs in groups.items():
    first = next((r for r in rs if not r.gradient), rs[0])
    where = f'{import_path(file)}:{line}' if file != '?' else '?'
    code = statement(file, line) if file != '?' else ''
    out.append(Site(
      where, op, first.operands, first.reason, first.spec, first.how,
      fix_code(code, op, first.how, first.spec, first.layer), len(rs),
      any(r.gradient for r in rs), first.from_auto,
      sum(r.value_bytes for r in rs), all(r.gradient for r in rs),
    ))  # fmt: skip
  return sorted(out, key=lambda s: (-s.value_bytes, s.where))


def statement(file: str, line: int) -> str:
  """The source of the statement holding ``file:line`` (one line if the file
  cannot be parsed)."""
  tree = _module(file)
  best = None
  for node in ast.walk(tree) if tree is not None else ():
    if isinstance(node, ast.stmt) and node.lineno <= line <= (node.end_lineno or 0):
      if not isinstance(
        node, (ast.FunctionDef, ast.ClassDef, ast.With, ast.For, ast.If)
      ):
        if best is None or node.lineno >= best.lineno:
          best = node
  if best is not None:
    return ast.unparse(best)
  return linecache.getline(file, line).strip()


@functools.lru_cache(maxsize=64)
def _module(file: str) -> ast.Module | None:
  try:
    return ast.parse(''.join(linecache.getlines(file)))
  except (SyntaxError, ValueError):
    return None


def fix_code(
  line: str, op: str, how: str, spec: PartitionSpec, layer: str | None = None
) -> str:
  """The user's line with the fix written in, as well as it can be told.

  Example:
    >>> from jax.sharding import PartitionSpec as P
    >>> fix_code("y = jnp.einsum('bd,df->bf', x, w)", 'dot_general',
    ...          'out_sharding', P('data', 'model'))
    "y = jnp.einsum('bd,df->bf', x, w, out_sharding=P('data', 'model'))"
    >>> fix_code('y = x @ w', 'dot_general', 'out_sharding', P('data', None))
    "y = jnp.matmul(x, w, out_sharding=P('data', None))"
  """
  text = format_spec(spec)
  if how == 'reshard':
    return f'carry = jax.sharding.reshard(carry, {text})  # at the end of the loop body'
  tree = _parse(line)
  call = _outermost_call(tree) if tree is not None else None
  if how == 'out_sharding' and layer is not None and layer.startswith('linen.'):
    # A Linen layer takes the contraction it runs: give it one with the layout.
    value = f'functools.partial(jax.lax.dot_general, out_sharding={text})'
    made = _linen_layer(call)
    if made is not None and tree is not None:
      return _replace(line, tree, made, _with_keyword(made, 'dot_general', value))
    name = layer.split('.', 1)[1]
    return f'where the {name} is made: nn.{name}(..., dot_general={value})'
  if how in ('out_sharding', 'sharding') and call is not None and tree is not None:
    new = _with_keyword(call, 'out_sharding', text)
    return _replace(line, tree, call, new)
  if tree is not None and call is not None:
    wrapped = (
      f'jax.sharding.auto_axes(lambda: {ast.unparse(call)}, out_sharding={text})()'
    )
    return _replace(line, tree, call, wrapped)
  what = _OP_NAMES.get(op, op)
  if how in ('out_sharding', 'sharding'):
    return f'give the {what} on this line out_sharding={text}'
  return (
    f'wrap the {what} on this line in jax.sharding.auto_axes(..., out_sharding={text})'
  )


_LINEN_CONTRACTIONS = ('Dense', 'DenseGeneral', 'Einsum')


def _linen_layer(call: ast.AST | None) -> ast.Call | None:
  """``nn.Dense(...)`` of ``nn.Dense(...)(x)``: a Linen layer made and called."""
  if isinstance(call, ast.Call) and isinstance(call.func, ast.Call):
    name = ast.unparse(call.func.func).rsplit('.', 1)[-1]
    if name in _LINEN_CONTRACTIONS:
      return call.func
  return None


def _parse(line: str) -> ast.Module | None:
  for text in (line, line.rstrip(':') + ': pass', line.rstrip(',')):
    try:
      return ast.parse(text)
    except SyntaxError:
      continue
  return None


def _outermost_call(tree: ast.AST) -> ast.AST | None:
  """The first call (or ``@``) in source order, outermost first."""
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and not _is_fsm_or_jax_wrapper(node):
      return node
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
      return node
  return None


def _is_fsm_or_jax_wrapper(node: ast.Call) -> bool:
  name = ast.unparse(node.func)
  return name.endswith(('reshard', 'auto_axes', 'with_sharding_constraint'))


def _with_keyword(node: ast.AST, key: str, value: str) -> str:
  if isinstance(node, ast.BinOp):  # a @ b
    return (
      f'jnp.matmul({ast.unparse(node.left)}, {ast.unparse(node.right)}, {key}={value})'
    )
  assert isinstance(node, ast.Call)
  call = ast.Call(
    func=node.func,
    args=node.args,
    keywords=[k for k in node.keywords if k.arg != key]
    + [ast.keyword(arg=key, value=ast.parse(value, mode='eval').body)],
  )
  return ast.unparse(call)


def _replace(line: str, tree: ast.AST, node: ast.AST, new: str) -> str:
  old = ast.unparse(node)
  whole = ast.unparse(tree)
  return whole.replace(old, new, 1) if old in whole else new
