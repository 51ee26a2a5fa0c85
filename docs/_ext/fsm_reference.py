"""What the reference pages list, read from the code: no Sphinx needed.

The API page's table comes from each module's ``__all__`` and each name's
docstring; the module map from the layers ``tests/test_layers.py`` states and
each module's docstring (read from source: nothing is imported). The Sphinx
directives in ``fsm_sphinx`` render these rows; ``tests/test_docs.py`` checks
them against the package.

Example:
  >>> rows = api_rows('flax_shardmeta.testing')
  >>> [(row.name, row.kind) for row in rows if row.name == 'assert_snapshot']
  [('assert_snapshot', 'function')]
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pathlib
import types
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / 'flax_shardmeta'
LAYERS_TEST = ROOT / 'tests' / 'test_layers.py'

# Names with neither a docstring of their own nor an attribute docstring where
# they are assigned: the version string is the one such name.
WITHOUT_DOCSTRING = {'__version__': "The package's version, as in ``pyproject.toml``."}


@dataclasses.dataclass(frozen=True)
class ApiRow:
  """One public name of a module, as the API page lists it.

  Attributes:
    module: the module it is public in, e.g. ``'flax_shardmeta.nnx'``.
    name: its name there.
    kind: ``'module'``, ``'exception'``, ``'class'``, ``'function'`` or
      ``'data'`` (the directive and role the page documents it with).
    summary: the first paragraph of its docstring, on one line.
    doc: its whole docstring (for data, the attribute docstring).
  """

  module: str
  name: str
  kind: str
  summary: str
  doc: str


def summary(doc: str) -> str:
  """The first paragraph of a docstring, on one line.

  Example:
    >>> summary('Lays out a tree.\\n\\n  Args: ...')
    'Lays out a tree.'
  """
  return ' '.join(inspect.cleandoc(doc).split('\n\n', 1)[0].split())


def kind_of(obj: Any) -> str:
  """Which kind of entry ``obj`` gets on the API page.

  Example:
    >>> kind_of(ValueError), kind_of(len), kind_of(3)
    ('exception', 'function', 'data')
  """
  if isinstance(obj, types.ModuleType):
    return 'module'
  if inspect.isclass(obj):
    return 'exception' if issubclass(obj, BaseException) else 'class'
  if callable(obj):
    return 'function'
  return 'data'


def _module_path(module: str) -> pathlib.Path:
  parts = module.split('.')[1:]
  package = PACKAGE.joinpath(*parts)
  return package / '__init__.py' if package.is_dir() else package.with_suffix('.py')


def attribute_doc(module: str, name: str) -> str | None:
  """The docstring under ``name = ...`` where ``module`` gets ``name`` from.

  Follows ``from X import name`` (the lazy imports of ``flax_shardmeta``
  included) to the module that assigns it.

  Example:
    >>> summary(attribute_doc('flax_shardmeta', 'PARTITION_NAME'))[:30]
    'Key of ``metadata_params`` (``'
  """
  body = ast.parse(_module_path(module).read_text()).body
  for node, after in zip(body, [*body[1:], None]):
    targets = (
      node.targets
      if isinstance(node, ast.Assign)
      else [node.target]
      if isinstance(node, ast.AnnAssign)
      else []
    )
    if any(isinstance(t, ast.Name) and t.id == name for t in targets):
      if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
        return inspect.cleandoc(str(after.value.value))
      return None
  for node in ast.walk(ast.Module(body=body, type_ignores=[])):
    if isinstance(node, ast.ImportFrom) and node.module:
      for alias in node.names:
        if (alias.asname or alias.name) == name and alias.name == name:
          return attribute_doc(node.module, name)
  return None


def api_rows(module: str) -> list[ApiRow]:
  """Every name of ``module.__all__``, in that order, with its summary.

  Raises:
    LookupError: a public name with no docstring to describe it.

  Example:
    >>> [row.name for row in api_rows('flax_shardmeta.nnx')][:3]
    ['FSM_LOGICAL', 'NAME_KEYS', 'OPTIMIZER_NAMES']
  """
  mod = importlib.import_module(module)
  rows = []
  for name in mod.__all__:
    obj = getattr(mod, name)
    kind = kind_of(obj)
    if kind == 'data':
      doc = attribute_doc(module, name) or WITHOUT_DOCSTRING.get(name)
    else:
      doc = inspect.getdoc(obj)
    if not doc:
      raise LookupError(f'{module}.{name} has no docstring to describe it')
    rows.append(ApiRow(module, name, kind, summary(doc), doc))
  return rows


# The module map
# ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layer:
  """One layer of the package: its modules, lowest first, and what it is for.

  Attributes:
    number: 1 for the lowest layer.
    note: the comment above it in ``tests/test_layers.py`` ('' if none).
    modules: ``(dotted name, summary of its docstring)`` per module.
  """

  number: int
  note: str
  modules: tuple[tuple[str, str], ...]


def module_doc(name: str) -> str:
  """The docstring of module ``name`` (dotted below the package), from source.

  Example:
    >>> summary(module_doc('_errors'))
    'Errors raised by flax_shardmeta, and the problem records they carry.'
  """
  dotted = f'flax_shardmeta.{name}' if name else 'flax_shardmeta'
  doc = ast.get_docstring(ast.parse(_module_path(dotted).read_text()))
  if not doc:
    raise LookupError(f'{dotted} has no docstring')
  return doc


def layers() -> list[Layer]:
  """The layers ``tests/test_layers.py`` keeps the imports to, lowest first.

  Each layer's note is the comment written above it there.

  Example:
    >>> first = layers()[0]
    >>> first.number, first.modules[0][0]
    (1, '_typing')
  """
  source = LAYERS_TEST.read_text()
  lines = source.splitlines()
  (assign,) = [
    node
    for node in ast.parse(source).body
    if isinstance(node, ast.Assign)
    and any(isinstance(t, ast.Name) and t.id == 'LAYERS' for t in node.targets)
  ]
  assert isinstance(assign.value, ast.List)
  out = []
  for number, element in enumerate(assign.value.elts, 1):
    # The comment lines right above the layer's first line.
    note: list[str] = []
    row = element.lineno - 2
    while row >= 0 and lines[row].strip().startswith('#'):
      note.insert(0, lines[row].strip().lstrip('#').strip())
      row -= 1
    names = ast.literal_eval(element)
    modules = tuple((n, summary(module_doc(n))) for n in names)
    out.append(Layer(number, ' '.join(note), modules))
  return out


def packages() -> list[tuple[str, str]]:
  """``(dotted name, docstring)`` of the package and each subpackage, by path.

  Example:
    >>> [name for name, _ in packages()][:2]
    ['', '_audit']
  """
  found = sorted(p.parent for p in PACKAGE.rglob('__init__.py'))
  names = ['.'.join(p.relative_to(PACKAGE).parts) for p in found]
  return [(name, module_doc(name)) for name in names]


def package_modules() -> set[str]:
  """Every module of the package, dotted below it ('' for the package itself).

  Example:
    >>> {'', '_errors', '_programs.hlo_text', 'cli'} <= package_modules()
    True
  """
  out = set()
  for path in PACKAGE.rglob('*.py'):
    parts = path.relative_to(PACKAGE).with_suffix('').parts
    if parts[-1] == '__init__':
      parts = parts[:-1]
    out.add('.'.join(parts))
  return out
