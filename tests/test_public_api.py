"""The public import surface is a contract: pin it."""

import ast
import importlib.resources
import inspect
import json
import pathlib
import re
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import flax_shardmeta as fsm

# The whole public surface: a name added or removed is a decision, made here.
PUBLIC_API = {
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
  'as_abstract',
  'clear_caches',
  'actual_shardings',
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
}


def test_public_api_is_exactly_this():
  assert set(fsm.__all__) == PUBLIC_API


def test_all_is_unique_and_resolvable():
  assert len(fsm.__all__) == len(set(fsm.__all__))
  for name in fsm.__all__:
    assert hasattr(fsm, name), name


def _type_checking_imports() -> dict[str, str]:
  """Public name -> 'module[:name]' as the __init__'s TYPE_CHECKING block imports it."""
  tree = ast.parse(pathlib.Path(fsm.__file__).read_text())
  block = next(
    n for n in tree.body if isinstance(n, ast.If) and 'TYPE_CHECKING' in ast.unparse(n)
  )
  found = {}
  for node in block.body:
    assert isinstance(node, ast.ImportFrom) and node.module
    module = node.module.removeprefix('flax_shardmeta').lstrip('.')
    for a in node.names:
      if not module:  # `from flax_shardmeta import nnx`: the submodule itself
        found[a.name] = a.name
      else:
        found[a.asname or a.name] = f'{module}:{a.name}' if a.asname else module
  return found


def test_lazy_exports_match_the_typed_imports_and_all():
  # Type checkers read the TYPE_CHECKING imports, Python the _EXPORTS table.
  assert fsm._EXPORTS == _type_checking_imports()
  assert set(fsm._EXPORTS) | {'__version__'} == set(fsm.__all__)


def test_submodule_stays_the_same_object_however_imported():
  from flax_shardmeta import nnx

  assert fsm.nnx is nnx is sys.modules['flax_shardmeta.nnx']
  assert 'nnx' in dir(fsm) and 'get_sharding' in dir(fsm)
  with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
    fsm.no_such_name  # noqa: B018


_IMPORTS_SCRIPT = textwrap.dedent(
  """
  import json, sys
  loaded = lambda: sorted(m for m in ('jax', 'flax.nnx', 'flax_shardmeta.nnx')
                          if m in sys.modules)
  seen = {}
  import flax_shardmeta as fsm
  seen['import'] = loaded()
  for name in fsm.__all__:
    if name != 'nnx':
      getattr(fsm, name)
  seen['everything but nnx'] = loaded()
  import jax, jax.numpy as jnp
  from flax import nnx
  class Model(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(
          jnp.zeros((8, 4)), sharding_names=('data', None), eager_sharding=False)
  seen['flax.nnx imported'] = loaded()
  mesh = jax.sharding.AbstractMesh((2,), ('data',))
  spec = fsm.get_sharding(nnx.state(Model()), mesh)['w'].value.spec
  seen['a Variable met'] = loaded()
  seen['spec'] = str(spec)
  print(json.dumps(seen))
  """
)


def test_the_package_loads_jax_and_nnx_only_when_used():
  # In a fresh process: this one has long imported everything.
  proc = subprocess.run(
    [sys.executable, '-c', _IMPORTS_SCRIPT],
    capture_output=True,
    text=True,
    timeout=300,
    check=True,
  )
  seen = json.loads(proc.stdout)
  assert seen['import'] == []
  assert seen['everything but nnx'] == ['jax']
  assert seen['flax.nnx imported'] == ['flax.nnx', 'jax']
  # flax's own NNX annotations are read: the first Variable loads the adapter.
  assert seen['a Variable met'] == ['flax.nnx', 'flax_shardmeta.nnx', 'jax']
  assert seen['spec'] == "P('data', None)"


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
  assert 'PARTITION_NAME = \'partition_name\'\n"""' in source


def test_every_error_is_a_flax_shardmeta_error():
  errors = [
    getattr(fsm, n)
    for n in fsm.__all__
    if isinstance(getattr(fsm, n), type)
    and issubclass(getattr(fsm, n), BaseException)
    and not issubclass(getattr(fsm, n), Warning)
  ]
  assert fsm.ShardingError in errors and fsm.InvalidNamesError in errors
  for cls in errors:
    assert issubclass(cls, fsm.FlaxShardmetaError), cls
  assert issubclass(fsm.FlaxShardmetaError, ValueError)


def test_library_code_raises_no_bare_value_error():
  """Every error the library raises belongs to the FlaxShardmetaError family."""
  package = pathlib.Path(fsm.__file__).parent
  offenders = [
    f'{path.relative_to(package)}:{n}'
    for path in package.rglob('*.py')
    if 'examples' not in path.parts
    for n, line in enumerate(path.read_text().splitlines(), 1)
    if re.search(r'raise (ValueError|TypeError|AssertionError)\b', line)
  ]
  assert not offenders, offenders
  assert issubclass(fsm.ShardingFitWarning, UserWarning)
  assert issubclass(fsm.UnmappedMeshAxisNameWarning, fsm.UnmappedNameWarning)
  assert issubclass(fsm.UnmappedNameWarning, UserWarning)


def test_package_is_typed():
  assert importlib.resources.files('flax_shardmeta').joinpath('py.typed').is_file()


def test_mesh_and_rules_are_keyword_only_in_both_front_ends():
  for fn in (
    fsm.with_partitioning,
    fsm.with_logical_partitioning,
    fsm.nnx.with_partitioning,
    fsm.nnx.with_logical_partitioning,
  ):
    params = inspect.signature(fn).parameters
    for name in ('mesh', 'rules'):
      if name in params:
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, (fn, name)


def test_clear_caches_empties_resolution_and_layout_caches():
  from flax_shardmeta import _rules, _sharding

  mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
  tree = {
    'w': fsm.LogicalPartitioned(
      jax.ShapeDtypeStruct((8, 16), jnp.float32), ('embed', 'mlp')
    )
  }
  before = fsm.get_sharding(tree, mesh, [('mlp', 'model')])
  assert _rules._resolve_cached.cache_info().currsize > 0
  assert _sharding._layout_cached.cache_info().currsize > 0
  fsm.clear_caches()
  assert _rules._resolve_cached.cache_info().currsize == 0
  assert _sharding._layout_cached.cache_info().currsize == 0
  assert _sharding.named_sharding.cache_info().currsize == 0
  assert fsm.get_sharding(tree, mesh, [('mlp', 'model')]) == before


def _public_callables():
  for name in fsm.__all__:
    obj = getattr(fsm, name)
    if callable(obj):
      yield f'fsm.{name}', obj
  for name in fsm.nnx.__all__:
    obj = getattr(fsm.nnx, name)
    if callable(obj):
      yield f'fsm.nnx.{name}', obj


def test_public_callables_are_found():
  names = {name for name, _ in _public_callables()}
  assert {'fsm.plan', 'fsm.ShardingError', 'fsm.nnx.shard_module'} <= names
  # Constants and the submodule are not callables.
  assert not names & {'fsm.PARTITION_NAME', 'fsm.__version__', 'fsm.nnx'}


def test_every_public_callable_has_a_docstring_example():
  # Each example runs as a doctest (tests/test_doctests.py).
  missing = [
    name
    for name, obj in _public_callables()
    if '>>>' not in (inspect.getdoc(obj) or '')
  ]
  assert not missing, f'public callables without a >>> example: {missing}'
