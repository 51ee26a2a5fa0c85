"""How the ``flax-shardmeta`` process starts jax: on this machine's CPU, with the
accelerator plugins' start-up lines about hardware it does not have closed off.

Nothing here imports jax at module level.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from typing import Any


def local_jax_on_cpu() -> None:
  """Off a TPU VM, jax's own backend is the CPU (unless JAX_PLATFORMS says).

  Every command runs on this machine's CPU (the demo's simulated devices) or
  compiles for a described pod. With libtpu installed (the tpu extra), jax
  would otherwise try to start a local TPU first and print several lines of
  warnings about this machine's missing TPU.
  """
  if glob.glob('/dev/accel*') or glob.glob('/dev/vfio/[0-9]*'):
    return
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')


def start_jax_quietly() -> None:
  """Imports jax with standard error closed where jax's CUDA plugin would only
  say that this machine has no GPU.

  With the gpu extra (the plugin, to compile for GPU clusters) on a machine
  without an NVIDIA GPU, importing jax and starting its first backend print
  "Could not find cuda drivers" from the plugin's C++ libraries, which no
  setting silences. The commands compile for described GPUs only, so those
  lines say nothing. No backend is started here (the demo and jax.distributed
  come first); the plugin's own start is closed off the same way. Anywhere
  else this does nothing.
  """
  if glob.glob('/dev/nvidia[0-9]*') or 'jax' in sys.modules:
    return
  plugins = [name for name in _CUDA_PLUGINS if _found(name)]
  if not plugins:
    return
  with _stderr_closed():
    import jax  # noqa: F401

    for name in plugins:
      module = importlib.import_module(name)
      setattr(module, 'initialize', _closed(module.initialize))  # noqa: B010


_CUDA_PLUGINS = ('jax_plugins.xla_cuda12', 'jax_plugins.xla_cuda13')


def _found(name: str) -> bool:
  try:
    return importlib.util.find_spec(name) is not None
  except ModuleNotFoundError:  # no jax_plugins namespace at all
    return False


def _closed(start: Any) -> Any:
  def initialize() -> Any:
    with _stderr_closed():
      return start()

  return initialize


@contextlib.contextmanager
def _stderr_closed() -> Iterator[None]:
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
