"""The example models are written as a user would: on the public API only."""

import ast
import pathlib

import pytest

import flax_shardmeta as fsm
from flax_shardmeta.examples import linen, train

EXAMPLES = pathlib.Path(fsm.__file__).parent / 'examples'


def _private_uses(path: pathlib.Path) -> list[str]:
  """Every use of a private flax_shardmeta name in ``path``, as ``file:line name``.

  The examples' own modules (``examples._common``) are theirs to share; the
  rest of the package is reached through ``flax_shardmeta`` (``fsm``),
  ``fsm.nnx`` and their public names.
  """

  def private(dotted: str) -> bool:
    parts = dotted.split('.')
    if parts[0] != 'flax_shardmeta' or parts[1:2] == ['examples']:
      return False
    return any(p.startswith('_') and not p.startswith('__') for p in parts[1:])

  tree = ast.parse(path.read_text())
  aliases = set()  # names bound to flax_shardmeta or one of its public modules
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if private(a.name):
          found.append(f'{path.name}:{node.lineno} import {a.name}')
        elif a.name.split('.')[0] == 'flax_shardmeta':
          aliases.add(a.asname or a.name.split('.')[0])
    elif isinstance(node, ast.ImportFrom) and node.level:
      found.append(f'{path.name}:{node.lineno} relative import')
    elif isinstance(node, ast.ImportFrom) and node.module:
      for a in node.names:
        if private(f'{node.module}.{a.name}'):
          found.append(f'{path.name}:{node.lineno} from {node.module} import {a.name}')
        elif node.module == 'flax_shardmeta':
          aliases.add(a.asname or a.name)
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and node.attr.startswith('_'):
      if node.attr.startswith('__'):
        continue
      root = node.value
      while isinstance(root, ast.Attribute):
        root = root.value
      if isinstance(root, ast.Name) and root.id in aliases:
        found.append(f'{path.name}:{node.lineno} {ast.unparse(node)}')
  return sorted(found, key=lambda use: int(use.split(':')[1].split()[0]))


@pytest.mark.parametrize('path', sorted(EXAMPLES.glob('*.py')), ids=lambda p: p.name)
def test_examples_use_only_the_public_api(path):
  assert _private_uses(path) == []


def test_the_check_sees_private_uses(tmp_path):
  path = tmp_path / 'bad.py'
  path.write_text(
    'import flax_shardmeta as fsm\n'
    'import flax_shardmeta._rules\n'
    'from flax_shardmeta import _boxes\n'
    'from flax_shardmeta._placement import context_mesh\n'
    'from flax_shardmeta.nnx import _reading\n'
    'from flax_shardmeta.examples._common import rope\n'  # the examples' own
    'fsm._rules.explain\n'
    'fsm.nnx._reading\n'
  )
  assert [use.split(' ', 1)[0] for use in _private_uses(path)] == [
    'bad.py:2',
    'bad.py:3',
    'bad.py:4',
    'bad.py:5',
    'bad.py:7',
    'bad.py:8',
  ]


@pytest.mark.parametrize('name', ['mlp', 'llama3-8b', 'llama3-405b'])
def test_num_layers_is_the_depth_the_model_is_built_with(name):
  module, _ = linen.model(name)
  depth = module.num_layers if name == 'mlp' else module.config.num_layers
  assert train.num_layers(name) == depth
