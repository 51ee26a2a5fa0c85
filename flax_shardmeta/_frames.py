"""Where the user's code is: frames outside jax, flax, optax and this package.

Errors and warnings raised deep inside a library call (a Variable being made
inside ``nnx.Linear``, jax tracing an operation) name the user's line instead.
Paths written into records that outlive the process (golden files, reports)
are named from the module's import root (``pkg/model.py``), the same on every
machine and from every working directory.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import types
import warnings
from typing import Any

_EXAMPLES = os.sep + os.path.join('flax_shardmeta', 'examples') + os.sep

# Paths of the libraries as they appear anywhere: HLO metadata may carry the
# files of another machine or install, which ``library_dirs`` cannot know.
_LIBRARY_FRAGMENTS = ('/jax/', '/jaxlib/', '/flax/', '/optax/', '/flax_shardmeta/')
_EXAMPLES_FRAGMENT = '/flax_shardmeta/examples/'

# Module file (absolute, case-normalized) -> its path under its import root;
# how many modules there were when it was made; the files found in no module
# since (looked for again only when more modules come).
_module_paths: dict[str, str] = {}
_modules_seen = -1
_missed: set[str] = set()


def package_dir(name: str) -> str | None:
  """The directory of an imported package (with a trailing separator)."""
  module = sys.modules.get(name)
  file = getattr(module, '__file__', None)
  return os.path.dirname(file) + os.sep if file else None


def jax_dirs() -> tuple[str, ...]:
  """Where jax's and jaxlib's own frames are."""
  return tuple(d for d in (package_dir('jax'), package_dir('jaxlib')) if d)


def library_dirs() -> tuple[str, ...]:
  """Where frames are not the user's: jax, flax, optax, this package, Python.

  Made at each call: a package imported later (optax) counts from then on.
  """
  dirs = [*jax_dirs(), sysconfig.get_paths()['stdlib'] + os.sep]
  dirs += [d for d in map(package_dir, ('flax', 'optax', 'flax_shardmeta')) if d]
  return tuple(dirs)


def in_dirs(file: str, dirs: tuple[str, ...]) -> bool:
  """Whether a frame of ``file`` lies in ``dirs`` (the example models of this
  package count as user code)."""
  if _EXAMPLES in file:
    return False
  return file.startswith(dirs) or file.startswith('<frozen')


def is_user_frame(frame: types.FrameType) -> bool:
  """Whether ``frame`` runs the user's code."""
  return not in_dirs(frame.f_code.co_filename, library_dirs())


def warn_at_user_code(message: str, category: type[Warning]) -> None:
  """``warnings.warn`` attributed to the innermost frame of the user's code, so
  Python shows the warning once per line of theirs (and message)."""
  dirs = library_dirs()
  frame: types.FrameType | None = sys._getframe(1)
  level = 2
  while frame is not None and in_dirs(frame.f_code.co_filename, dirs):
    frame = frame.f_back
    level += 1
  warnings.warn(message, category, stacklevel=level if frame is not None else 2)


def is_library_file(path: str) -> bool:
  """Whether ``path`` is a file of jax, jaxlib, flax, optax, Python's standard
  library or this package (its example models count as user code).

  Told by where those are installed here and, for paths recorded elsewhere
  (HLO metadata of another machine) or already relative to an import root,
  by the package folders in the path.

  Example:
    >>> is_library_file('/elsewhere/site-packages/flax/linen/linear.py')
    True
    >>> is_library_file('flax_shardmeta/examples/models.py')
    False
    >>> is_library_file('/home/me/project/model.py')
    False
  """
  # A leading '/' lets an import-root path (``flax/linen/linear.py``) match.
  slashed = '/' + path.replace(os.sep, '/').replace('\\', '/')
  if _EXAMPLES_FRAGMENT in slashed:
    return False
  if in_dirs(path, library_dirs()):
    return True
  return any(fragment in slashed for fragment in _LIBRARY_FRAGMENTS)


