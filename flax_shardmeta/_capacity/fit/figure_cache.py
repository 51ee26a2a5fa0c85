"""A disk cache of compiled programs' figures, keyed by the program itself.

Compiling a training step for a pod takes tens of seconds to minutes; its
memory and cost figures are a few hundred bytes, its optimised HLO text a few
hundred kilobytes gzipped (kept so that collectives and loops are always read
by the current code). ``fit`` keys them by a hash
of the lowered program text (which holds the shapes, the shardings and the
mesh's device assignment), the devices' kinds and coordinates, and the jax
and libtpu versions, so a figure is reused only for the very same program on
the very same target. The text is read without its source locations
(``source_map``): the same program from another script is the same entry,
and its HLO's lines are moved to that script's when read.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import json
import os
import pathlib
import tempfile
from typing import Any

import numpy as np

_MEMORY: dict[str, dict[str, Any]] = {}
_TEXT: dict[str, str] = {}


def directory() -> pathlib.Path:
  """``$FLAX_SHARDMETA_CACHE``, else ``$XDG_CACHE_HOME/flax_shardmeta/fit``,
  else ``~/.cache/flax_shardmeta/fit``."""
  explicit = os.environ.get('FLAX_SHARDMETA_CACHE')
  if explicit:
    return pathlib.Path(explicit)
  base = os.environ.get('XDG_CACHE_HOME') or str(pathlib.Path.home() / '.cache')
  return pathlib.Path(base) / 'flax_shardmeta' / 'fit'


def _version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return '-'


def key(program_text: str, devices: Any, extra: str = '') -> str:
  """The cache key of a lowered program on a device grid."""
  flat = list(np.asarray(devices).flat)
  where = [
    (
      getattr(d, 'device_kind', ''),
      getattr(d, 'id', 0),
      tuple(getattr(d, 'coords', ()) or ()),
      getattr(d, 'slice_index', 0),
    )
    for d in flat
  ]
  h = hashlib.sha256()
  for part in (
    program_text,
    repr(where),
    _version('jax'),
    _version('jaxlib'),
    _version('libtpu'),
    extra,
  ):
    h.update(part.encode())
    h.update(b'\0')
  return h.hexdigest()


def load(k: str, on_disk: bool) -> dict[str, Any] | None:
  """The figures stored under ``k``, or None."""
  if k in _MEMORY:
    return _MEMORY[k]
  if not on_disk:
    return None
  path = directory() / f'{k}.json'
  try:
    value = json.loads(path.read_text())
  except (OSError, ValueError):
    return None
  _MEMORY[k] = value
  return value


def store(k: str, value: dict[str, Any], on_disk: bool) -> None:
  """Keeps ``value`` in memory and, with ``on_disk``, in the cache directory."""
  _MEMORY[k] = value
  if on_disk:
    _write(f'{k}.json', json.dumps(value).encode())


def store_text(k: str, text: str, on_disk: bool) -> None:
  """Keeps a compiled program's HLO text under ``k`` (gzipped on disk)."""
  _TEXT[k] = text
  if on_disk:
    _write(f'{k}.hlo.gz', gzip.compress(text.encode(), compresslevel=6))


def _write(name: str, data: bytes) -> None:
  """Writes ``data`` to the cache directory's ``name`` through a temporary
  file renamed into place, so concurrent runs never read a half-written
  entry."""
  folder = directory()
  try:
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix='.tmp')
    with os.fdopen(fd, 'wb') as f:
      f.write(data)
    os.replace(tmp, folder / name)
  except OSError:
    pass  # a read-only home is no reason to fail the analysis


def load_text(k: str, on_disk: bool) -> str | None:
  """The HLO text stored under ``k``, or None."""
  if k in _TEXT:
    return _TEXT[k]
  if not on_disk:
    return None
  try:
    text = gzip.decompress((directory() / f'{k}.hlo.gz').read_bytes()).decode()
  except (OSError, EOFError, gzip.BadGzipFile):
    return None
  _TEXT[k] = text
  return text


def forget(k: str) -> None:
  """Drops ``k`` from memory and disk."""
  _MEMORY.pop(k, None)
  _TEXT.pop(k, None)
  for suffix in ('.json', '.hlo.gz'):
    try:
      (directory() / f'{k}{suffix}').unlink()
    except OSError:
      pass


def clear() -> None:
  """Forgets the in-memory entries (the files stay)."""
  _MEMORY.clear()
  _TEXT.clear()
