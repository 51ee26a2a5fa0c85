"""``flax.core.meta`` with its sharding-metadata names replaced by fsm's.

Replaced: ``Partitioned``, ``PARTITION_NAME``, ``with_partitioning``,
``get_partition_spec``, ``get_sharding``, ``unbox``, ``replace_boxed``.
Kept as flax's (no fsm counterpart; fsm's boxes build on them):
``AxisMetadata``, ``add_axis``, ``remove_axis``, ``is_axis_metadata``,
``map_axis_meta``, ``get_global_mesh``, ``global_mesh_defined``.
"""

from collections.abc import Callable
from typing import Any

from flax.core import meta as _flax_meta

import flax_shardmeta as fsm

from ._reexport import fallback, public_namespace

globals().update(public_namespace(_flax_meta))
__getattr__ = fallback(_flax_meta)

Partitioned = fsm.Partitioned
PARTITION_NAME = fsm.PARTITION_NAME
get_partition_spec = fsm.get_partition_spec
get_sharding = fsm.get_sharding
unbox = fsm.unbox
replace_boxed = fsm.replace_boxed


def with_partitioning(fn: Callable[..., Any], names: Any, mesh: Any = None) -> Any:
  """``fsm.with_partitioning``; renaming only: flax passes ``mesh`` by
  position, fsm takes it by keyword."""
  return fsm.with_partitioning(fn, names, mesh=mesh)
