"""The user's statement with refused calls fixed, as code to paste in.

A refusal is found in the source by the span of the expression its user
frame was running (a call, an ``@``, a subscript): several refused calls on
one line are told apart. Each fix is an edit of that expression: an
``out_sharding`` keyword where the call takes one, ``jnp.matmul(...,
out_sharding=)`` for ``@``, ``x.at[i].get(out_sharding=)`` for ``x[i]``, a
Linen layer made with a ``dot_general`` that has one (at the line that makes
the layer), the carry ``reshard`` at a
``jax.lax.scan`` call, else the expression under ``jax.sharding.auto_axes``
with its operands passed in as arguments (a closure over Explicit arrays is
refused inside ``auto_axes``). Every edit of one statement is applied to it
together, and the whole statement is the fix.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import inspect
import keyword
import linecache
import sys
from collections.abc import Iterable
from typing import Any

Span = tuple[int, int, int, int]
"""(line, end line, column, end column) of an expression, as ``ast`` has it."""

_LINEN_CONTRACTIONS = ('Dense', 'DenseGeneral')
_COMPOUND = (
  ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.With, ast.AsyncWith,
  ast.For, ast.AsyncFor, ast.If, ast.While, ast.Try, ast.Match,
)  # fmt: skip
# What a fix names, and the import that binds it.
_IMPORTS = {
  'functools': 'import functools',
  'jax': 'import jax',
  'jnp': 'import jax.numpy as jnp',
  'P': 'from jax.sharding import PartitionSpec as P',
}


@dataclasses.dataclass(frozen=True)
class Edit:
  """One refused expression and how it is fixed.

  Attributes:
    statement: the span of the statement the fix replaces (its lines are
      ``statement[:2]``).
    target: the span of the expression edited in it.
    kind: ``'keyword'``, ``'matmul'``, ``'at_get'`` (``x[i]``), ``'dot_general'``,
      ``'reshard'`` or ``'auto_axes'``.
    spec: the layout, as code (``P('data', None)``).
    key: ``out_sharding`` or ``sharding``: the keyword a ``'keyword'`` edit adds.
  """

  statement: Span
  target: Span
  kind: str
  spec: str
  key: str = 'out_sharding'


def edit_of(
  file: str, position: Span | None, how: str, spec: str, layer: str | None,
  op: str, carries: int,
) -> Edit | None:  # fmt: skip
  """The edit that fixes the refused expression at ``position`` (None when
  the source or the expression cannot be found)."""
  tree = module(file)
  if tree is None or position is None:
    return None
  parents = _parents(tree)
  node = _node_at(tree, position)
  statement = _statement(node, parents) if node is not None else None
  if node is None or statement is None:
    return None
  lines = _span(statement)
  if how == 'reshard':
    init = _scan_init(node) if carries == 1 else None
    return None if init is None else Edit(lines, _span(init), 'reshard', spec)
  if layer is not None and layer.startswith('linen.'):
    made = _linen_constructor(node, parents)
    if made is None:
      return None
    at = _statement(made, parents)
    if at is None:
      return None
    return Edit(_span(at), _span(made), 'dot_general', spec)
  if how in ('out_sharding', 'sharding'):
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
      return Edit(lines, position, 'matmul', spec)
    layer_call = layer is not None and layer.startswith('nnx.')
    if isinstance(node, ast.Call) and (
      layer_call or op.startswith('jnp.') or _takes_out_sharding(node, tree)
    ):
      return Edit(lines, position, 'keyword', spec)
    if layer_call:
      return None
    if isinstance(node, ast.Subscript) and op == 'jnp.getitem':
      return Edit(lines, position, 'at_get', spec)  # x[i]: x.at[i].get(...)
  if isinstance(node, (ast.Call, ast.Subscript, ast.BinOp)):
    return Edit(lines, position, 'auto_axes', spec)
  return None


def fixed_statement(file: str, span: Span, edits: Iterable[Edit]) -> str:
  """The statement at ``span`` with every edit applied, as one line of code."""
  tree = module(file)
  assert tree is not None
  statement = next(
    s for s in ast.walk(tree) if isinstance(s, ast.stmt) and _span(s) == span
  )
  by_span = {e.target: e for e in edits}
  bound = _module_names(tree)
  fixed = _Fixer(by_span, bound).visit(copy.deepcopy(statement))
  return ast.unparse(fixed)


def imports_needed(file: str, code: str) -> tuple[str, ...]:
  """The imports ``code`` needs that the file's module does not make."""
  tree = module(file)
  bound = _module_names(tree) if tree is not None else frozenset()
  used = {n.id for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name)}
  return tuple(_IMPORTS[n] for n in _IMPORTS if n in used and n not in bound)


