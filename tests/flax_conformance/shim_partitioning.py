"""``flax.linen.partitioning`` with its logical-rule names replaced by fsm's.

Replaced: ``axis_rules``, ``get_axis_rules``, ``set_axis_rules``,
``logical_to_mesh_axes``, ``logical_to_mesh``, ``with_sharding_constraint``,
``RulesFallback``. Kept as flax's (no fsm counterpart): the legacy
``params_axes`` machinery (``AxisMetadata``, ``param_with_axes``,
``variable_with_axes``, ``get_axis_names``, ``scan_with_axes``,
``vmap_with_axes``) and the private ``_with_sharding_constraint``.
"""

from typing import Any

from flax.linen import partitioning as _flax_partitioning

import flax_shardmeta as fsm

from ._reexport import fallback, public_namespace

globals().update(public_namespace(_flax_partitioning))
__getattr__ = fallback(_flax_partitioning)

axis_rules = fsm.logical_axis_rules
get_axis_rules = fsm.get_logical_axis_rules
set_axis_rules = fsm.set_logical_axis_rules
logical_to_mesh = fsm.logical_to_mesh
RulesFallback = fsm.RulesFallback


def logical_to_mesh_axes(array_dim_names: Any, rules: Any = None) -> Any:
  """``fsm.logical_to_mesh_axes``; renaming only: flax's first parameter is
  ``array_dim_names``, fsm's ``names``."""
  return fsm.logical_to_mesh_axes(array_dim_names, rules)


def with_sharding_constraint(
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
