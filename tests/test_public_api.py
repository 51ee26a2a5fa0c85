"""The public import surface is a contract: pin it."""

import importlib.resources
import inspect

import flax.linen as nn

import flax_shardmeta as fsm

# Names the core exports; adapters (NNX, plans, checkpoints) may add more.
CORE_API = {
    'PARTITION_NAME',
    'Annotation',
    'LogicalPartitioned',
    'Mismatch',
    'Mismatches',
    'NoMeshError',
    'Partitioned',
    'RuleConflictError',
    'RulesFallback',
    'ShardingError',
    'ShardingFitWarning',
    'ShardingProblem',
    'UnmappedMeshAxisNameWarning',
    '__version__',
    'actual_shardings',
    'composite_rules',
    'explain_resolution',
    'get_logical_axis_rules',
    'get_partition_spec',
    'get_sharding',
    'logical_axis_rules',
    'logical_to_mesh',
    'logical_to_mesh_axes',
    'logical_to_mesh_sharding',
    'match_partition_rules',
    'register_annotation_type',
    'replace_boxed',
    'set_logical_axis_rules',
    'shard_value',
    'standard_logical_axis_rules',
    'unbox',
    'with_logical_constraint',
    'with_logical_partitioning',
    'with_partitioning',
}


def test_core_api_is_exported():
  assert CORE_API <= set(fsm.__all__)


def test_all_is_unique_and_resolvable():
  assert len(fsm.__all__) == len(set(fsm.__all__))
  for name in fsm.__all__:
    assert hasattr(fsm, name), name


def test_version():
  assert isinstance(fsm.__version__, str)
  assert fsm.__version__.count('.') >= 2


def test_partition_name_matches_flax():
  assert fsm.PARTITION_NAME == 'partition_name' == nn.PARTITION_NAME


def test_every_public_name_has_a_docstring():
  missing = []
  for name in fsm.__all__:
    if name in ('__version__', 'PARTITION_NAME'):
      continue
    obj = getattr(fsm, name)
    if not inspect.getdoc(obj):
      missing.append(name)
  assert not missing, f'public names without a docstring: {missing}'


def test_constant_is_documented_in_its_module():
  source = inspect.getsource(inspect.getmodule(fsm.Partitioned))
  assert "PARTITION_NAME = 'partition_name'\n\"\"\"" in source


def test_errors_are_value_errors():
  for cls in (fsm.ShardingError, fsm.RuleConflictError, fsm.NoMeshError):
    assert issubclass(cls, ValueError)
  assert issubclass(fsm.ShardingFitWarning, UserWarning)
  assert issubclass(fsm.UnmappedMeshAxisNameWarning, UserWarning)


def test_package_is_typed():
  assert importlib.resources.files('flax_shardmeta').joinpath('py.typed').is_file()