class _Fixer(ast.NodeTransformer):
  """Applies the edits, innermost expression first."""

  def __init__(self, edits: dict[Span, Edit], bound: frozenset[str]):
    self.edits = edits
    self.bound = bound

  def generic_visit(self, node: ast.AST) -> ast.AST:
    span = _span(node) if hasattr(node, 'end_col_offset') else None
    node = super().generic_visit(node)
    edit = self.edits.get(span) if span is not None else None
    if edit is None or not isinstance(node, ast.expr):
      return node
    return _expression(_apply(node, edit, self.bound))


def _apply(node: ast.expr, edit: Edit, bound: frozenset[str]) -> str:
  """The code that replaces ``node``."""
  if edit.kind == 'matmul' and isinstance(node, ast.BinOp):
    left, right = ast.unparse(node.left), ast.unparse(node.right)
    return f'jnp.matmul({left}, {right}, out_sharding={edit.spec})'
  if edit.kind == 'keyword' and isinstance(node, ast.Call):
    return _with_keyword(node, edit.key, edit.spec)
  if edit.kind == 'dot_general' and isinstance(node, ast.Call):
    value = f'functools.partial(jax.lax.dot_general, out_sharding={edit.spec})'
    return _with_keyword(node, 'dot_general', value)
  if edit.kind == 'at_get' and isinstance(node, ast.Subscript):
    value, index = ast.unparse(node.value), ast.unparse(node.slice)
    return f'{value}.at[{index}].get(out_sharding={edit.spec})'
  if edit.kind == 'reshard':
    return f'jax.sharding.reshard({ast.unparse(node)}, {edit.spec})'
  return _under_auto_axes(node, edit.spec, bound)


def _with_keyword(node: ast.Call, key: str, value: str) -> str:
  call = ast.Call(
    func=node.func,
    args=node.args,
    keywords=[k for k in node.keywords if k.arg != key]
    + [ast.keyword(arg=key, value=_expression(value))],
  )
  return ast.unparse(call)


def _under_auto_axes(node: ast.expr, spec: str, bound: frozenset[str]) -> str:
  """``node`` as a function of its operands, under ``auto_axes``: the
  operands go in as arguments (resharded to Auto axes by ``auto_axes``), not
  as a closure."""
  lifted: dict[str, str] = {}  # parameter -> the expression it stands for
  taken = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}

  def lift(expr: ast.expr) -> ast.expr:
    if _constant(expr):
      return expr
    text = ast.unparse(expr)
    for name, was in lifted.items():
      if was == text:
        return ast.Name(name)
    name = expr.id if isinstance(expr, ast.Name) else _name(expr)
    if (
      name is None
      or name in lifted
      or (not isinstance(expr, ast.Name) and name in taken)
    ):
      name = _fresh(taken)
    taken.add(name)
    lifted[name] = text
    return ast.Name(name)

  body: ast.expr
  if isinstance(node, ast.Call):
    func = node.func
    if isinstance(func, ast.Attribute) and _root(func) not in bound:
      func = ast.Attribute(value=lift(func.value), attr=func.attr)  # x.take(...)
    body = ast.Call(
      func=func, args=[lift(a) for a in node.args], keywords=node.keywords
    )
  elif isinstance(node, ast.Subscript):
    body = ast.Subscript(value=lift(node.value), slice=_lift_index(node.slice, lift))
  elif isinstance(node, ast.BinOp):
    body = ast.BinOp(left=lift(node.left), op=node.op, right=lift(node.right))
  else:
    body = node
  params, values = ', '.join(lifted), ', '.join(lifted.values())
  function = (
    f'lambda {params}: {ast.unparse(body)}'
    if params
    else (f'lambda: {ast.unparse(body)}')
  )
  return f'jax.sharding.auto_axes({function}, out_sharding={spec})({values})'


def _lift_index(index: ast.expr, lift: Any) -> ast.expr:
  if isinstance(index, ast.Tuple):
    return ast.Tuple(elts=[_lift_index(e, lift) for e in index.elts])
  if isinstance(index, ast.Slice):
    return index
  return lift(index)


def _name(expr: ast.expr) -> str | None:
  """A parameter name for an operand read by key (``params['table']``)."""
  if isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant):
    key = expr.slice.value
    if isinstance(key, str) and key.isidentifier() and not keyword.iskeyword(key):
      return key
  return None


def _fresh(taken: set[str]) -> str:
  n = 0
  while f'v{n}' in taken:
    n += 1
  return f'v{n}'


def _constant(expr: ast.expr) -> bool:
  if isinstance(expr, ast.Constant):
    return True
  if isinstance(expr, ast.UnaryOp):
    return _constant(expr.operand)
  if isinstance(expr, (ast.Tuple, ast.List)):
    return all(_constant(e) for e in expr.elts)
  return isinstance(expr, ast.Starred)  # *args: left as written


def _expression(code: str) -> ast.expr:
  return ast.parse(code, mode='eval').body


def _root(node: ast.expr) -> str | None:
  while isinstance(node, ast.Attribute):
    node = node.value
  return node.id if isinstance(node, ast.Name) else None


