"""Hosts of a device set, counted in one place.

A device's host is its ``process_index`` (one process per host, as
``jax.distributed`` runs them; on GPU clusters one host is one NVLink
domain). Stand-ins without one (a topology's described devices, test
doubles) are on host 0.

Example:
  >>> import types
  >>> gpus = [types.SimpleNamespace(process_index=i // 4) for i in range(8)]
  >>> host_indices(gpus), host_count(gpus), devices_per_host(gpus)
  ([0, 1], 2, 4)
"""

from __future__ import annotations

from typing import Any


def _flat(devices: Any) -> list[Any]:
  """A flat list of devices from a list, a numpy array of them or a mesh."""
  held = getattr(devices, 'devices', devices)  # a Mesh's device array
  return list(getattr(held, 'flat', held))


def host_of(device: Any) -> int:
  """The host (``process_index``) of one device; 0 for a stand-in without one."""
  return int(getattr(device, 'process_index', 0) or 0)


def host_indices(devices: Any) -> list[int]:
  """The distinct hosts of ``devices``, sorted."""
  return sorted({host_of(d) for d in _flat(devices)})


def host_count(devices: Any) -> int:
  """How many hosts ``devices`` span (at least 1)."""
  return max(len(host_indices(devices)), 1)


def devices_per_host(devices: Any) -> int:
  """Devices per host, hosts holding equal shares."""
  return len(_flat(devices)) // host_count(devices)
