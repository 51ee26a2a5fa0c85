"""Imports point one way: down the layers of the package.

Each internal module may import only modules in lower layers (at module level
or inside a function); the public ``__init__`` only re-exports. Modules under
``if TYPE_CHECKING:`` are exempt: they cost nothing at run time.
"""

import ast
import pathlib

import flax_shardmeta

PACKAGE = pathlib.Path(flax_shardmeta.__file__).parent

# Lowest first. A module may import any module of an earlier layer, or of its
# own layer when listed before it.
LAYERS = [
  ['_typing', '_specs', '_caches', '_program_memory', '_frames'],
  ['_errors'],
  ['_unmapped'],
  ['_rules'],
  ['_validate'],
  ['_placement'],
  ['_explicit'],
  ['_loops', '_windowed'],
  ['_generate'],
  ['_boxes'],
  ['_annotation'],
  ['_sharding'],
  ['_constraints', '_regex_rules'],
  # _planning: whole-layout plans and what a step costs.
  ['_planning.chips', '_planning.topology', '_planning.hlo', '_planning.cache'],
  ['_planning.explain', '_planning.format', '_planning.plan'],
  ['_planning.roofline', '_planning.fit_format', '_planning.report'],
  ['_planning.presets'],
  ['_planning.step', '_planning.estimate', '_planning.fit'],
  ['_sharded_init'],
  # _hosts: devices, processes, data and transfers.
  ['_hosts.checkpoint', '_hosts.launch', '_hosts.mesh', '_hosts.data'],
  ['_hosts.transfer', '_hosts.graph_jit', '_hosts.jit'],
  ['_suggest'],
  ['nnx'],
  [
    'examples._names',
    'examples._common',
    'examples.linen',
    'examples.nnx',
    'examples.state',
    'examples.demo',
  ],
  ['examples.train'],
  ['cli_common', 'cli_factory', 'cli_fit', 'cli_suggest', 'cli', '__main__'],
]
ORDER = {m: i for i, m in enumerate(m for layer in LAYERS for m in layer)}
PACKAGES = {'', 'examples', '_planning', '_hosts'}


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE).with_suffix('').parts
  if parts[-1] == '__init__':
    parts = parts[:-1]
  return '.'.join(parts)


def _type_checking_lines(tree: ast.AST) -> set[int]:
  lines: set[int] = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.If) and 'TYPE_CHECKING' in ast.unparse(node.test):
      for child in ast.walk(node):
        if hasattr(child, 'lineno'):
          lines.add(child.lineno)
  return lines


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
  """(line, flax_shardmeta module) for every import of the package's modules."""
  tree = ast.parse(path.read_text())
  skip = _type_checking_lines(tree)
  found = []
  for node in ast.walk(tree):
    if node.lineno in skip if hasattr(node, 'lineno') else True:
      continue
    if isinstance(node, ast.ImportFrom) and node.module:
      if node.module == 'flax_shardmeta':
        found += [(node.lineno, a.name) for a in node.names]
      elif node.module.startswith('flax_shardmeta.'):
        module = node.module.removeprefix('flax_shardmeta.')
        for a in node.names:  # `from flax_shardmeta.examples import linen`
          sub = f'{module}.{a.name}'
          found.append((node.lineno, sub if sub in ORDER else module))
    elif isinstance(node, ast.Import):
      found += [
        (node.lineno, a.name.removeprefix('flax_shardmeta.'))
        for a in node.names
        if a.name.startswith('flax_shardmeta.')
      ]
  return found


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for p in PACKAGE.rglob('*.py')}


def test_every_module_has_a_layer():
  missing = sorted(set(_modules()) - set(ORDER) - PACKAGES)
  assert not missing, f'add these modules to LAYERS: {missing}'


def test_imports_point_down_the_layers():
  wrong = []
  for name, path in _modules().items():
    if name in PACKAGES:
      continue  # package __init__ files only re-export or document
    for line, target in _imports(path):
      if target in ORDER and ORDER[target] >= ORDER[name]:
        wrong.append(f'{name}:{line} imports {target}')
  assert not wrong, 'imports against the layering:\n' + '\n'.join(wrong)


def test_the_check_sees_function_level_imports():
  # A lazy import inside a function would hide a cycle from Python itself.
  source = PACKAGE / 'cli.py'
  assert any(target == '_planning.plan' for _, target in _imports(source))
  assert any(
    target == 'examples.nnx'
    for _, target in _imports(PACKAGE / 'examples' / 'state.py')
  )


def test_subpackages_say_what_they_may_import():
  # The layer a subpackage forms is documented where its modules live.
  for sub in ('_planning', '_hosts'):
    doc = ast.get_docstring(ast.parse((PACKAGE / sub / '__init__.py').read_text()))
    assert doc and 'may import' in doc, f'{sub}/__init__.py: say what it may import'


def test_planning_never_imports_the_host_side():
  # Planning runs on abstract meshes with no processes; the host side builds on it.
  wrong = [
    f'{name}:{line} imports {target}'
    for name, path in _modules().items()
    if name.startswith('_planning.')
    for line, target in _imports(path)
    if target.startswith(('_hosts', 'nnx', 'examples', 'cli'))
  ]
  assert not wrong, '\n'.join(wrong)