def _takes_out_sharding(call: ast.Call, tree: ast.Module) -> bool:
  """Whether the function called takes ``out_sharding`` (looked up in the
  imported modules the file names, or as a ``jax.Array`` method)."""
  func = call.func
  path: list[str] = []
  while isinstance(func, ast.Attribute):
    path.insert(0, func.attr)
    func = func.value
  if not isinstance(func, ast.Name):
    return False
  modules = _module_aliases(tree)
  if func.id in modules:
    found: Any = sys.modules.get(modules[func.id])
    for part in path:
      found = getattr(found, part, None)
  elif path:  # a method of an array: x.reshape(...)
    import jax

    found = getattr(jax.Array, path[-1], None)
  else:
    return False
  try:
    return found is not None and 'out_sharding' in inspect.signature(found).parameters
  except (TypeError, ValueError):
    return False


def _scan_init(call: ast.AST) -> ast.expr | None:
  """The ``init`` of a ``scan(f, init, xs)`` call."""
  if not isinstance(call, ast.Call) or not ast.unparse(call.func).endswith('scan'):
    return None
  for k in call.keywords:
    if k.arg == 'init':
      return k.value
  return call.args[1] if len(call.args) > 1 else None


def _linen_constructor(node: ast.AST, parents: dict[int, ast.AST]) -> ast.Call | None:
  """The ``nn.Dense(...)`` that made the layer ``node`` calls: inline
  (``nn.Dense(...)(x)``), a local name (``up = nn.Dense(...)``; ``up(x)``) or
  an attribute made in ``setup`` (``self.up = nn.Dense(...)``)."""
  if not isinstance(node, ast.Call):
    return None
  if _is_linen_layer(node.func):
    return node.func  # type: ignore[return-value]
  name = ast.unparse(node.func)
  scope: ast.AST | None = node
  kind = ast.ClassDef if name.startswith('self.') else ast.FunctionDef
  while scope is not None and not isinstance(scope, kind):
    scope = parents.get(id(scope))
  made = None
  for s in ast.walk(scope) if scope is not None else ():
    if isinstance(s, ast.Assign) and _is_linen_layer(s.value):
      if any(ast.unparse(t) == name for t in s.targets) and s.lineno <= node.lineno:
        made = s.value if made is None or s.lineno > made.lineno else made
  return made  # type: ignore[return-value]


def _is_linen_layer(node: ast.AST) -> bool:
  return isinstance(node, ast.Call) and (
    ast.unparse(node.func).rsplit('.', 1)[-1] in _LINEN_CONTRACTIONS
  )


def _node_at(tree: ast.Module, position: Span) -> ast.AST | None:
  """The innermost call, ``@`` or subscript spanning exactly ``position``."""
  found = None
  for node in ast.walk(tree):
    if (
      isinstance(node, (ast.Call, ast.BinOp, ast.Subscript)) and _span(node) == position
    ):
      found = node
  return found


def _statement(node: ast.AST, parents: dict[int, ast.AST]) -> ast.stmt | None:
  """The simple statement holding ``node`` (None in a compound one's header)."""
  at: ast.AST | None = node
  while at is not None and not isinstance(at, ast.stmt):
    at = parents.get(id(at))
  return None if at is None or isinstance(at, _COMPOUND) else at


def _span(node: Any) -> Span:
  return (node.lineno, node.end_lineno, node.col_offset, node.end_col_offset)


def module(file: str) -> ast.Module | None:
  """The file's source as it is now, parsed (None if it cannot be read)."""
  linecache.checkcache(file)  # an edited file is read again
  return _parsed(''.join(linecache.getlines(file)))


@functools.lru_cache(maxsize=64)
def _parsed(source: str) -> ast.Module | None:
  try:
    return ast.parse(source)
  except (SyntaxError, ValueError):
    return None


@functools.lru_cache(maxsize=64)
def _parents(tree: ast.Module) -> dict[int, ast.AST]:
  return {id(c): p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}


def _module_aliases(tree: ast.Module) -> dict[str, str]:
  """Names the module binds to imported modules: ``{'jnp': 'jax.numpy'}``."""
  out = {}
  for node in tree.body:
    if isinstance(node, ast.Import):
      for a in node.names:
        out[a.asname or a.name.split('.')[0]] = (
          a.name if a.asname else a.name.split('.')[0]
        )
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      for a in node.names:
        full = f'{node.module}.{a.name}'
        if full in sys.modules:
          out[a.asname or a.name] = full
  return out


def _module_names(tree: ast.Module) -> frozenset[str]:
  """Names bound at the module's top level (imports, definitions)."""
  out: set[str] = set()
  for node in tree.body:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      out |= {(a.asname or a.name.split('.')[0]) for a in node.names}
    elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
      out.add(node.name)
    elif isinstance(node, ast.Assign):
      out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
  return frozenset(out)
