"""The public import surface is a contract: pin it."""

import ast
import importlib
import importlib.resources
import importlib.util
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

DOCS = pathlib.Path(__file__).parents[1] / 'docs'
# Every module whose __all__ the reference lists.
DOCUMENTED_MODULES = ('flax_shardmeta', 'flax_shardmeta.nnx', 'flax_shardmeta.testing')


def test_the_reference_lists_exactly_the_public_api_once(reference):
  # The public surface is each module's __all__ (for the package, __init__'s one
  # table); the API page's groups hold each name exactly once, and each name
  # gets a page of its own described by its docstring.
  assert reference.DOCUMENTED_MODULES == DOCUMENTED_MODULES
  public = []
  for module in DOCUMENTED_MODULES:
    prefix = module.removeprefix('flax_shardmeta').lstrip('.')
    names = importlib.import_module(module).__all__
    public += [f'{prefix}.{name}' if prefix else name for name in names]
  grouped = [name for group in reference.GROUPS for name in group.names]
  assert len(grouped) == len(set(grouped)), 'a name in two groups'
  assert set(grouped) == set(public)
  for name in grouped:
    assert reference.row_of(name).summary.strip(), name


def test_the_api_page_shows_every_group(reference):
  page = (DOCS / 'api.md').read_text()
  shown = re.findall(r'^\.\. fsm-api-group:: (\w+)$', page, re.MULTILINE)
  assert shown == [group.key for group in reference.GROUPS]


def test_every_public_submodule_has_its_page():
  submodules = {
    f'flax_shardmeta.{name}'
    for name in fsm.__all__
    if isinstance(getattr(fsm, name), type(fsm))
  }
  assert submodules == set(DOCUMENTED_MODULES) - {'flax_shardmeta'}


def test_all_is_unique_and_resolvable():
  assert len(fsm.__all__) == len(set(fsm.__all__))
  for name in fsm.__all__:
    assert hasattr(fsm, name), name


def test_every_public_name_is_re_exported_for_type_checkers():
  # py.typed: type checkers take `from m import X as X` as a re-export and
  # nothing else (no __all__ is visible to them); Python reads the same table.
  tree = ast.parse(pathlib.Path(fsm.__file__).read_text())
  (block,) = [
    n
    for n in tree.body
    if isinstance(n, ast.If) and ast.unparse(n.test) == 'TYPE_CHECKING'
  ]
  typed = {}
  for node in block.body:
    assert isinstance(node, ast.ImportFrom), ast.unparse(node)
    for alias in node.names:
      assert alias.asname == alias.name, f'write `{alias.name} as {alias.name}`'
      typed[alias.name] = node.module
  assert set(typed) | {'__version__'} == set(fsm.__all__)
  for name, module in typed.items():
    held = importlib.import_module(module)
    assert getattr(fsm, name) is getattr(held, name, held), name


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
  assert issubclass(fsm.IndivisibleDimensionWarning, UserWarning)
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
  from flax_shardmeta import _resolution, _sharding

  mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
  tree = {
    'w': fsm.LogicalPartitioned(
      jax.ShapeDtypeStruct((8, 16), jnp.float32), ('embed', 'mlp')
    )
  }
  before = fsm.get_sharding(tree, mesh, [('mlp', 'model')])
  assert _resolution._resolve_cached.cache_info().currsize > 0
  assert _sharding._layout_cached.cache_info().currsize > 0
  fsm.clear_caches()
  assert _resolution._resolve_cached.cache_info().currsize == 0
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
