"""Keeps jax's CUDA plugin quiet where no NVIDIA GPU is attached (see README.md)."""

import glob
import importlib.abc
import os
import sys

_LOUD = ('jax._src.lib', 'jax_plugins.xla_cuda12', 'jax_plugins.xla_cuda13')


class _Silenced:
  """Standard error (the file descriptor: the messages come from C++) to
  /dev/null while the plugin's libraries load."""

  def __enter__(self):
    sys.stderr.flush()
    self.saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)

  def __exit__(self, *exc):
    os.dup2(self.saved, 2)
    os.close(self.saved)


class _Loader(importlib.abc.Loader):
  def __init__(self, loader):
    self.loader = loader

  def create_module(self, spec):
    return self.loader.create_module(spec)

  def exec_module(self, module):
    with _Silenced():
      self.loader.exec_module(module)
    start = getattr(module, 'initialize', None)
    if module.__name__.startswith('jax_plugins.') and callable(start):
      def initialize():
        with _Silenced():
          return start()
      module.initialize = initialize


class _Finder(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name not in _LOUD:
      return None
    for finder in sys.meta_path:
      if finder is self or not hasattr(finder, 'find_spec'):
        continue
      spec = finder.find_spec(name, path, target)
      if spec is not None and spec.loader is not None:
        spec.loader = _Loader(spec.loader)
        return spec
    return None


if not glob.glob('/dev/nvidia[0-9]*'):
  os.environ.setdefault('JAX_SKIP_CUDA_CONSTRAINTS_CHECK', '1')
  sys.meta_path.insert(0, _Finder())
