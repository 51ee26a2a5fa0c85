"""Devices of an NVIDIA GPU cluster this machine does not have, from jax's CUDA
plugin, compile-only.

jax's CUDA PJRT plugin (``pip install '.[gpu]'`` from a checkout: ``jax[cuda12-local]``
matching the installed jax, without NVIDIA's runtime wheels) describes any GPU
from an XLA ``GpuTargetConfigProto`` in text form and gives compile-only devices
for ``nodes x GPUs per node``: a ``Mesh`` over them lowers and compiles a sharded
program as the cluster would, and XLA reports its per-GPU memory. The
descriptions of the GPUs named here are the project's own, in ``gpu_targets/``
(each figure with its source). The plugin starts only when jax's platforms are
set to ``cpu`` before the first backend is made (``JAX_PLATFORMS=cpu``), and
reads the allocator fraction from the environment as it starts, which is
checked here first (:func:`environment_fraction`).
"""

from __future__ import annotations

import functools
import importlib.resources
import importlib.util
import math
import numbers
import os
import re
from typing import Any

from flax_shardmeta._errors import MeshShapeError, TopologyError
from flax_shardmeta._programs.hosts import devices_per_host, host_count

GPUS = {
  'a100': 'A100 SXM4 80 GB',
  'h100': 'H100 SXM5 80 GB',
  'h200': 'H200 SXM 141 GB',
  'b200': 'B200 (HGX) 180 GB',
}
"""The GPUs described by the project's own target configs, by topology name."""

ACCEPTED_FORMS = (
  f"'h100:4x8' (<gpu>:<nodes>x<GPUs per node>, <gpu> one of {', '.join(GPUS)}), "
  "or 'custom:2x8' with target_config= (a GpuTargetConfigProto file or text)"
)
"""The GPU topology names accepted, as given in errors."""

_NAME = re.compile(r'^([a-z0-9]+):(\d+)x(\d+)$')
_MEMORY = re.compile(r'\bdevice_memory_size\s*:\s*(\d+)')
_KIND = re.compile(r'\bdevice_description_str\s*:\s*"([^"]*)"')
# device_kind -> memory bytes of every description devices were made from, so
# a custom GPU's verdict is judged against its own memory.
_MEMORY_OF_KIND: dict[str, int] = {}
# device_kind -> the description devices were made from, so fit can compile
# the same program for the memory a real run hands XLA (_capacity.fit.usable).
_TEXT_OF_KIND: dict[str, str] = {}
_PLUGINS = ('jax_plugins.xla_cuda12', 'jax_plugins.xla_cuda13')

FRACTION_VARIABLES = ('XLA_CLIENT_MEM_FRACTION', 'XLA_PYTHON_CLIENT_MEM_FRACTION')
"""The variables jaxlib reads for the allocator fraction, current name first
(the old one is deprecated: openxla/xla#16457)."""


def is_gpu_topology(name: Any) -> bool:
  """Whether ``name`` names a GPU cluster (``'h100:4x8'``, ``'custom:2x8'``).

  Example:
    >>> is_gpu_topology('h100:4x8'), is_gpu_topology('v5p:4x4x8')
    (True, False)
  """
  if not isinstance(name, str):
    return False
  gpu = name.strip().lower().partition(':')[0]
  return gpu in GPUS or gpu == 'custom'


def cuda_plugin_available() -> bool:
  """Whether jax's CUDA plugin is installed (GPU clusters can be described).

  Example:
    >>> isinstance(cuda_plugin_available(), bool)
    True
  """
  try:
    return any(importlib.util.find_spec(p) is not None for p in _PLUGINS)
  except ModuleNotFoundError:  # no jax_plugins namespace at all
    return False


def described_config(gpu: str) -> str:
  """The project's description of ``gpu`` (a ``GpuTargetConfigProto`` as text).

  Example:
    >>> 'device_description_str: "NVIDIA H100 80GB HBM3"' in described_config('h100')
    True
  """
  if gpu not in GPUS:
    raise TopologyError(f'unknown GPU {gpu!r}: use one of {", ".join(GPUS)}.')
  files = importlib.resources.files('flax_shardmeta._devices') / 'gpu_targets'
  return (files / f'{gpu}.txtpb').read_text()


