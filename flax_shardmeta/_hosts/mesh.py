"""Meshes from axis sizes, laid out over hosts or over a TPU pod: ``make_mesh``.

On a pod every process (host) sees only its own devices, and traffic between
hosts (DCN) is far slower than inside one (ICI). ``dcn_axis_sizes`` says how
much of each mesh axis crosses hosts; the rest of the axis stays inside a
host, so collectives over it never leave the machine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from flax_shardmeta._devices.gpu import is_gpu_topology, node_local_check
from flax_shardmeta._devices.topology import (
  device_mesh,
  platform_of,
  topology_devices,
)
from flax_shardmeta._errors import MeshShapeError
from flax_shardmeta._programs.hosts import host_indices


def make_mesh(
  axis_sizes: Sequence[int] | Mapping[str, int],
  axis_names: Sequence[str] | None = None,
  *,
  axis_types: Sequence[AxisType] | None = None,
  devices: Sequence[Any] | None = None,
  dcn_axis_sizes: Sequence[int] | None = None,
  topology: str | None = None,
  num_slices: int = 1,
  target_config: str | None = None,
) -> Mesh:
  """A ``Mesh`` of ``axis_sizes`` over all devices of all processes, or over the
  devices of a TPU pod or GPU cluster described by ``topology``.

  Args:
    axis_sizes: one size per axis; at most one may be ``-1``, meaning "all
      the devices the other axes leave". A mapping ``{'data': -1, 'model':
      4}`` gives names and sizes at once (then leave ``axis_names`` out).
    axis_names: one name per axis.
    axis_types: one ``jax.sharding.AxisType`` per axis; None gives every
      axis ``Auto`` (``jax.make_mesh`` defaults to ``Explicit``): annotations
      place the parameters, constraints the chosen activations, and the
      compiler propagates the rest, as flax's layers are written for (on
      Explicit axes every matmul contracting a sharded dimension needs an
      ``out_sharding``: :func:`flax_shardmeta.logical_out_sharding`).
    devices: the devices to use (default: ``jax.devices()``, every process's).
    dcn_axis_sizes: how many hosts (processes; slices where devices report
      several ``slice_index`` values) each axis spans. Their product is the
      number of hosts; each axis size must be a multiple of its entry. The
      remaining factor of each axis stays inside one host.
    topology: devices you do not have, to lower and compile for (``fsm.fit``):
      a TPU pod, ``'v5p:8x8x16'`` (the ``tpu`` extra), or a GPU cluster,
      ``'h100:4x8'`` (nodes x GPUs per node; a100, h100, h200, b200, or
      ``'custom:2x8'`` with ``target_config``; the ``gpu`` extra), whose
      trailing axes stay inside a node.
    num_slices: with a TPU ``topology``, that many slices joined over the
      data-centre network; the first axis spans them unless ``dcn_axis_sizes``
      says otherwise.
    target_config: with ``'custom:NxG'``, an XLA ``GpuTargetConfigProto``
      (text, or a file's path).

  Returns:
    The mesh, with devices ordered so that each host's devices form
    contiguous blocks along the axes that span hosts, and (on a topology)
    neighbouring mesh positions are neighbouring chips.

  Raises:
    MeshShapeError: the sizes do not fit the devices or the hosts (the
      message names both counts and a factorisation that would fit); the
      names are not distinct strings; ``axis_types`` is not one ``AxisType``
      per axis.
    TopologyError: an accelerator neither a GPU nor a TPU fsm knows (read
      before either platform is asked: ``'h900:1x8'`` names the closest
      known ones, ``h100`` or ``h200``); libtpu / the CUDA plugin is missing;
      an unknown topology.

  Example:
    >>> import jax, flax_shardmeta as fsm
    >>> mesh = fsm.make_mesh((-1, 4), ('data', 'model'))
    >>> dict(mesh.shape)
    {'data': 2, 'model': 4}
    >>> dict(fsm.make_mesh({'data': 2, 'model': -1}).shape)
    {'data': 2, 'model': 4}
    >>> dict(fsm.make_mesh((2, 4), ('data', 'model'), dcn_axis_sizes=(1, 1)).shape)
    {'data': 2, 'model': 4}
  """
  axis_sizes, names = _sizes_and_names(axis_sizes, axis_names)
  devices, dcn_axis_sizes = _devices_and_dcn(
    devices, topology, num_slices, dcn_axis_sizes, len(names), target_config
  )
  if len(names) != len(axis_sizes):
    raise MeshShapeError(
      f'{len(axis_sizes)} axis sizes {tuple(axis_sizes)} for {len(names)} axis '
      f'names {names}; give one size per name.'
    )
  n_hosts = len(_hosts(devices))
  sizes = _fill_wildcard(_as_ints(axis_sizes, names), names, len(devices), n_hosts)
  # Auto unless told otherwise (jax.make_mesh's own default is Explicit): see
  # the axis_types argument above for why.
  types = _axis_types(axis_types, names)
  dcn = None
  if dcn_axis_sizes is not None:
    dcn = _as_ints(dcn_axis_sizes, names, what='dcn_axis_sizes')
    _check_dcn(sizes, dcn, names, len(devices), n_hosts)
  elif is_gpu_topology(topology):
    node_local_check(sizes, names, devices)
  return device_mesh(sizes, names, devices, types, dcn)


def _devices_and_dcn(
  devices: Sequence[Any] | None,
  topology: str | None,
  num_slices: int,
  dcn_axis_sizes: Sequence[int] | None,
  n_axes: int,
  target_config: str | None = None,
) -> tuple[list[Any], Sequence[int] | None]:
  """The devices to lay the mesh over (this machine's, a pod's or a GPU
  cluster's), and the hosts each axis spans (with slices, the first axis
  spans them by default)."""
  # The accelerator first: a GPU fsm does not know is not a TPU to ask libtpu
  # about, nor a target_config mistake.
  platform = platform_of(topology) if topology is not None else None
  if target_config is not None and platform != 'gpu':
    raise MeshShapeError(
      f"target_config= describes a GPU: give topology='custom:NxG' with it, "
      f'not {topology!r}.'
    )
  if topology is not None:
    if devices is not None:
      raise MeshShapeError('give devices= or topology=, not both.')
    devices = topology_devices(
      topology, num_slices=num_slices, target_config=target_config
    )
    if num_slices > 1 and dcn_axis_sizes is None:
      dcn_axis_sizes = (num_slices,) + (1,) * (n_axes - 1)
  elif num_slices != 1:
    raise MeshShapeError(
      f'num_slices={num_slices} needs topology=...; on real devices the slices '
      'are those the devices report (their slice_index).'
    )
  return list(jax.devices() if devices is None else devices), dcn_axis_sizes


def _sizes_and_names(
  axis_sizes: Sequence[int] | Mapping[str, int], axis_names: Sequence[str] | None
) -> tuple[Sequence[Any], tuple[str, ...]]:
  """The two accepted forms (sizes + names, or one mapping) -> sizes, names."""
  if isinstance(axis_sizes, Mapping):
    if axis_names is not None:
      raise MeshShapeError(
        f'axis sizes given as a mapping {dict(axis_sizes)} and axis_names '
        f'{tuple(axis_names)} too; the mapping already names the axes, so leave '
        'axis_names out.'
      )
    return tuple(axis_sizes.values()), _checked_names(tuple(axis_sizes))
  if axis_names is None:
    raise MeshShapeError(
      f'axis sizes {tuple(axis_sizes)} without axis_names; pass the names, e.g. '
      "make_mesh((2, 4), ('data', 'model')), or a mapping {'data': 2, 'model': 4}."
    )
  if isinstance(axis_names, str):
    raise MeshShapeError(
      f'axis_names={axis_names!r} is one string; give a tuple of names, e.g. '
      f'({axis_names!r},).'
    )
  if isinstance(axis_sizes, str):
    raise MeshShapeError(
      f'axis sizes {axis_sizes!r} are one string; give a tuple of integers, '
      'e.g. (2, 4).'
    )
  return axis_sizes, _checked_names(tuple(axis_names))


def _checked_names(names: tuple[Any, ...]) -> tuple[str, ...]:
  """Axis names are distinct, non-empty strings: rules and specs name the
  axes by them, and jax would take a repeated name until a spec uses it."""
  for name in names:
    if not isinstance(name, str) or not name:
      raise MeshShapeError(
        f'axis names {names}: {name!r} is no name; each axis is named by a '
        "non-empty string, e.g. ('data', 'model')."
      )
  twice = sorted({n for n in names if names.count(n) > 1})
  if twice:
    raise MeshShapeError(
      f'axis names {names} name {twice[0]!r} twice; give each axis its own name.'
    )
  return names


def _axis_types(
  axis_types: Sequence[AxisType] | AxisType | None, names: tuple[str, ...]
) -> tuple[AxisType, ...]:
  """One ``AxisType`` per axis, checked here rather than in jax's Mesh."""
  if axis_types is None:
    return (AxisType.Auto,) * len(names)
  example = f'(AxisType.Explicit,) * {len(names)}'
  if isinstance(axis_types, (AxisType, str)):
    raise MeshShapeError(
      f'axis_types={axis_types!r} is one value; give one jax.sharding.AxisType '
      f'per axis of {names}, e.g. axis_types={example}.'
    )
  types = tuple(axis_types)
  bad = [t for t in types if not isinstance(t, AxisType)]
  if bad or len(types) != len(names):
    what = f'{bad[0]!r} is no jax.sharding.AxisType' if bad else 'not one per axis'
    raise MeshShapeError(
      f'axis_types={types} for axes {names}: {what}; give one '
      f'jax.sharding.AxisType (Auto, Explicit or Manual) per axis, e.g. '
      f'axis_types={example}.'
    )
  return types


def _as_ints(
  sizes: Sequence[Any], names: tuple[str, ...], what: str = 'axis sizes'
) -> tuple[int, ...]:
  out = []
  for i, size in enumerate(sizes):
    name = names[i] if i < len(names) else f'#{i}'
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
      raise MeshShapeError(
        f'{what} {tuple(sizes)} for {names}: the size of {name!r} is {size!r}; '
        'sizes are integers (-1 for "the devices the other axes leave").'
      )
    out.append(int(size))
  return tuple(out)


def _hosts(devices: Sequence[Any]) -> list[Any]:
  """The granules devices group into: slices if several, else processes."""
  slices = {getattr(d, 'slice_index', 0) for d in devices}
  if len(slices) > 1:
    return sorted(slices)
  return host_indices(devices)


def _fill_wildcard(
  sizes: tuple[int, ...], names: tuple[str, ...], n_devices: int, n_hosts: int
) -> tuple[int, ...]:
  wild = [i for i, s in enumerate(sizes) if s == -1]
  if len(wild) > 1 or any(s == 0 or s < -1 for s in sizes):
    raise MeshShapeError(
      f'axis sizes {sizes} for {names}: sizes must be positive, with at most '
      'one -1 (all the devices the other axes leave).'
    )
  known = math.prod(s for s in sizes if s != -1)
  if wild:
    if n_devices % known:
      raise MeshShapeError(_misfit(sizes, names, n_devices, n_hosts))
    sizes = tuple(n_devices // known if s == -1 else s for s in sizes)
  if math.prod(sizes) != n_devices:
    raise MeshShapeError(_misfit(sizes, names, n_devices, n_hosts))
  return sizes


def _check_dcn(
  sizes: tuple[int, ...],
  dcn: tuple[int, ...],
  names: tuple[str, ...],
  n_devices: int,
  n_hosts: int,
) -> None:
  """Refuses ``dcn`` sizes that do not fit the axes and the hosts."""
  if len(dcn) != len(sizes) or any(d < 1 for d in dcn):
    raise MeshShapeError(
      f'dcn_axis_sizes {dcn} for axes {names}: give one positive entry per '
      'axis (1 for an axis that stays inside each host).'
    )
  bad = [n for n, s, d in zip(names, sizes, dcn) if s % d]
  if math.prod(dcn) != n_hosts or bad:
    why = (
      f'axes {bad} are not multiples of their dcn sizes'
      if bad
      else f'their product is {math.prod(dcn)}, not the {n_hosts} hosts'
    )
    raise MeshShapeError(
      f'dcn_axis_sizes {dcn} do not fit mesh {dict(zip(names, sizes))}: {why}. '
      f'{n_devices} devices in {n_hosts} host(s), {n_devices // n_hosts} each; '
      f'e.g. dcn_axis_sizes={_suggest_dcn(sizes, n_hosts)} would fit.'
    )


def _suggest_dcn(sizes: tuple[int, ...], n_hosts: int) -> tuple[int, ...]:
  """Hosts spread over the axes, first axis first (data parallelism across hosts)."""
  out, left = [], n_hosts
  for s in sizes:
    d = math.gcd(s, left)
    out.append(d)
    left //= d
  return tuple(out)


def _misfit(
  sizes: tuple[int, ...], names: tuple[str, ...], n_devices: int, n_hosts: int
) -> str:
  per_host = n_devices // max(n_hosts, 1)
  return (
    f'mesh {dict(zip(names, sizes))} does not fit {n_devices} devices in '
    f'{n_hosts} process(es) ({per_host} each). A factorisation that fits: '
    f'axis_sizes={_suggest_sizes(sizes, n_devices, n_hosts)}, or -1 for one axis.'
  )


def _suggest_sizes(
  sizes: tuple[int, ...], n_devices: int, n_hosts: int
) -> tuple[int, ...]:
  """Keeps as many of the given sizes as fit; the first axis takes the rest."""
  sizes = tuple(1 if s == -1 else s for s in sizes)
  for i in range(len(sizes)):
    rest = math.prod(s for j, s in enumerate(sizes) if j != i and s > 0)
    if rest and n_devices % rest == 0:
      return tuple(n_devices // rest if j == i else s for j, s in enumerate(sizes))
  per_host = n_devices // max(n_hosts, 1)
  return (
    (n_devices // per_host,) + (1,) * (len(sizes) - 2) + (per_host,)
    if len(sizes) > 1
    else (n_devices,)
  )
