"""``flax.linen`` with its sharding-metadata names replaced by fsm's.

Replaced: ``Partitioned``, ``LogicallyPartitioned`` (fsm's
``LogicalPartitioned``), ``PARTITION_NAME``, ``with_partitioning``,
``with_logical_partitioning``, ``get_partition_spec``, ``get_sharding``,
``unbox``, ``logical_axis_rules``, ``set_logical_axis_rules``,
``get_logical_axis_rules``, ``logical_to_mesh_axes``, ``logical_to_mesh``,
``logical_to_mesh_sharding``, ``with_logical_constraint``, and the submodule
``partitioning`` (see ``shim_partitioning``). Kept as flax's: everything else,
``nn.spmd`` (flax's implementation module) and ``add_metadata_axis`` (a lifted
transform with no fsm counterpart) included.
"""

from collections.abc import Callable
from typing import Any

from flax import linen as _flax_linen

import flax_shardmeta as fsm

from . import shim_partitioning
from ._reexport import fallback, public_namespace

globals().update(public_namespace(_flax_linen))
__getattr__ = fallback(_flax_linen)

Partitioned = fsm.Partitioned
LogicallyPartitioned = fsm.LogicalPartitioned
PARTITION_NAME = fsm.PARTITION_NAME
get_partition_spec = fsm.get_partition_spec
get_sharding = fsm.get_sharding
unbox = fsm.unbox
logical_axis_rules = fsm.logical_axis_rules
set_logical_axis_rules = fsm.set_logical_axis_rules
get_logical_axis_rules = fsm.get_logical_axis_rules
logical_to_mesh = fsm.logical_to_mesh
logical_to_mesh_sharding = fsm.logical_to_mesh_sharding
logical_to_mesh_axes = shim_partitioning.logical_to_mesh_axes
partitioning = shim_partitioning


def with_partitioning(fn: Callable[..., Any], names: Any, mesh: Any = None) -> Any:
  """``fsm.with_partitioning``; renaming only: flax passes ``mesh`` by
  position, fsm takes it by keyword."""
  return fsm.with_partitioning(fn, names, mesh=mesh)


def with_logical_partitioning(
  fn: Callable[..., Any], names: Any, mesh: Any = None, rules: Any = None
) -> Any:
  """``fsm.with_logical_partitioning``; renaming only: flax passes ``mesh``
  and ``rules`` by position, fsm takes them by keyword."""
  return fsm.with_logical_partitioning(fn, names, mesh=mesh, rules=rules)


def with_logical_constraint(
  x: Any,
  logical_axis_resources: Any,
  rules: Any = None,
  mesh: Any = None,
  fallback: Any = fsm.RulesFallback.AXIS_IS_UNSHARDED,
) -> Any:
  """``fsm.with_logical_constraint``; renaming only: flax's second parameter
  is ``logical_axis_resources``, fsm's ``names``."""
  return fsm.with_logical_constraint(
    x, logical_axis_resources, rules=rules, mesh=mesh, fallback=fallback
  )