def import_path(path: str) -> str:
  """``path`` relative to its module's import root, with ``/`` on every OS.

  The module of ``sys.modules`` whose ``__file__`` it is names it: module
  ``pkg.model`` gives ``pkg/model.py``, package ``pkg`` gives
  ``pkg/__init__.py``, an installed library its package path. A file no
  module has (``__main__``, a script run by path) is named under the longest
  ``sys.path`` entry holding it, else by its base name: never absolute, never
  relative to the working directory, so a record holding it reads the same
  wherever the code is and wherever it runs from.

  Example:
    >>> import flax.linen.linear
    >>> import_path(flax.linen.linear.__file__)
    'flax/linen/linear.py'
    >>> import_path(os.path.join(os.sep, 'on', 'no', 'path', 'model.py'))
    'model.py'
  """
  if path.startswith('<'):  # '<frozen ...>', '<string>': no file to place
    return path
  key = _key(path)
  if len(sys.modules) != _modules_seen:
    _read_modules()
  named = _module_paths.get(key)
  if named is None and key not in _missed:
    # A module imported anew under an old name (from another folder, after
    # removing the first) leaves sys.modules no longer: read it again, once.
    _read_modules()
    _missed.add(key)
    named = _module_paths.get(key)
  if named is not None:
    return named
  return _under_sys_path(path) or os.path.basename(path)


def _key(path: str) -> str:
  return os.path.normcase(os.path.abspath(path))


def _read_modules() -> None:
  """Makes ``_module_paths`` again: each module file -> its path from its
  module name, where the two agree.

  ``sys.modules`` also holds aliases (``os.path`` is ``posixpath``) and
  modules loaded from a file under any name; a name whose path is not the
  file's tail says nothing about the import root, and is skipped. Of two
  names for one file (imported under two ``sys.path`` entries), the shorter
  path is kept, as the longest ``sys.path`` entry gives.
  """
  global _module_paths, _missed, _modules_seen
  out: dict[str, str] = {}
  for name, module in list(sys.modules.items()):
    file = getattr(module, '__file__', None)
    if name == '__main__' or not name or not isinstance(file, str):
      continue
    base = os.path.basename(file)
    parts = name.split('.')
    if os.path.splitext(base)[0] != '__init__':
      parts = parts[:-1]
    named = '/'.join([*parts, base])
    key = _key(file)
    tail = '/' + os.path.normcase(named).replace(os.sep, '/')
    if not key.replace(os.sep, '/').endswith(tail):
      continue
    if key not in out or (len(named), named) < (len(out[key]), out[key]):
      out[key] = named
  # New objects, not cleared ones: a thread reading meanwhile sees whole maps.
  _module_paths, _missed = out, set()
  _modules_seen = len(sys.modules)


def _under_sys_path(path: str) -> str | None:
  """``path`` under the longest ``sys.path`` entry holding it ('' is the
  current directory, as for imports); None when none does."""
  key = _key(path)
  best: str | None = None
  for entry in sys.path:
    if not isinstance(entry, str):
      continue
    root = _key(entry or os.curdir).rstrip(os.sep) + os.sep
    if key.startswith(root) and (best is None or len(root) > len(best)):
      best = root
  if best is None:
    return None
  return os.path.abspath(path)[len(best) :].replace(os.sep, '/')


NO_USER_LINE = '(no user line)'
"""Where a traced operation or compiled instruction has no frame of the user's
(only jax's, flax's, optax's or this package's): a library's line would move
with its version, and points the user nowhere useful."""


def source_line(source_info: Any) -> str:
  """The user's ``file:line`` of a traced equation (``eqn.source_info``):
  :func:`user_line` of its traceback; ``NO_USER_LINE`` when every frame is a
  library's, ``'?'`` when jax's tracebacks cannot be read."""
  try:
    from jax._src import source_info_util  # noqa: F401 (the reader user_line needs)
  except ImportError:
    return '?'
  return user_line(getattr(source_info, 'traceback', None)) or NO_USER_LINE


def user_line(traceback: Any) -> str:
  """``'pkg/model.py:22'``: :func:`user_frame` of a jax traceback, the file
  named from its import root; ``''`` when there is none.

  Example:
    >>> user_line(None)
    ''
  """
  found = user_frame(traceback)
  return f'{import_path(found[0])}:{found[1]}' if found else ''


@functools.lru_cache(maxsize=4096)
def user_frame(traceback: Any) -> tuple[str, int] | None:
  """``(file, line)`` of the innermost frame of a jax traceback that is the
  user's own code (outside jax, flax, optax and this package; the example
  models count as the user's); None when there is none.

  jax records the traceback of each traced equation but reads it only through
  its private ``source_info_util``; without it there is no frame.
  """
  if traceback is None:
    return None
  try:
    from jax._src import source_info_util

    frames = list(source_info_util.user_frames(traceback))
  except Exception:  # noqa: BLE001 - a changed private API costs only the line
    return None
  frame = next((f for f in frames if not is_library_file(f.file_name)), None)
  return None if frame is None else (frame.file_name, frame.start_line)
