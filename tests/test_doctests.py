"""Runs the docstring examples of every flax_shardmeta module as doctests."""

import doctest
import importlib
import pkgutil

import pytest

import flax_shardmeta

# Adapters other modules build on top of the core are collected too, so a new
# module's examples are checked as soon as it exists.
MODULES = sorted(
  m.name
  for m in pkgutil.walk_packages(flax_shardmeta.__path__, prefix='flax_shardmeta.')
  if m.name != 'flax_shardmeta.__main__'
)


def test_every_core_module_is_collected():
  for name in ('_rules', '_boxes', '_sharding', '_constraints', '_regex_rules'):
    assert f'flax_shardmeta.{name}' in MODULES


@pytest.mark.parametrize('module_name', ['flax_shardmeta', *MODULES])
def test_docstring_examples(module_name):
  module = importlib.import_module(module_name)
  result = doctest.testmod(
    module,
    optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
    report=True,
    verbose=False,
  )
  assert result.failed == 0, f'{result.failed} doctest failure(s) in {module_name}'
