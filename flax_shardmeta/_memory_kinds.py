"""Shardings in host memory, that keep their memory kind on every target.

A step offloads by laying arrays out in host memory (``pinned_host``): the
optimizer state between steps, say. jax drops a memory kind that the mesh's
devices do not list, silently: the devices of a compile-only GPU topology
(jax's CUDA plugin without a GPU) list none, so ``NamedSharding(mesh, spec,
memory_kind='pinned_host')`` over them is a device sharding, and a program
compiled with it keeps its "offloaded" state on the chip. The same layout over
the mesh's ``AbstractMesh`` keeps its kind, and XLA's GPU compiler then
places the array in host memory and counts it apart, as it does on a GPU.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding

HOST = 'pinned_host'


def in_host_memory(shardings: Any, kind: str = HOST) -> Any:
  """``shardings`` (a ``NamedSharding`` or a tree of them) in host memory.

  The same layouts with memory kind ``kind``; where jax would drop that kind
  (the devices of a compile-only topology list no memories), over the mesh's
  ``AbstractMesh``, which keeps it. ``None`` leaves stay ``None``.

  Example:
    >>> import jax, flax_shardmeta as fsm
    >>> mesh = jax.make_mesh((8,), ('data',))
    >>> s = fsm.in_host_memory(jax.NamedSharding(mesh, jax.P('data')))
    >>> s.memory_kind, s.spec
    ('pinned_host', P('data',))
  """
  return _each(shardings, lambda s: _with_kind(s, kind))


def in_device_memory(shardings: Any) -> Any:
  """``shardings`` in the chips' own memory (memory kind ``device``): what a
  step ``jax.device_put``\\ s its host-resident state to before computing on
  it. Kept over the ``AbstractMesh`` where jax would drop the kind, as in
  :func:`in_host_memory`.

  Example:
    >>> import jax, flax_shardmeta as fsm
    >>> mesh = jax.make_mesh((8,), ('data',))
    >>> host = fsm.in_host_memory(jax.NamedSharding(mesh, jax.P('data')))
    >>> fsm.in_device_memory(host).memory_kind
    'device'
  """
  return _each(shardings, lambda s: _with_kind(s, 'device'))


def _each(shardings: Any, fn: Any) -> Any:
  return jax.tree.map(
    lambda s: fn(s) if isinstance(s, NamedSharding) else s,
    shardings,
    is_leaf=lambda x: isinstance(x, NamedSharding),
  )


def _with_kind(sharding: NamedSharding, kind: str) -> NamedSharding:
  try:
    made = sharding.with_memory_kind(kind)
  except ValueError:
    made = None  # a kind these devices do not have
  if made is not None and made.memory_kind == kind:
    return made
  mesh = sharding.mesh
  abstract = getattr(mesh, 'abstract_mesh', mesh)
  return NamedSharding(abstract, sharding.spec, memory_kind=kind)
