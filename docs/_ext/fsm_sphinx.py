"""Sphinx directives that write the reference pages from the code at build time.

Each directive writes reStructuredText (docstrings are reStructuredText) and
parses it in place, so the pages use them inside ``{eval-rst}`` blocks::

  ```{eval-rst}
  .. fsm-api-table:: flax_shardmeta
  ```

- ``fsm-api-table MODULE``: every name of ``MODULE.__all__`` with the first
  paragraph of its docstring, each linked to its entry;
- ``fsm-api-entries MODULE``: the module's docstring and an autodoc entry per
  name of its ``__all__`` (submodules are left to their own section);
- ``fsm-module-layers``: the layers of ``tests/test_layers.py``, each module
  with the first paragraph of its docstring;
- ``fsm-module-packages``: each package's ``__init__`` docstring.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

import fsm_reference as ref
from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

ROLES = {
  'module': 'py:mod',
  'exception': 'py:exc',
  'class': 'py:class',
  'function': 'py:func',
  'data': 'py:data',
}
AUTODOC = {
  'exception': 'autoexception',
  'class': 'autoclass',
  'function': 'autofunction',
}
# A value shown beside a constant's name only when it reads at a glance.
SHORT_VALUE = 60


def _indented(text: str, by: str = '   ') -> list[str]:
  return [f'{by}{line}' if line.strip() else '' for line in text.splitlines()]


def _plain(text: str) -> str:
  """``text`` as reStructuredText that shows it literally (comments are plain)."""
  return re.sub(r'([\\`*_|])', r'\\\1', text)


class _Generated(SphinxDirective):
  """Parses the reStructuredText ``lines()`` writes where the directive is."""

  def lines(self) -> list[str]:
    raise NotImplementedError

  def run(self) -> list[nodes.Node]:
    # The page is rebuilt when any module (or the layers it reads) changes.
    for path in [*ref.PACKAGE.rglob('*.py'), ref.LAYERS_TEST]:
      self.env.note_dependency(str(path))
    container = nodes.container()
    content = StringList(self.lines(), source=self.get_source_info()[0])
    self.state.nested_parse(content, self.content_offset, container)
    return container.children


class ApiTable(_Generated):
  """``fsm-api-table MODULE``: the module's public names, one line each."""

  required_arguments = 1

  def lines(self) -> list[str]:
    module = self.arguments[0]
    out = [
      f'.. py:currentmodule:: {module}',
      '',
      '.. list-table::',
      '   :header-rows: 1',
      '   :widths: 30 70',
      '',
      '   * - name',
      '     - what it is',
    ]
    for row in ref.api_rows(module):
      out += [
        f'   * - :{ROLES[row.kind]}:`~{module}.{row.name}`',
        f'     - {row.summary}',
      ]
    return out


class ApiEntries(_Generated):
  """``fsm-api-entries MODULE``: its docstring, then each public name's entry."""

  required_arguments = 1

  def lines(self) -> list[str]:
    module = self.arguments[0]
    out = [f'.. automodule:: {module}', '']
    for row in ref.api_rows(module):
      if row.kind == 'module':
        continue  # documented in a section of its own
      if row.kind == 'data':
        value = repr(getattr(importlib.import_module(module), row.name))
        out += [f'.. py:data:: {row.name}', f'   :module: {module}']
        if len(value) <= SHORT_VALUE:
          out.append(f'   :value: {value}')
        out += ['', *_indented(row.doc), '']
        continue
      out.append(f'.. {AUTODOC[row.kind]}:: {module}.{row.name}')
      if row.kind != 'function':
        out.append('   :members:')
      out.append('')
    return out


class ModuleLayers(_Generated):
  """``fsm-module-layers``: each layer's modules, lowest layer first."""

  def lines(self) -> list[str]:
    out = [
      '.. list-table::',
      '   :header-rows: 1',
      '   :widths: 30 70',
      '',
      '   * - layer',
      '     - its modules, and what each holds',
    ]
    for layer in ref.layers():
      out.append(f'   * - **{layer.number}**')
      if layer.note:
        out += ['', f'       {_plain(layer.note)}']
      first = True
      for name, summary in layer.modules:
        out.append(f'     {"- -" if first else "  -"} ``{name}``: {summary}')
        first = False
    return out


class ModulePackages(_Generated):
  """``fsm-module-packages``: the package's and each subpackage's docstring."""

  def lines(self) -> list[str]:
    out = []
    for name, doc in ref.packages():
      dotted = f'flax_shardmeta.{name}' if name else 'flax_shardmeta'
      anchor = 'package-' + (name.replace('.', '-').strip('_') or 'flax-shardmeta')
      out += [f'.. rubric:: ``{dotted}``', f'   :name: {anchor}', '', doc, '']
    return out


def setup(app: Sphinx) -> dict[str, Any]:
  """Registers the directives: ``extensions = [..., 'fsm_sphinx']`` in conf.py."""
  app.add_directive('fsm-api-table', ApiTable)
  app.add_directive('fsm-api-entries', ApiEntries)
  app.add_directive('fsm-module-layers', ModuleLayers)
  app.add_directive('fsm-module-packages', ModulePackages)
  return {'version': '1', 'parallel_read_safe': True, 'parallel_write_safe': True}
