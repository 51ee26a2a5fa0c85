"""flax_shardmeta: sharding metadata for Flax (Linen and NNX).

Annotate parameters once, by mesh-axis or logical names; keep the annotation
through init, lifted transforms, optimizer state and checkpoints; turn it into
validated ``NamedSharding`` trees or apply it eagerly.
"""

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
from flax_shardmeta._explicit import explain_sharding_type_errors, logical_out_sharding
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
