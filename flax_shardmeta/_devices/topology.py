"""Devices of a TPU pod this machine does not have, from libtpu (or of a GPU
cluster, from jax's CUDA plugin: ``gpu``), and meshes laid out over devices
(``device_mesh``).

``libtpu`` (``pip install '.[tpu]'` from a checkout`, which brings the
``jax[tpu]`` matching the installed jax) describes any TPU topology and gives
compile-only devices for it: a ``Mesh`` over them lowers and compiles a
sharded program exactly as the pod would, and XLA reports its per-chip
memory and cost, with no TPU attached.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import math
import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from flax_shardmeta._devices import chips, gpu, quiet
from flax_shardmeta._errors import MeshShapeError, TopologyError
from flax_shardmeta._programs.hosts import host_count

if TYPE_CHECKING:  # jax is imported when a mesh is made: the CLI starts light
  from jax.sharding import AxisType, Mesh

ACCEPTED_FORMS = (
  "'v4:2x2x1', 'v5e:4x4' (v5litepod), 'v5p:4x4x8', 'v6e:8x8', 'tpu7x:2x2x1'; "
  'GENERATION:SHAPE with one size per torus dimension (3 for v4, v5p and '
  "TPU7x, 2 for v5e and v6e); or Cloud TPU's accelerator types, 'v5p-8', "
  "'v5litepod-16', 'v6e-256'"
)
"""The topology names libtpu accepts, as given in errors."""

_NAME = re.compile(r'^([a-zA-Z0-9_ ]+)[=_:]([0-9x]+)(_twisted|_untwisted)?$')

TPU_GENERATIONS = tuple(c.name for c in chips.CHIPS if c.device_kind.startswith('TPU'))
"""The TPU generations fsm has figures for (``chips.CHIPS``): v4, v5e, v5p,
v6e and tpu7x, as topology names spell them."""

# What else libtpu takes as a generation (tried with libtpu 0.0.42.1's
# get_topology_desc): 'v5' for v5p, and v2 and v3, which compile without
# figures of fsm's; each also as 'TPU v5' (libtpu's own "TPU <generation>"), in
# any case. It refuses 'v5litepod', 'v6' and 'v7x' ("Invalid TPU external
# name: TPU v5litepod").
_TPU_SPELLINGS = frozenset({*TPU_GENERATIONS, 'v2', 'v3', 'v5'})
# Cloud TPU's name of a generation libtpu does not take, and the one it does
# ('v5litepod-16' is a v5e slice, as ACCEPTED_FORMS says).
_CLOUD_NAMES = {'v5litepod': 'v5e'}


# Cloud TPU's accelerator types, as its console and `gcloud` print them:
# 'v5p-8', 'v5litepod-16', 'v6e-256'. The number counts TensorCores for v4 and
# v5p (two per chip) and chips for v5e and v6e.
_ACCELERATOR = re.compile(r'^(v4|v5p|v5litepod|v5e|v6e)-(\d+)$', re.IGNORECASE)
_CORES_PER_CHIP = {'v4': 2, 'v5p': 2}
_TORUS_DIMS = {'v4': 3, 'v5p': 3, 'v5e': 2, 'v6e': 2}


def accelerator_topology(name: Any) -> str | None:
  """The topology of a Cloud TPU accelerator type (``'v5p-8'`` ->
  ``'v5p:2x2x1'``), as Cloud TPU lays its slices out; None for a name that is
  not an accelerator type.

  Raises:
    TopologyError: an accelerator type no slice has (an odd core count, or
      chips that are not a power of two).

  Example:
    >>> accelerator_topology('v5p-8'), accelerator_topology('v5litepod-16')
    ('v5p:2x2x1', 'v5e:4x4')
    >>> accelerator_topology('v6e-256'), accelerator_topology('v5p:4x4x8')
    ('v6e:16x16', None)
  """
  match = _ACCELERATOR.match(name.strip()) if isinstance(name, str) else None
  if match is None:
    return None
  given, count = match.group(1).lower(), int(match.group(2))
  generation = _CLOUD_NAMES.get(given, given)
  per_chip = _CORES_PER_CHIP.get(generation, 1)
  chips = count // per_chip
  if count % per_chip or chips < 1 or chips & (chips - 1):
    cores = ' TensorCores (two per chip)' if per_chip == 2 else ' chips'
    raise TopologyError(
      f'accelerator type {name!r}: {count}{cores} is no {given} slice; Cloud TPU '
      f'slices have a power of two of chips ({ACCEPTED_FORMS}).'
    )
  sizes = [1] * _TORUS_DIMS[generation]
  i = 0
  while chips > 1:  # doubled in turn: as even as the torus can be
    sizes[i % len(sizes)] *= 2
    chips //= 2
    i += 1
  # Smallest first, a dimension of 1 last: Cloud TPU's '2x2x1', '2x4', '4x4x8'.
  shape = sorted(s for s in sizes if s > 1) + [s for s in sizes if s == 1]
  return f'{generation}:{"x".join(map(str, shape))}'


def libtpu_available() -> bool:
  """Whether libtpu is installed (TPU topologies can be described).

  Example:
    >>> isinstance(libtpu_available(), bool)
    True
  """
  return importlib.util.find_spec('libtpu') is not None or bool(
    os.environ.get('TPU_LIBRARY_PATH')
  )


def platform_of(name: Any) -> str | None:
  """``'gpu'`` or ``'tpu'``: what the accelerator a topology name starts with
  is, read before either is asked to describe it. None for a name that is not
  ``ACCELERATOR:SHAPE`` at all (not a string, no shape), which
  :func:`topology_devices` refuses with the accepted forms.

  Raises:
    TopologyError: the accelerator is neither a GPU nor a TPU generation fsm
      knows; the message names the closest known ones and lists them all.

  Example:
    >>> platform_of('h100:4x8'), platform_of('v5p:4x4x8'), platform_of('v5p-8')
    ('gpu', 'tpu', 'tpu')
    >>> platform_of('v5p8') is None
    True
    >>> platform_of('h900:1x8')
    Traceback (most recent call last):
    ...
    flax_shardmeta._errors.TopologyError: unknown accelerator 'h900' in topology
    'h900:1x8': did you mean h100 or h200? (GPUs: a100, h100, h200, b200, custom;
    TPUs: v4, v5e, v5p, v6e, tpu7x)
    (what to do: flax-shardmeta explain TopologyError)
  """
  if gpu.is_gpu_topology(name):
    return 'gpu'
  name = accelerator_topology(name) or name
  match = _NAME.match(name.strip()) if isinstance(name, str) else None
  if match is None:
    return None
  given = match.group(1).strip()
  key = given.lower()
  if key in gpu.GPUS or key == 'custom':
    return 'gpu'  # a GPU in a form gpu.gpu_devices refuses with its own forms
  if key.removeprefix('tpu ').strip() in _TPU_SPELLINGS:
    return 'tpu'
  raise TopologyError(_unknown_accelerator(given, name))


def _unknown_accelerator(given: str, name: str) -> str:
  """One line: the accelerator given, the closest known names, all of them."""
  gpus = (*gpu.GPUS, 'custom')
  known = (*gpus, *TPU_GENERATIONS)
  key = given.lower()
  close = set(difflib.get_close_matches(key, known))
  if key in _CLOUD_NAMES:
    close.add(_CLOUD_NAMES[key])
  nearest = [k for k in known if k in close]  # in the listing's order
  listing = f'(GPUs: {", ".join(gpus)}; TPUs: {", ".join(TPU_GENERATIONS)})'
  if not nearest:
    hint = f'use one of these {listing}'
  elif len(nearest) == 1:
    hint = f'did you mean {nearest[0]}? {listing}'
  else:
    hint = f'did you mean {", ".join(nearest[:-1])} or {nearest[-1]}? {listing}'
  return f'unknown accelerator {given!r} in topology {name!r}: {hint}'


def topology_devices(
  name: str, *, num_slices: int = 1, target_config: str | None = None
) -> tuple[Any, ...]:
  """The compile-only devices of a TPU topology, e.g. ``'v5p:8x8x16'``, or of
  a GPU cluster, e.g. ``'h100:4x8'`` (see ``gpu.gpu_devices``).

  Devices are what JAX makes of a chip: one per chip for v4 (megacore), v5e,
  v5p and v6e, two per chip for TPU7x. Results are cached per name.

  Args:
    name: ``GENERATION:SHAPE``, e.g. ``'v5p:4x4x8'`` or ``'v6e:16x16'``, or a
      Cloud TPU accelerator type, ``'v5p-256'`` (:func:`accelerator_topology`).
    num_slices: slices joined over the data-centre network; each device's
      ``slice_index`` says which it belongs to.

  Returns:
    The devices, in libtpu's order.

  Raises:
    TopologyError: the accelerator the name starts with is unknown (read
      first, so that no platform is asked about it), libtpu is missing, or
      the name is not a topology it knows.

  Example:
    >>> from flax_shardmeta._devices import topology
    >>> if topology.libtpu_available():
    ...   devices = topology.topology_devices('v5p:2x2x2')
    ...   print(len(devices), devices[0].device_kind)
    ... else:
    ...   print(8, 'TPU v5')
    8 TPU v5
  """
  name = accelerator_topology(name) or name
  if platform_of(name) == 'gpu':
    if num_slices != 1:
      raise TopologyError(
        f'num_slices={num_slices} is for TPU topologies; a GPU cluster counts '
        f'its nodes in the name ({name!r}: <gpu>:<nodes>x<GPUs per node>).'
      )
    return gpu.gpu_devices(name, target_config=target_config)
  if target_config is not None:
    raise TopologyError(
      f"target_config= describes a GPU: give topology='custom:NxG' with it, not "
      f'{name!r}.'
    )
  if not isinstance(name, str) or not _NAME.match(name.strip()):
    raise TopologyError(
      f'unknown topology {name!r}: use a TPU pod, {ACCEPTED_FORMS}; or a GPU '
      f'cluster, {gpu.ACCEPTED_FORMS}.'
    )
  if not isinstance(num_slices, int) or num_slices < 1:
    raise TopologyError(f'num_slices={num_slices!r}: give a positive number.')
  if not libtpu_available():
    import jax

    raise TopologyError(
      f'TPU topology {name!r} needs libtpu, which is not installed. Install the '
      f"extra that brings it, from a checkout: pip install '.[tpu]' (jax[tpu], "
      f'matching jax {jax.__version__}).'
    )
  return _devices(name.strip(), num_slices)


@functools.lru_cache(maxsize=32)
def _devices(name: str, num_slices: int) -> tuple[Any, ...]:
  from jax.experimental import topologies

  quiet.quiet_libtpu()  # this machine described to libtpu, where no TPU is on it
  kwargs: dict[str, Any] = {}
  if num_slices > 1:
    kwargs['num_slices'] = num_slices
  if name.lower().startswith('v4'):
    kwargs['chip_config_name'] = 'megacore'  # one device per chip, as on a v4 VM
  try:
    desc = topologies.get_topology_desc(topology_name=name, platform='tpu', **kwargs)
  except Exception as e:  # libtpu's JaxRuntimeError: INVALID_ARGUMENT ...
    reason = str(e).split('\n')[0].removeprefix('INVALID_ARGUMENT: ')
    raise TopologyError(
      f'unknown TPU topology {name!r}: libtpu says "{reason}". Use '
      f'{ACCEPTED_FORMS}; or a GPU cluster, {gpu.ACCEPTED_FORMS}.'
    ) from None
  return tuple(desc.devices)


def describe(devices: Any) -> str:
  """``'v5p 4x4x8, 128 devices in 32 hosts'`` for a device list or mesh.

  Example:
    >>> import jax
    >>> describe(jax.devices()[:8])
    'cpu, 8 devices in 1 host'
  """
  flat = list(getattr(getattr(devices, 'devices', devices), 'flat', devices))
  if not flat:
    return 'no devices'
  kind = getattr(flat[0], 'device_kind', '?')
  hosts = host_count(flat)
  slices = len({getattr(d, 'slice_index', 0) or 0 for d in flat})
  where = f'{hosts} host' + ('s' if hosts > 1 else '')
  if slices > 1:
    where += f', {slices} slices'
  return f'{kind}, {len(flat)} devices in {where}'


def device_mesh(
  axis_sizes: Sequence[int],
  axis_names: Sequence[str],
  devices: Sequence[Any],
  axis_types: Sequence[AxisType],
  dcn_axis_sizes: Sequence[int] | None = None,
) -> Mesh:
  """A ``Mesh`` of exactly ``axis_sizes`` over ``devices``, neighbouring mesh
  positions on neighbouring chips; with ``dcn_axis_sizes``, each axis spans
  that many hosts (slices where the devices report several ``slice_index``
  values) and the rest of it stays inside one.

  The devices may be a TPU pod's from :func:`topology_devices` or this
  machine's. ``fsm.make_mesh`` checks its arguments and calls this.

  Args:
    axis_sizes: one size per axis; their product is ``len(devices)``.
    axis_names: one name per axis.
    devices: the devices to lay the mesh over.
    axis_types: one ``jax.sharding.AxisType`` per axis.
    dcn_axis_sizes: hosts (or slices) each axis spans; their product is the
      number of hosts, each a divisor of its axis size.

  Raises:
    MeshShapeError: the sizes do not multiply to the devices, or the
      ``dcn_axis_sizes`` do not divide them.

  Example:
    >>> import jax
    >>> from jax.sharding import AxisType
    >>> mesh = device_mesh((2, 4), ('data', 'model'), jax.devices(),
    ...                    (AxisType.Auto,) * 2)
    >>> dict(mesh.shape)
    {'data': 2, 'model': 4}
  """
  import jax
  import numpy as np
  from jax.experimental import mesh_utils
  from jax.sharding import Mesh

  sizes, names, types = tuple(axis_sizes), tuple(axis_names), tuple(axis_types)
  if math.prod(sizes) != len(devices):
    raise MeshShapeError(
      f'mesh {dict(zip(names, sizes))} needs {math.prod(sizes)} devices; '
      f'{len(devices)} given.'
    )
  if dcn_axis_sizes is None:
    try:
      return jax.make_mesh(sizes, names, axis_types=types, devices=devices)
    except NotImplementedError:
      # A TPU torus whose axes no product of mesh sizes matches (64 on
      # 4x4x8): jax refuses to split a physical axis unless asked to.
      grid = mesh_utils.create_device_mesh(
        sizes, devices, allow_split_physical_axes=True
      )
      return Mesh(np.asarray(grid), names, axis_types=types)
  dcn = tuple(dcn_axis_sizes)
  if len(dcn) != len(sizes) or any(d < 1 or s % d for s, d in zip(sizes, dcn)):
    raise MeshShapeError(
      f'dcn_axis_sizes {dcn} for mesh {dict(zip(names, sizes))}: give one '
      'positive divisor of each axis size.'
    )
  ici = tuple(s // d for s, d in zip(sizes, dcn))
  by_slice = len({getattr(d, 'slice_index', 0) for d in devices}) > 1
  grid = mesh_utils.create_hybrid_device_mesh(
    ici, dcn, devices, process_is_granule=not by_slice, allow_split_physical_axes=True
  )
  return Mesh(np.asarray(grid), names, axis_types=types)
