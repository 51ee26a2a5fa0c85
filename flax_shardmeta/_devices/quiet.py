"""Keeping the accelerator plugins quiet on a machine without their hardware.

libtpu (the tpu extra, to describe TPU pods) and jax's CUDA plugin (the gpu
extra, to compile for GPU clusters) both print start-up lines about the
hardware this machine lacks. Those lines say nothing about the topologies
described; they are closed off here, and only where that hardware is absent:

- libtpu takes the environment this machine is described by
  (:data:`LIBTPU_ENVIRONMENT`, each ``setdefault``: a user's own values win);
- the CUDA plugin's C++ libraries print to file descriptor 2 while they load
  and start, which no setting silences: :func:`stderr_closed` around both.

The command line starts jax with :func:`cpu_only_jax` (public as
``fsm.cpu_only_jax``), which calls both; the venvs' start-up helpers
(``dev/quiet_libtpu.pth``, ``dev/quiet_cuda.py``) call them for every script.
Nothing here imports jax at module level.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.abc
import os
import sys
from collections.abc import Iterator
from typing import Any

LIBTPU_ENVIRONMENT = {
  'TPU_SKIP_MDS_QUERY': '1',
  'TPU_ACCELERATOR_TYPE': 'v5p-8',
  'TPU_WORKER_HOSTNAMES': 'localhost',
  'TPU_WORKER_ID': '0',
  'ALLOW_MULTIPLE_LIBTPU_LOAD': '1',
}
"""What describes *this* machine to libtpu (never the topology asked for).

Without it libtpu looks for the TPU VM it runs on (cloud metadata, worker
hostnames) and prints several lines of warnings before it answers. libtpu also
takes a machine-wide lock meant for processes that drive real TPUs; compiling
ahead of time drives none, so several processes (parallel tests, a notebook
beside a command) may share it."""

CUDA_LOUD_MODULES = ('jax._src.lib', 'jax_plugins.xla_cuda12', 'jax_plugins.xla_cuda13')
"""The modules whose loading prints the CUDA plugin's C++ start-up lines."""


def on_a_tpu_vm() -> bool:
  """Whether a TPU is attached to this machine.

  Example:
    >>> isinstance(on_a_tpu_vm(), bool)
    True
  """
  return bool(glob.glob('/dev/accel*') or glob.glob('/dev/vfio/[0-9]*'))


def on_an_nvidia_machine() -> bool:
  """Whether an NVIDIA GPU is attached to this machine."""
  return bool(glob.glob('/dev/nvidia[0-9]*'))


def quiet_libtpu() -> None:
  """Describes this machine to libtpu, where no TPU is attached."""
  if not on_a_tpu_vm():
    for key, value in LIBTPU_ENVIRONMENT.items():
      os.environ.setdefault(key, value)


@contextlib.contextmanager
def stderr_closed() -> Iterator[None]:
  """File descriptor 2 to /dev/null: the messages come from C++."""
  sys.stderr.flush()
  saved = os.dup(2)
  null = os.open(os.devnull, os.O_WRONLY)
  os.dup2(null, 2)
  os.close(null)
  try:
    yield
  finally:
    os.dup2(saved, 2)
    os.close(saved)


def closed(start: Any) -> Any:
  """``start`` (a plugin's ``initialize``) run with standard error closed."""

  def initialize() -> Any:
    with stderr_closed():
      return start()

  return initialize


def quiet_cuda_plugin() -> None:
  """Where no NVIDIA GPU is attached: the CUDA plugin stays compile-only
  (``JAX_SKIP_CUDA_CONSTRAINTS_CHECK``) and its libraries load, and the
  plugin starts, with standard error closed, whoever imports them."""
  # By a marker, not the class: the venvs' start-up helper loads this file as
  # a module of its own, whose _Finder is another class.
  if on_an_nvidia_machine() or any(_is_ours(f) for f in sys.meta_path):
    return
  os.environ.setdefault('JAX_SKIP_CUDA_CONSTRAINTS_CHECK', '1')
  sys.meta_path.insert(0, _Finder())


def cpu_only_jax() -> None:
  """jax on this machine's CPU, quiet about the accelerators it lacks: what
  laying out, fitting and compiling for a pod from a laptop need.

  Off a TPU VM, ``JAX_PLATFORMS`` defaults to ``cpu`` (with libtpu installed
  jax would try a local TPU first and warn that there is none); libtpu is
  told about this machine and the CUDA plugin's start-up lines are closed off
  (:func:`quiet_libtpu`, :func:`quiet_cuda_plugin`). TPU pods and GPU clusters
  are still described to the compiler (``fsm.make_mesh(..., topology=...)``).
  Call it before jax starts; a ``JAX_PLATFORMS`` already set is kept. The
  command line starts this way.

  Example:
    >>> import os, flax_shardmeta as fsm
    >>> fsm.cpu_only_jax()
    >>> os.environ['JAX_PLATFORMS']
    'cpu'
  """
  if not on_a_tpu_vm():
    os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  quiet_libtpu()
  quiet_cuda_plugin()


class _Loader(importlib.abc.Loader):
  def __init__(self, loader: Any):
    self.loader = loader

  def create_module(self, spec: Any) -> Any:
    return self.loader.create_module(spec)

  def exec_module(self, module: Any) -> None:
    with stderr_closed():
      self.loader.exec_module(module)
    start = getattr(module, 'initialize', None)
    if module.__name__.startswith('jax_plugins.') and callable(start):
      module.initialize = closed(start)


def _is_ours(finder: Any) -> bool:
  return getattr(finder, 'fsm_quiet_cuda', False) is True


class _Finder(importlib.abc.MetaPathFinder):
  fsm_quiet_cuda = True  # what _is_ours looks for

  def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
    if name not in CUDA_LOUD_MODULES:
      return None
    for finder in sys.meta_path:
      if _is_ours(finder) or not hasattr(finder, 'find_spec'):
        continue
      spec = finder.find_spec(name, path, target)
      if spec is not None and spec.loader is not None:
        spec.loader = _Loader(spec.loader)
        return spec
    return None
