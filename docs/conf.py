"""Sphinx configuration of the documentation site: ``make docs``.

Pages are MyST markdown, the notebooks are rendered with the outputs they
are saved with (the test suite executes them and compares), and the API
reference (a page per public name, ``api/``) and module map are written from
the code at build time (``_ext/fsm_sphinx.py``). Nothing is fetched: no
intersphinx, no execution. Warnings are errors (``-W``).

Example:
  .venv/bin/sphinx-build -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import pathlib
import sys

DOCS = pathlib.Path(__file__).resolve().parent
# The package from this checkout, and the directives of this site.
sys.path[:0] = [str(DOCS.parent), str(DOCS / '_ext')]

project = 'flax_shardmeta'
author = 'flax_shardmeta authors'
copyright = '2025, flax_shardmeta authors'

extensions = [
  'myst_nb',
  'sphinx.ext.autodoc',
  'sphinx.ext.napoleon',
  'fsm_sphinx',
]

# Markdown pages and notebooks (myst_nb registers both suffixes).
exclude_patterns = ['_build', '**.ipynb_checkpoints']
# GitHub's anchors: `errors.md#shardingerror` works on GitHub and here (the
# class name in lower case, as the errors page says).
myst_heading_anchors = 3

# The notebooks keep the outputs they were saved with.
nb_execution_mode = 'off'

# Google-style docstrings; attributes as fields of their class, so the
# dataclass fields autodoc also finds are not described twice.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
autodoc_member_order = 'bysource'
autodoc_typehints = 'signature'

html_theme = 'sphinx_book_theme'
html_title = 'flax_shardmeta'
# The contents beside each page: its sections and their subsections.
html_theme_options = {'show_toc_level': 2}