def gpu_devices(name: str, *, target_config: str | None = None) -> tuple[Any, ...]:
  """The compile-only devices of a GPU cluster, e.g. ``'h100:4x8'``.

  Devices are ordered node by node; each device's ``process_index`` is its
  node, so a mesh whose trailing axes have at most the GPUs of a node keeps
  them inside it (NVLink) and lays the leading ones across nodes.

  Args:
    name: ``<gpu>:<nodes>x<GPUs per node>``, or ``custom:<nodes>x<GPUs>``.
    target_config: with ``custom``, an XLA ``GpuTargetConfigProto`` in text
      form, or the path of a file holding one.

  Raises:
    TopologyError: the plugin is missing or not started, the name is not
      accepted, or the description does not parse.

  Example:
    >>> from flax_shardmeta._devices import gpu
    >>> if gpu.cuda_plugin_available():
    ...   devices = gpu.gpu_devices('h100:2x8')
    ...   print(len(devices), devices[0].device_kind, devices[8].process_index)
    ... else:
    ...   print(16, 'NVIDIA H100 80GB HBM3', 1)
    16 NVIDIA H100 80GB HBM3 1
  """
  gpu, nodes, per_node = _parse(name)
  environment_fraction(TopologyError)  # jaxlib reads it as the plugin starts
  if gpu == 'custom':
    if target_config is None:
      raise TopologyError(
        f'{name!r} needs target_config=: an XLA GpuTargetConfigProto in text '
        'form or the path of a file holding one (or name a described GPU: '
        f'{", ".join(GPUS)}).'
      )
    text = _read(target_config)
  elif target_config is not None:
    raise TopologyError(
      f'{name!r} is described by the project; target_config= is for custom:NxG.'
    )
  else:
    text = described_config(gpu)
  if not cuda_plugin_available():
    import jax

    raise TopologyError(
      f"GPU topology {name!r} needs jax's CUDA plugin, which is not installed. "
      f"Install the extra that brings it, from a checkout: pip install '.[gpu]' "
      f'(jax[cuda12-local], matching jax {jax.__version__}; no NVIDIA runtime).'
    )
  return _devices(text, nodes, per_node, name)


def checked_fraction(value: Any, where: str, error: type[Exception]) -> float:
  """``value`` as an allocator fraction in (0, 1]: a number of any numeric
  type (``0.9``, ``np.float32(0.9)``) or a numeric string (``'0.9'``).

  Raises:
    error: anything else (a bool, nan, a number out of range, other text),
      naming ``where`` the value came from.

  Example:
    >>> import numpy as np
    >>> checked_fraction(np.float32(0.9), 'mem_fraction=', ValueError)
    0.9
    >>> checked_fraction(' 0.001', 'XLA_CLIENT_MEM_FRACTION', ValueError)
    0.001
  """
  number: float | None = None
  if isinstance(value, str):
    try:
      number = float(value)
    except ValueError:
      pass
  elif isinstance(value, numbers.Real) and not isinstance(value, bool):
    # A numpy scalar's shortest text is the value meant (0.9, not 0.89999998).
    number = float(str(value)) if type(value).__module__ == 'numpy' else float(value)
  if number is None or not math.isfinite(number) or not 0 < number <= 1:
    raise error(
      f'{where}{value!r}: the allocator fraction must be a number greater than '
      '0 and at most 1, e.g. 0.9.'
    )
  return number


def environment_fraction(error: type[Exception]) -> tuple[float, str] | None:
  """``(fraction, variable)`` from the environment as jaxlib reads it (an
  empty variable is unset), or None when neither variable is set.

  jaxlib refuses both variables at once, whatever their values (no value
  wins: it raises as its GPU plugin starts), and passes the one set to XLA.

  Raises:
    error: both variables set, or a value that is not a fraction in (0, 1].

  Example:
    >>> import os
    >>> os.environ['XLA_CLIENT_MEM_FRACTION'] = '0.9'
    >>> environment_fraction(ValueError)
    (0.9, 'XLA_CLIENT_MEM_FRACTION')
    >>> del os.environ['XLA_CLIENT_MEM_FRACTION']
  """
  given = [(v, os.environ[v]) for v in FRACTION_VARIABLES if os.environ.get(v)]
  if len(given) > 1:
    (new, a), (old, b) = given
    raise error(
      f'both {new}={a!r} and {old}={b!r} are set: jaxlib takes neither and '
      f'refuses to start its GPU plugin. Unset {old} (deprecated) and keep '
      f'{new}.'
    )
  if not given:
    return None
  name, text = given[0]
  return checked_fraction(text, f'{name}=', error), name


