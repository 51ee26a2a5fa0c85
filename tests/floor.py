"""Which stack the tests run on: the floor (``.ci/floor.txt``) or another.

Outputs quoted by the pages and saved in the notebooks are what the floor
prints; another jax compiles other figures and words some warnings otherwise.
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def floor_jax() -> str:
  """The jax version the floor pins (``.ci/floor.txt``)."""
  pins = (ROOT / '.ci' / 'floor.txt').read_text()
  found = re.search(r'^jax==(\S+)$', pins, re.MULTILINE)
  assert found, 'no jax pin in .ci/floor.txt'
  return found.group(1)


ON_THE_FLOOR = importlib.metadata.version('jax') == floor_jax()
"""Whether this is the floor's jax: quoted and saved outputs are checked here."""
