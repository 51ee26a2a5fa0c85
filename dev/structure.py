"""The package's structure in figures, read from its source (nothing is run).

Prints what the development notes (dev/README.md) track: the entries at the
top of ``_capacity/``, imports of ``_capacity`` from ``_hosts``, import
circles (``TYPE_CHECKING`` imports included), modules over 500 lines and
functions over 80 (their docstrings left out), and module names used twice in
the package.

  python dev/structure.py            # this checkout
  python dev/structure.py --root DIR  # another checkout (an older commit's)
"""

from __future__ import annotations

import argparse
import ast
import collections
import pathlib

MODULE_LINES, FUNCTION_LINES = 500, 80


def modules(package: pathlib.Path) -> dict[str, pathlib.Path]:
  out = {}
  for path in sorted(package.rglob('*.py')):
    parts = path.relative_to(package.parent).with_suffix('').parts
    if parts[-1] == '__init__':
      parts = parts[:-1]
    out['.'.join(parts)] = path
  return out


def imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
  """The package's modules ``name`` imports, anywhere in the file."""
  found = set()
  package = name if path.name == '__init__.py' else name.rpartition('.')[0]
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:
        up = package.split('.')[: len(package.split('.')) - node.level + 1]
        base = '.'.join([*up, base] if base else up)
      for alias in node.names:
        sub = f'{base}.{alias.name}'
        found.add(sub if sub in known else base)
    elif isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
  return {m for m in found if m in known and m != name}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected groups of more than one module (Tarjan)."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on: set[str] = set()
  out: list[list[str]] = []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      group = []
      while True:
        w = stack.pop()
        on.discard(w)
        group.append(w)
        if w == v:
          break
      if len(group) > 1:
        out.append(sorted(group))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def long_functions(path: pathlib.Path) -> list[tuple[str, int]]:
  out = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      lines = (node.end_lineno or node.lineno) - node.lineno + 1
      doc = node.body[0] if node.body else None
      if (
        isinstance(doc, ast.Expr)
        and isinstance(doc.value, ast.Constant)
        and isinstance(doc.value.value, str)
      ):  # the docstring is documentation, not the function's work
        lines -= (doc.end_lineno or doc.lineno) - doc.lineno + 1
      if lines > FUNCTION_LINES:
        out.append((node.name, lines))
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--root', default=str(pathlib.Path(__file__).parents[1]))
  package = pathlib.Path(parser.parse_args().root) / 'flax_shardmeta'
  found = modules(package)
  graph = {n: imports(n, p, set(found)) for n, p in found.items()}
  capacity = package / '_capacity'
  entries = sorted(
    p.name
    for p in capacity.iterdir()
    if p.name != '__pycache__' and not p.name.startswith('.')
  )
  hosts_in = sorted(
    f'{n} -> {m}'
    for n, targets in graph.items()
    if n.startswith('flax_shardmeta._hosts')
    for m in targets
    if m.startswith('flax_shardmeta._capacity')
  )
  big = sorted(
    (len(p.read_text().splitlines()), n)
    for n, p in found.items()
    if len(p.read_text().splitlines()) > MODULE_LINES
  )
  functions = sorted(
    (lines, f'{n}.{f}') for n, p in found.items() for f, lines in long_functions(p)
  )
  names = collections.Counter(
    n.rsplit('.', 1)[-1] for n, p in found.items() if p.name != '__init__.py'
  )
  print(f'_capacity/ top-level entries: {len(entries)} ({", ".join(entries)})')
  print(f'imports of _capacity from _hosts: {len(hosts_in)}', *hosts_in, sep='\n  ')
  loops = circles(graph)
  print(f'import circles: {len(loops)}', *(' <-> '.join(c) for c in loops), sep='\n  ')
  print(
    f'modules over {MODULE_LINES} lines: {len(big)}',
    *(f'{n} ({k})' for k, n in big),
    sep='\n  ',
  )
  print(
    f'functions over {FUNCTION_LINES} lines: {len(functions)}',
    *(f'{n} ({k})' for k, n in functions),
    sep='\n  ',
  )
  twice = sorted(n for n, k in names.items() if k > 1)
  print(f'module names used twice: {len(twice)} ({", ".join(twice)})')


if __name__ == '__main__':
  main()