def node_local_check(sizes: Any, names: Any, devices: Any) -> None:
  """Raises unless each node's GPUs make whole runs of the mesh's trailing axes.

  Devices go node by node, so the trailing axes are inside a node as long as
  every product of them either divides the GPUs of a node (the axes stay
  inside it) or is a multiple of it (they span whole nodes). Otherwise a
  group of one axis would straddle two nodes and half of its members would
  talk over the network.

  Example:
    >>> import types
    >>> gpus = [types.SimpleNamespace(process_index=i // 6) for i in range(24)]
    >>> node_local_check((4, 6), ('data', 'model'), gpus)
    >>> node_local_check((6, 4), ('data', 'model'), gpus)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    flax_shardmeta._errors.MeshShapeError: ... 'model' groups of 4 would straddle ...
  """
  nodes, per_node = host_count(devices), devices_per_host(devices)
  product = 1
  for size, name in zip(reversed(tuple(sizes)), reversed(tuple(names))):
    product *= size
    if per_node % product and product % per_node:
      shape = dict(zip(names, sizes))
      fits = [g for g in range(per_node, 0, -1) if per_node % g == 0][:3]
      other = ', '.join(map(str, fits))
      raise MeshShapeError(
        f'mesh {shape} over {nodes} nodes of {per_node} GPUs: {name!r} groups of '
        f'{product} would straddle two nodes; give the trailing axes a product '
        f'that divides {per_node} or is a multiple of it ({other}, ...).'
      )


def _parse(name: Any) -> tuple[str, int, int]:
  match = _NAME.match(name.strip().lower()) if isinstance(name, str) else None
  if match is None or not is_gpu_topology(name):
    raise TopologyError(f'unknown GPU topology {name!r}: use {ACCEPTED_FORMS}.')
  gpu, nodes, per_node = match.group(1), int(match.group(2)), int(match.group(3))
  if nodes < 1 or per_node < 1:
    raise TopologyError(f'GPU topology {name!r}: give at least one node and one GPU.')
  return gpu, nodes, per_node


def _read(config: str) -> str:
  """A target config given as text or as a file's path."""
  if '{' not in config and os.path.exists(config):
    with open(config) as f:
      return f.read()
  if '{' not in config:
    raise TopologyError(
      f'target_config={config!r} is neither a file nor a GpuTargetConfigProto in '
      'text form (e.g. gpu_device_info { ... } device_description_str: "...").'
    )
  return config


def described_memory(devices: Any) -> int | None:
  """The memory per GPU of the description ``devices`` (a list or mesh) were
  made from, or None for devices not made here.

  Example:
    >>> described_memory([]) is None
    True
  """
  flat = getattr(getattr(devices, 'devices', devices), 'flat', devices)
  first = next(iter(flat), None)
  return _MEMORY_OF_KIND.get(getattr(first, 'device_kind', None) or '')


def _checked(text: str, name: str) -> str:
  """The description, with what the plugin only logs said here instead."""
  kind = _KIND.search(text)
  if kind is None or not kind.group(1):
    raise TopologyError(
      f'GPU topology {name!r}: the target config has no device_description_str '
      '(the device kind jax reports, e.g. "NVIDIA H100 80GB HBM3"); add one as '
      'a top-level field.'
    )
  if _MEMORY.search(text) is None:
    raise TopologyError(
      f'GPU topology {name!r}: the target config has no '
      'gpu_device_info { device_memory_size: BYTES }; XLA plans memory with it '
      'and fit judges against it.'
    )
  return text


@functools.lru_cache(maxsize=16)
def _devices(text: str, nodes: int, per_node: int, name: str) -> tuple[Any, ...]:
  import jax
  from jax.experimental import topologies

  text = _checked(text, name)
  try:
    desc = topologies.get_topology_desc(
      platform='cuda', target_config=text, topology=f'{nodes}x1x{per_node}'
    )
  except NotImplementedError:
    raise TopologyError(
      f'GPU topology {name!r}: jax started its backends before the CUDA plugin '
      'could be registered compile-only (without a GPU its start-up check '
      'fails). In a new process, set JAX_PLATFORMS=cpu or '
      'JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 before importing jax, or call '
      "jax.config.update('jax_platforms', 'cpu') before jax's first operation; "
      f'the flax-shardmeta command does this itself (jax {jax.__version__}).'
    ) from None
  except Exception as e:  # the plugin's XlaRuntimeError: INVALID_ARGUMENT ...
    reason = str(e).split('\n')[0]
    raise TopologyError(
      f'GPU topology {name!r}: the CUDA plugin refused the description: '
      f'"{reason}". Check the target config against XLA\'s '
      'GpuTargetConfigProto (xla/stream_executor/device_description.proto); '
      "the fields jax's plugin accepts differ by jax version (this is jax "
      f'{jax.__version__}): the files in flax_shardmeta/_devices/gpu_targets '
      'use only those every supported version accepts.'
    ) from None
  devices = tuple(desc.devices)
  memory = _MEMORY.search(text)
  if devices and memory is not None:
    _MEMORY_OF_KIND[devices[0].device_kind] = int(memory.group(1))
  if devices:
    _TEXT_OF_KIND[devices[0].device_kind] = text
  return devices
