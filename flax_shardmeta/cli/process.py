"""How the ``flax-shardmeta`` process starts jax: on this machine's CPU, with the
accelerator plugins' start-up lines about hardware it does not have closed off.

Nothing here imports jax at module level.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

from flax_shardmeta._devices import quiet


def local_jax_on_cpu() -> None:
  """Off a TPU VM, jax's own backend is the CPU (unless JAX_PLATFORMS says).

  Every command runs on this machine's CPU (the demo's simulated devices) or
  compiles for a described pod. With libtpu installed (the tpu extra), jax
  would otherwise try to start a local TPU first and print several lines of
  warnings about this machine's missing TPU.
  """
  if not quiet.on_a_tpu_vm():
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
  if quiet.on_an_nvidia_machine() or 'jax' in sys.modules:
    return
  plugins = [name for name in _CUDA_PLUGINS if _found(name)]
  if not plugins:
    return
  with quiet.stderr_closed():
    import jax  # noqa: F401

    for name in plugins:
      module = importlib.import_module(name)
      setattr(module, 'initialize', quiet.closed(module.initialize))  # noqa: B010


_CUDA_PLUGINS = ('jax_plugins.xla_cuda12', 'jax_plugins.xla_cuda13')


def _found(name: str) -> bool:
  try:
    return importlib.util.find_spec(name) is not None
  except ModuleNotFoundError:  # no jax_plugins namespace at all
    return False
