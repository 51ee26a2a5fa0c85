"""flax_shardmeta: sharding metadata for Flax (Linen and NNX).

Annotate parameters once, by mesh-axis or logical names; keep the annotation
through init, lifted transforms, optimizer state and checkpoints; turn it into
validated ``NamedSharding`` trees or apply it eagerly.

Importing the package loads nothing else: each public name is imported from
its module when first used. So ``flax-shardmeta --help`` answers without
loading jax, and Linen users never load ``flax.nnx`` (``fsm.nnx`` loads it).
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # The public names: the one table, read at run time too.
  from flax_shardmeta import nnx as nnx, testing as testing
  from flax_shardmeta._abstract import as_abstract as as_abstract
  from flax_shardmeta._annotation import (
    Annotation as Annotation,
    register_annotation_type as register_annotation_type,
  )
  from flax_shardmeta._audit.audit_explicit import (
    ExplicitAudit as ExplicitAudit,
    audit_explicit as audit_explicit,
  )
  from flax_shardmeta._axis_typos import misspelt_axis as misspelt_axis
  from flax_shardmeta._boxes import (
    PARTITION_NAME as PARTITION_NAME,
    LogicallyPartitioned as LogicallyPartitioned,
    LogicalPartitioned as LogicalPartitioned,
    Partitioned as Partitioned,
    replace_boxed as replace_boxed,
    unbox as unbox,
    with_logical_partitioning as with_logical_partitioning,
    with_partitioning as with_partitioning,
  )
  from flax_shardmeta._caches import clear_caches as clear_caches
  from flax_shardmeta._capacity.fit.fit import fit as fit
  from flax_shardmeta._capacity.fit.host_side import (
    HOST_RAM as HOST_RAM,
    HostMemory as HostMemory,
    HostRow as HostRow,
  )
  from flax_shardmeta._capacity.peak.experts import MoeLayerPeak as MoeLayerPeak
  from flax_shardmeta._capacity.peak.rows import (
    PeakDiff as PeakDiff,
    PeakMemory as PeakMemory,
    PeakRow as PeakRow,
  )
  from flax_shardmeta._capacity.report import FitReport as FitReport
  from flax_shardmeta._capacity.suggest.offload_presets import (
    OFFLOAD_PRESETS as OFFLOAD_PRESETS,
    OffloadPreset as OffloadPreset,
  )
  from flax_shardmeta._capacity.suggest.presets import (
    RULE_PRESETS as RULE_PRESETS,
    RulePreset as RulePreset,
  )
  from flax_shardmeta._capacity.suggest.suggestions import (
    Candidate as Candidate,
    Suggestions as Suggestions,
    suggest as suggest,
  )
  from flax_shardmeta._constraints import (
    RulesFallback as RulesFallback,
    shard_value as shard_value,
    with_logical_constraint as with_logical_constraint,
  )
  from flax_shardmeta._devices.chips import (
    CHIPS as CHIPS,
    Chip as Chip,
    chip_named as chip_named,
  )
  from flax_shardmeta._devices.gpu import is_gpu_topology as is_gpu_topology
  from flax_shardmeta._devices.quiet import cpu_only_jax as cpu_only_jax
  from flax_shardmeta._devices.simulated import (
    simulate_cpu_devices as simulate_cpu_devices,
  )
  from flax_shardmeta._error_pages import explain_error as explain_error
  from flax_shardmeta._errors import (
    BatchLayoutError as BatchLayoutError,
    CheckpointDamagedError as CheckpointDamagedError,
    ExplicitShardingError as ExplicitShardingError,
    FitError as FitError,
    FlaxShardmetaError as FlaxShardmetaError,
    HostBudgetError as HostBudgetError,
    IndivisibleDimensionWarning as IndivisibleDimensionWarning,
    InvalidNamesError as InvalidNamesError,
    InvalidRulesError as InvalidRulesError,
    LaunchError as LaunchError,
    MeshShapeError as MeshShapeError,
    NnxJitError as NnxJitError,
    NoMeshError as NoMeshError,
    RestoreError as RestoreError,
    RuleConflictError as RuleConflictError,
    RuleContextError as RuleContextError,
    ShardingError as ShardingError,
    ShardingProblem as ShardingProblem,
    SizeError as SizeError,
    TopologyError as TopologyError,
    UnmappedMeshAxisNameWarning as UnmappedMeshAxisNameWarning,
    UnmappedNameWarning as UnmappedNameWarning,
  )
  from flax_shardmeta._explicit import (
    explain_sharding_type_errors as explain_sharding_type_errors,
    logical_out_sharding as logical_out_sharding,
  )
  from flax_shardmeta._hosts.data import (
    DataLayout as DataLayout,
    data_layout as data_layout,
    global_to_host_local as global_to_host_local,
    host_local_to_global as host_local_to_global,
  )
  from flax_shardmeta._hosts.mesh import make_mesh as make_mesh
  from flax_shardmeta._hosts.transfer import (
    gather_tree as gather_tree,
    shard_tree as shard_tree,
  )
  from flax_shardmeta._init.sharded_init import sharded_init as sharded_init
  from flax_shardmeta._jit.jit import JitWithContext as JitWithContext, jit as jit
  from flax_shardmeta._memory_kinds import (
    in_device_memory as in_device_memory,
    in_host_memory as in_host_memory,
  )
  from flax_shardmeta._planning.entry import PlanEntry as PlanEntry
  from flax_shardmeta._planning.sharding_plan import (
    ShardingPlan as ShardingPlan,
    plan as plan,
  )
  from flax_shardmeta._planning.step_arguments import step_arguments as step_arguments
  from flax_shardmeta._planning.verify import (
    Mismatch as Mismatch,
    Mismatches as Mismatches,
    actual_shardings as actual_shardings,
    verify as verify,
  )
  from flax_shardmeta._regex_rules import match_partition_rules as match_partition_rules
  from flax_shardmeta._resolution import (
    explain_resolution as explain_resolution,
    logical_to_mesh_axes as logical_to_mesh_axes,
  )
  from flax_shardmeta._restore.reading_plan import (
    RestorePlan as RestorePlan,
    restore_plan as restore_plan,
  )
  from flax_shardmeta._restore.restore import restore as restore
  from flax_shardmeta._restore.save import save as save
  from flax_shardmeta._rules import (
    composite_rules as composite_rules,
    get_logical_axis_rules as get_logical_axis_rules,
    logical_axis_rules as logical_axis_rules,
    rules_from_lists as rules_from_lists,
    set_logical_axis_rules as set_logical_axis_rules,
  )
  from flax_shardmeta._sharding import get_sharding as get_sharding
  from flax_shardmeta._snapshot.compare import snapshot_diff as snapshot_diff
  from flax_shardmeta._snapshot.record import snapshot as snapshot
  from flax_shardmeta._spec_trees import (
    get_partition_spec as get_partition_spec,
    logical_to_mesh as logical_to_mesh,
    logical_to_mesh_sharding as logical_to_mesh_sharding,
  )
  from flax_shardmeta._standard_rules import (
    standard_logical_axis_rules as standard_logical_axis_rules,
  )
  from flax_shardmeta._units import (
    format_bytes as format_bytes,
    parse_bytes as parse_bytes,
  )

__version__ = '0.1.0'


def _read_exports() -> dict[str, str]:
  """Public name -> 'module' or 'module:name there', from the imports above.

  Type checkers read the ``TYPE_CHECKING`` imports; Python never runs them, so
  they are read here as the table of what ``__getattr__`` imports on first use
  (as scientific Python's ``lazy_loader.attach_stub`` reads a stub).
  """
  tree = ast.parse(pathlib.Path(__file__).read_text())
  (block,) = [
    n
    for n in tree.body
    if isinstance(n, ast.If) and ast.unparse(n.test) == 'TYPE_CHECKING'
  ]
  table = {}
  for node in block.body:
    assert isinstance(node, ast.ImportFrom) and node.module
    module = node.module.removeprefix(__name__).lstrip('.')
    for alias in node.names:
      public = alias.asname or alias.name
      if not module:  # `from flax_shardmeta import nnx`: a submodule
        table[public] = public
      else:
        table[public] = module if public == alias.name else f'{module}:{alias.name}'
  return table


_EXPORTS = _read_exports()
if not TYPE_CHECKING:  # Type checkers take the `X as X` imports as the exports.
  __all__ = sorted([*_EXPORTS, '__version__'])


# Former public names, kept one release (the table is the errors module's):
# each use warns (never cached here).
from flax_shardmeta._errors import DEPRECATED_NAMES as _DEPRECATED  # noqa: E402


def __getattr__(name: str) -> Any:
  """Imports a public name's module on first use (PEP 562)."""
  if name in _DEPRECATED:
    new = _DEPRECATED[name]
    warnings.warn(
      f'fsm.{name} is deprecated: use fsm.{new} (the same class; the old name '
      'will be removed in the next release).',
      DeprecationWarning,
      stacklevel=2,
    )
    return __getattr__(new)
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
