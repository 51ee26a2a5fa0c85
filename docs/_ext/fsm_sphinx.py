"""Sphinx directives that write the reference pages from the code at build time.

Each directive writes reStructuredText (docstrings are reStructuredText) and
parses it in place, so the pages use them inside ``{eval-rst}`` blocks::

  ```{eval-rst}
  .. fsm-api-group:: plans
  ```

- ``fsm-api-group KEY``: the names of a group of ``fsm_reference.GROUPS``,
  each linked to its own page with the first paragraph of its docstring;
- ``fsm-api-entry NAME``: one public name's entry (its page's body), e.g.
  ``fit`` or ``nnx.shard_module``; a submodule's is its docstring and names;
- ``fsm-api-table MODULE``: every name of ``MODULE.__all__``, one line each;
- ``fsm-module-layers``: the layers of ``tests/test_layers.py``, each module
  with the first paragraph of its docstring;
- ``fsm-module-packages``: each package's ``__init__`` docstring.

A page per public name, ``docs/api/flax_shardmeta.NAME.md``, is written when
the build starts (:func:`write_api_pages`), as autosummary writes its stubs:
the folder is generated, not kept in the repository.
"""

from __future__ import annotations

import importlib
import pathlib
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
    prefix = module.removeprefix('flax_shardmeta').lstrip('.')
    rows = ref.api_rows(module)
    return _names_table([f'{prefix}.{r.name}' if prefix else r.name for r in rows])


def _link(name: str) -> str:
  """A reference to public name ``name``, written as users call it."""
  row = ref.row_of(name)
  return f':{ROLES[row.kind]}:`{ref.page_title(name)} <flax_shardmeta.{name}>`'


def _names_table(names: list[str]) -> list[str]:
  """A table of public names, each linked, with its docstring's summary."""
  out = [
    '.. list-table::',
    '   :header-rows: 1',
    '   :widths: 30 70',
    '',
    '   * - name',
    '     - what it is',
  ]
  for name in names:
    out += [f'   * - {_link(name)}', f'     - {ref.row_of(name).summary}']
  return out


class ApiGroup(_Generated):
  """``fsm-api-group KEY``: a group's names, each linked to its own page."""

  required_arguments = 1

  def lines(self) -> list[str]:
    group = ref.group(self.arguments[0])
    out = _names_table(list(group.names))
    out += ['', '.. toctree::', '   :hidden:', '']
    out += [f'   /{ref.page_name(name)}' for name in group.names]
    return out


class ApiEntry(_Generated):
  """``fsm-api-entry NAME``: one public name's entry, the body of its page."""

  required_arguments = 1

  def lines(self) -> list[str]:
    name = self.arguments[0]
    row = ref.row_of(name)
    dotted = f'{row.module}.{row.name}'
    if row.kind == 'module':
      return [f'.. automodule:: {dotted}', '', f'.. fsm-api-table:: {dotted}']
    if row.kind == 'data':
      value = repr(getattr(importlib.import_module(row.module), row.name))
      out = [f'.. py:data:: {row.name}', f'   :module: {row.module}']
      if len(value) <= SHORT_VALUE:
        out.append(f'   :value: {value}')
      return [*out, '', *_indented(row.doc)]
    out = [f'.. {AUTODOC[row.kind]}:: {dotted}']
    if row.kind != 'function':
      out.append('   :members:')
    return out


def api_page(name: str) -> str:
  """The markdown of public name ``name``'s page: its title and its entry."""
  return (
    f'# `{ref.page_title(name)}`\n\n'
    '<!-- Written by docs/_ext/fsm_sphinx.py as the site builds; not kept. -->\n\n'
    f'```{{eval-rst}}\n.. fsm-api-entry:: {name}\n```\n'
  )


def write_api_pages(app: Sphinx) -> None:
  """Writes a page per public name under ``docs/api/`` (``builder-inited``).

  Pages of names no longer public are removed; a page is rewritten only when
  its text changes, so an unchanged build reads nothing again.
  """
  folder = pathlib.Path(app.srcdir) / 'api'
  folder.mkdir(exist_ok=True)
  wanted = {}
  for group in ref.GROUPS:
    for name in group.names:
      wanted[folder / f'{ref.page_name(name).split("/", 1)[1]}.md'] = api_page(name)
  for path in folder.glob('*.md'):
    if path not in wanted:
      path.unlink()
  for path, text in wanted.items():
    if not path.is_file() or path.read_text() != text:
      path.write_text(text)


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
  app.connect('builder-inited', write_api_pages)
  app.add_directive('fsm-api-group', ApiGroup)
  app.add_directive('fsm-api-entry', ApiEntry)
  app.add_directive('fsm-api-table', ApiTable)
  app.add_directive('fsm-module-layers', ModuleLayers)
  app.add_directive('fsm-module-packages', ModulePackages)
  return {'version': '1', 'parallel_read_safe': True, 'parallel_write_safe': True}
