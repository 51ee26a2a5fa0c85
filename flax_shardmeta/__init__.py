"""flax_shardmeta: sharding metadata for Flax (Linen and NNX).

Annotate parameters once, by mesh-axis or logical names; keep the annotation
through init, lifted transforms, optimizer state and checkpoints; turn it into
validated ``NamedSharding`` trees or apply it eagerly.

Importing the package loads nothing else: each public name is imported from
its module when first used. So ``flax-shardmeta --help`` answers without
loading jax, and Linen users never load ``flax.nnx`` (``fsm.nnx`` loads it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # The same names as _EXPORTS below, for type checkers.
  from flax_shardmeta import nnx
  from flax_shardmeta._annotation import Annotation, register_annotation_type
  from flax_shardmeta._boxes import (
    PARTITION_NAME,
    LogicalPartitioned,
    Partitioned,
    replace_boxed,
    unbox,
    with_logical_partitioning,
    with_partitioning,
  )
  from flax_shardmeta._caches import clear_caches
  from flax_shardmeta._constraints import (
    RulesFallback,
    shard_value,
    with_logical_constraint,
  )
  from flax_shardmeta._errors import (
    BatchLayoutError,
    ExplicitShardingError,
    FitError,
    FlaxShardmetaError,
    InvalidNamesError,
    InvalidRulesError,
    LaunchError,
    MeshShapeError,
    NnxJitError,
    NoMeshError,
    RuleConflictError,
    RuleContextError,
    ShardingError,
    ShardingFitWarning,
    ShardingProblem,
    TopologyError,
    UnmappedMeshAxisNameWarning,
    UnmappedNameWarning,
  )
  from flax_shardmeta._explicit import (
    explain_sharding_type_errors,
    logical_out_sharding,
  )
  from flax_shardmeta._hosts.checkpoint import as_abstract
  from flax_shardmeta._hosts.data import (
    DataLayout,
    data_layout,
    global_to_host_local,
    host_local_to_global,
  )
  from flax_shardmeta._hosts.jit import JitWithContext, jit
  from flax_shardmeta._hosts.mesh import make_mesh
  from flax_shardmeta._hosts.transfer import gather_tree, shard_tree
  from flax_shardmeta._planning.fit import fit
  from flax_shardmeta._planning.plan import (
    Mismatch,
    Mismatches,
    PlanEntry,
    ShardingPlan,
    actual_shardings,
    plan,
    verify,
  )
  from flax_shardmeta._planning.presets import PRESETS as RULE_PRESETS
  from flax_shardmeta._planning.presets import RulePreset
  from flax_shardmeta._planning.report import FitReport
  from flax_shardmeta._regex_rules import match_partition_rules
  from flax_shardmeta._rules import (
    composite_rules,
    get_logical_axis_rules,
    logical_axis_rules,
    logical_to_mesh_axes,
    set_logical_axis_rules,
    standard_logical_axis_rules,
  )
  from flax_shardmeta._rules import explain as explain_resolution
  from flax_shardmeta._sharded_init import sharded_init
  from flax_shardmeta._sharding import (
    get_partition_spec,
    get_sharding,
    logical_to_mesh,
    logical_to_mesh_sharding,
  )
  from flax_shardmeta._suggest import Candidate, Suggestions, suggest

__version__ = '0.1.0'

__all__ = [
  'Annotation',
  'BatchLayoutError',
  'Candidate',
  'DataLayout',
  'FitError',
  'FitReport',
  'ExplicitShardingError',
  'NnxJitError',
  'FlaxShardmetaError',
  'InvalidNamesError',
  'InvalidRulesError',
  'JitWithContext',
  'LaunchError',
  'LogicalPartitioned',
  'MeshShapeError',
  'Mismatch',
  'Mismatches',
  'NoMeshError',
  'PARTITION_NAME',
  'Partitioned',
  'PlanEntry',
  'RULE_PRESETS',
  'RulePreset',
  'RuleConflictError',
  'RuleContextError',
  'RulesFallback',
  'ShardingError',
  'ShardingFitWarning',
  'ShardingPlan',
  'ShardingProblem',
  'Suggestions',
  'TopologyError',
  'UnmappedMeshAxisNameWarning',
  'UnmappedNameWarning',
  '__version__',
  'actual_shardings',
  'as_abstract',
  'clear_caches',
  'composite_rules',
  'data_layout',
  'explain_sharding_type_errors',
  'explain_resolution',
  'fit',
  'gather_tree',
  'get_logical_axis_rules',
  'get_partition_spec',
  'get_sharding',
  'global_to_host_local',
  'host_local_to_global',
  'jit',
  'logical_axis_rules',
  'logical_out_sharding',
  'logical_to_mesh',
  'logical_to_mesh_axes',
  'logical_to_mesh_sharding',
  'make_mesh',
  'match_partition_rules',
  'nnx',
  'plan',
  'register_annotation_type',
  'replace_boxed',
  'set_logical_axis_rules',
  'shard_tree',
  'shard_value',
  'sharded_init',
  'standard_logical_axis_rules',
  'suggest',
  'unbox',
  'verify',
  'with_logical_constraint',
  'with_logical_partitioning',
  'with_partitioning',
]


# Where each public name lives: 'module' or 'module:name in that module'.
_EXPORTS: dict[str, str] = {
  'nnx': 'nnx',
  'Annotation': '_annotation',
  'register_annotation_type': '_annotation',
  'PARTITION_NAME': '_boxes',
  'LogicalPartitioned': '_boxes',
  'Partitioned': '_boxes',
  'replace_boxed': '_boxes',
  'unbox': '_boxes',
  'with_logical_partitioning': '_boxes',
  'with_partitioning': '_boxes',
  'clear_caches': '_caches',
  'RulesFallback': '_constraints',
  'shard_value': '_constraints',
  'with_logical_constraint': '_constraints',
  'BatchLayoutError': '_errors',
  'FlaxShardmetaError': '_errors',
  'InvalidNamesError': '_errors',
  'InvalidRulesError': '_errors',
  'LaunchError': '_errors',
  'MeshShapeError': '_errors',
  'NoMeshError': '_errors',
  'RuleConflictError': '_errors',
  'ShardingError': '_errors',
  'ShardingFitWarning': '_errors',
  'ShardingProblem': '_errors',
  'UnmappedMeshAxisNameWarning': '_errors',
  'ExplicitShardingError': '_errors',
  'NnxJitError': '_errors',
  'FitError': '_errors',
  'RuleContextError': '_errors',
  'TopologyError': '_errors',
  'UnmappedNameWarning': '_errors',
  'explain_sharding_type_errors': '_explicit',
  'logical_out_sharding': '_explicit',
  'fit': '_planning.fit',
  'RULE_PRESETS': '_planning.presets:PRESETS',
  'RulePreset': '_planning.presets',
  'FitReport': '_planning.report',
  'Candidate': '_suggest',
  'Suggestions': '_suggest',
  'suggest': '_suggest',
  'as_abstract': '_hosts.checkpoint',
  'DataLayout': '_hosts.data',
  'data_layout': '_hosts.data',
  'global_to_host_local': '_hosts.data',
  'host_local_to_global': '_hosts.data',
  'JitWithContext': '_hosts.jit',
  'jit': '_hosts.jit',
  'make_mesh': '_hosts.mesh',
  'gather_tree': '_hosts.transfer',
  'shard_tree': '_hosts.transfer',
  'Mismatch': '_planning.plan',
  'Mismatches': '_planning.plan',
  'PlanEntry': '_planning.plan',
  'ShardingPlan': '_planning.plan',
  'actual_shardings': '_planning.plan',
  'plan': '_planning.plan',
  'verify': '_planning.plan',
  'match_partition_rules': '_regex_rules',
  'composite_rules': '_rules',
  'get_logical_axis_rules': '_rules',
  'logical_axis_rules': '_rules',
  'logical_to_mesh_axes': '_rules',
  'set_logical_axis_rules': '_rules',
  'standard_logical_axis_rules': '_rules',
  'explain_resolution': '_rules:explain',
  'sharded_init': '_sharded_init',
  'get_partition_spec': '_sharding',
  'get_sharding': '_sharding',
  'logical_to_mesh': '_sharding',
  'logical_to_mesh_sharding': '_sharding',
}


def __getattr__(name: str) -> Any:
  """Imports a public name's module on first use (PEP 562)."""
  where = _EXPORTS.get(name)
  if where is None:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  module_name, _, attr = where.partition(':')
  module = importlib.import_module(f'{__name__}.{module_name}')
  # A submodule (nnx) is the value itself; importing it also set it here.
  value = module if module_name == name else getattr(module, attr or name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_EXPORTS))
