"""Where the user's code is: frames outside jax, flax, optax and this package.

Errors and warnings raised deep inside a library call (a Variable being made
inside ``nnx.Linear``, jax tracing an operation) name the user's line instead.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import types
import warnings

_EXAMPLES = os.sep + os.path.join('flax_shardmeta', 'examples') + os.sep


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
