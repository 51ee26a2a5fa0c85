"""What the reference pages list, read from the code: no Sphinx needed.

The API page's table comes from each module's ``__all__`` and each name's
docstring; the module map from the layers ``tests/test_layers.py`` states and
each module's docstring (read from source: nothing is imported). The Sphinx
directives in ``fsm_sphinx`` render these rows; ``tests/test_docs.py`` checks
them against the package.

Example:
  >>> rows = api_rows('flax_shardmeta.testing')
  >>> [(row.name, row.kind) for row in rows if row.name == 'assert_snapshot']
  [('assert_snapshot', 'function')]
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import pathlib
import types
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / 'flax_shardmeta'
LAYERS_TEST = ROOT / 'tests' / 'test_layers.py'

# Names with neither a docstring of their own nor an attribute docstring where
# they are assigned: the version string is the one such name.
WITHOUT_DOCSTRING = {'__version__': "The package's version, as in ``pyproject.toml``."}


@dataclasses.dataclass(frozen=True)
class ApiRow:
  """One public name of a module, as the API page lists it.

  Attributes:
    module: the module it is public in, e.g. ``'flax_shardmeta.nnx'``.
    name: its name there.
    kind: ``'module'``, ``'exception'``, ``'class'``, ``'function'`` or
      ``'data'`` (the directive and role the page documents it with).
    summary: the first paragraph of its docstring, on one line.
    doc: its whole docstring (for data, the attribute docstring).
  """

  module: str
  name: str
  kind: str
  summary: str
  doc: str


def summary(doc: str) -> str:
  """The first paragraph of a docstring, on one line.

  Example:
    >>> summary('Lays out a tree.\\n\\n  Args: ...')
    'Lays out a tree.'
  """
  return ' '.join(inspect.cleandoc(doc).split('\n\n', 1)[0].split())


def kind_of(obj: Any) -> str:
  """Which kind of entry ``obj`` gets on the API page.

  Example:
    >>> kind_of(ValueError), kind_of(len), kind_of(3)
    ('exception', 'function', 'data')
  """
  if isinstance(obj, types.ModuleType):
    return 'module'
  if inspect.isclass(obj):
    return 'exception' if issubclass(obj, BaseException) else 'class'
  if callable(obj):
    return 'function'
  return 'data'


def _module_path(module: str) -> pathlib.Path:
  parts = module.split('.')[1:]
  package = PACKAGE.joinpath(*parts)
  return package / '__init__.py' if package.is_dir() else package.with_suffix('.py')


def attribute_doc(module: str, name: str) -> str | None:
  """The docstring under ``name = ...`` where ``module`` gets ``name`` from.

  Follows ``from X import name`` (the lazy imports of ``flax_shardmeta``
  included) to the module that assigns it.

  Example:
    >>> summary(attribute_doc('flax_shardmeta', 'PARTITION_NAME'))[:30]
    'Key of ``metadata_params`` (``'
  """
  body = ast.parse(_module_path(module).read_text()).body
  for node, after in zip(body, [*body[1:], None]):
    targets = (
      node.targets
      if isinstance(node, ast.Assign)
      else [node.target]
      if isinstance(node, ast.AnnAssign)
      else []
    )
    if any(isinstance(t, ast.Name) and t.id == name for t in targets):
      if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
        return inspect.cleandoc(str(after.value.value))
      return None
  for node in ast.walk(ast.Module(body=body, type_ignores=[])):
    if isinstance(node, ast.ImportFrom) and node.module:
      for alias in node.names:
        if (alias.asname or alias.name) == name and alias.name == name:
          return attribute_doc(node.module, name)
  return None


@functools.cache
def api_rows(module: str) -> list[ApiRow]:
  """Every name of ``module.__all__``, in that order, with its summary.

  Raises:
    LookupError: a public name with no docstring to describe it.

  Example:
    >>> [row.name for row in api_rows('flax_shardmeta.nnx')][:3]
    ['FSM_LOGICAL', 'NAME_KEYS', 'OPTIMIZER_NAMES']
  """
  mod = importlib.import_module(module)
  rows = []
  for name in mod.__all__:
    obj = getattr(mod, name)
    kind = kind_of(obj)
    if kind == 'data':
      doc = attribute_doc(module, name) or WITHOUT_DOCSTRING.get(name)
    else:
      doc = inspect.getdoc(obj)
    if not doc:
      raise LookupError(f'{module}.{name} has no docstring to describe it')
    rows.append(ApiRow(module, name, kind, summary(doc), doc))
  return rows


# The reference, by object
# ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Group:
  """A section of the API page: public names that go together, as the guides do.

  Attributes:
    key: the argument of ``fsm-api-group`` that shows it.
    names: dotted names below the package (``'fit'``, ``'nnx.shard_module'``);
      a public submodule is listed as itself (``'nnx'``).
  """

  key: str
  names: tuple[str, ...]


GROUPS = (
  Group(
    'annotations',
    (
      'with_partitioning',
      'with_logical_partitioning',
      'Partitioned',
      'LogicallyPartitioned',
      'LogicalPartitioned',
      'PARTITION_NAME',
      'unbox',
      'replace_boxed',
      'Annotation',
      'register_annotation_type',
    ),
  ),
  Group(
    'rules',
    (
      'logical_axis_rules',
      'set_logical_axis_rules',
      'get_logical_axis_rules',
      'rules_from_lists',
      'composite_rules',
      'standard_logical_axis_rules',
      'match_partition_rules',
      'logical_to_mesh_axes',
      'explain_resolution',
      'misspelt_axis',
    ),
  ),
  Group(
    'shardings',
    (
      'make_mesh',
      'get_sharding',
      'get_partition_spec',
      'logical_to_mesh',
      'logical_to_mesh_sharding',
      'with_logical_constraint',
      'shard_value',
      'RulesFallback',
      'logical_out_sharding',
      'explain_sharding_type_errors',
      'jit',
      'JitWithContext',
      'sharded_init',
      'as_abstract',
    ),
  ),
  Group(
    'nnx',
    (
      'nnx',
      'nnx.with_partitioning',
      'nnx.with_logical_partitioning',
      'nnx.shard_module',
      'nnx.eval_shape',
      'nnx.as_abstract',
      'nnx.variable_annotation',
      'nnx.FSM_LOGICAL',
      'nnx.NAME_KEYS',
      'nnx.OPTIMIZER_NAMES',
    ),
  ),
  Group(
    'plans',
    (
      'plan',
      'ShardingPlan',
      'PlanEntry',
      'ShardingProblem',
      'step_arguments',
      'verify',
      'actual_shardings',
      'Mismatch',
      'Mismatches',
      'snapshot',
      'snapshot_diff',
    ),
  ),
  Group(
    'capacity',
    (
      'fit',
      'FitReport',
      'HostMemory',
      'HostRow',
      'HOST_RAM',
      'PeakMemory',
      'PeakRow',
      'PeakDiff',
      'MoeLayerPeak',
      'suggest',
      'Suggestions',
      'Candidate',
      'RulePreset',
      'RULE_PRESETS',
      'OffloadPreset',
      'OFFLOAD_PRESETS',
      'in_host_memory',
      'in_device_memory',
      'Chip',
      'CHIPS',
      'chip_named',
      'is_gpu_topology',
    ),
  ),
  Group('restore', ('save', 'restore', 'restore_plan', 'RestorePlan')),
  Group('audit', ('audit_explicit', 'ExplicitAudit')),
  Group(
    'hosts',
    (
      'data_layout',
      'DataLayout',
      'host_local_to_global',
      'global_to_host_local',
      'shard_tree',
      'gather_tree',
    ),
  ),
  Group(
    'errors',
    (
      'explain_error',
      'FlaxShardmetaError',
      'ShardingError',
      'InvalidNamesError',
      'InvalidRulesError',
      'RuleConflictError',
      'RuleContextError',
      'NoMeshError',
      'ExplicitShardingError',
      'NnxJitError',
      'MeshShapeError',
      'BatchLayoutError',
      'TopologyError',
      'SizeError',
      'FitError',
      'RestoreError',
      'CheckpointDamagedError',
      'HostBudgetError',
      'LaunchError',
      'IndivisibleDimensionWarning',
      'UnmappedNameWarning',
      'UnmappedMeshAxisNameWarning',
    ),
  ),
  Group(
    'testing',
    (
      'testing',
      'testing.assert_snapshot',
      'testing.SnapshotMismatch',
      'testing.UPDATE_VARIABLE',
      'testing.launch',
      'testing.join_launch',
      'testing.ProcessResult',
      'simulate_cpu_devices',
      'cpu_only_jax',
    ),
  ),
  Group(
    'utilities',
    ('format_bytes', 'parse_bytes', 'clear_caches', '__version__'),
  ),
)
"""The API page's sections in order, each public name in exactly one of them."""

DOCUMENTED_MODULES = ('flax_shardmeta', 'flax_shardmeta.nnx', 'flax_shardmeta.testing')
"""The modules whose ``__all__`` the reference lists: the package and its public
submodules."""


def group(key: str) -> Group:
  """The group ``key`` of :data:`GROUPS`.

  Example:
    >>> group('audit').names
    ('audit_explicit', 'ExplicitAudit')
  """
  (found,) = [g for g in GROUPS if g.key == key]
  return found


def public_names() -> list[str]:
  """Every public name, dotted below the package, in its module's ``__all__``.

  Example:
    >>> names = public_names()
    >>> 'fit' in names and 'nnx.shard_module' in names and 'testing' in names
    True
  """
  out = []
  for module in DOCUMENTED_MODULES:
    prefix = module.removeprefix('flax_shardmeta').lstrip('.')
    out += [
      f'{prefix}.{n}' if prefix else n for n in importlib.import_module(module).__all__
    ]
  return out


def row_of(name: str) -> ApiRow:
  """The row of a dotted public name (``'fit'``, ``'nnx.shard_module'``).

  Example:
    >>> row_of('testing.launch').module, row_of('nnx').kind
    ('flax_shardmeta.testing', 'module')
  """
  module, _, short = f'flax_shardmeta.{name}'.rpartition('.')
  (row,) = [r for r in api_rows(module) if r.name == short]
  return row


def page_name(name: str) -> str:
  """The document of a public name's page, below the docs folder.

  Example:
    >>> page_name('fit'), page_name('nnx.shard_module')
    ('api/flax_shardmeta.fit', 'api/flax_shardmeta.nnx.shard_module')
  """
  return f'api/flax_shardmeta.{name}'


def page_title(name: str) -> str:
  """How a public name is written where users call it: ``fsm.fit``.

  Example:
    >>> page_title('nnx.shard_module')
    'fsm.nnx.shard_module'
  """
  return f'fsm.{name}'


# The module map
# ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layer:
  """One layer of the package: its modules, lowest first, and what it is for.

  Attributes:
    number: 1 for the lowest layer.
    note: the comment above it in ``tests/test_layers.py`` ('' if none).
    modules: ``(dotted name, summary of its docstring)`` per module.
  """

  number: int
  note: str
  modules: tuple[tuple[str, str], ...]


def module_doc(name: str) -> str:
  """The docstring of module ``name`` (dotted below the package), from source.

  Example:
    >>> summary(module_doc('_errors'))
    'Errors raised by flax_shardmeta, and the problem records they carry.'
  """
  dotted = f'flax_shardmeta.{name}' if name else 'flax_shardmeta'
  doc = ast.get_docstring(ast.parse(_module_path(dotted).read_text()))
  if not doc:
    raise LookupError(f'{dotted} has no docstring')
  return doc


def layers() -> list[Layer]:
  """The layers ``tests/test_layers.py`` keeps the imports to, lowest first.

  Each layer's note is the comment written above it there.

  Example:
    >>> first = layers()[0]
    >>> first.number, first.modules[0][0]
    (1, '_typing')
  """
  source = LAYERS_TEST.read_text()
  lines = source.splitlines()
  (assign,) = [
    node
    for node in ast.parse(source).body
    if isinstance(node, ast.Assign)
    and any(isinstance(t, ast.Name) and t.id == 'LAYERS' for t in node.targets)
  ]
  assert isinstance(assign.value, ast.List)
  out = []
  for number, element in enumerate(assign.value.elts, 1):
    # The comment lines right above the layer's first line.
    note: list[str] = []
    row = element.lineno - 2
    while row >= 0 and lines[row].strip().startswith('#'):
      note.insert(0, lines[row].strip().lstrip('#').strip())
      row -= 1
    names = ast.literal_eval(element)
    modules = tuple((n, summary(module_doc(n))) for n in names)
    out.append(Layer(number, ' '.join(note), modules))
  return out


def packages() -> list[tuple[str, str]]:
  """``(dotted name, docstring)`` of the package and each subpackage, by path.

  Example:
    >>> [name for name, _ in packages()][:2]
    ['', '_audit']
  """
  found = sorted(p.parent for p in PACKAGE.rglob('__init__.py'))
  names = ['.'.join(p.relative_to(PACKAGE).parts) for p in found]
  return [(name, module_doc(name)) for name in names]


def package_modules() -> set[str]:
  """Every module of the package, dotted below it ('' for the package itself).

  Example:
    >>> {'', '_errors', '_programs.hlo_text', 'cli'} <= package_modules()
    True
  """
  out = set()
  for path in PACKAGE.rglob('*.py'):
    parts = path.relative_to(PACKAGE).with_suffix('').parts
    if parts[-1] == '__init__':
      parts = parts[:-1]
    out.add('.'.join(parts))
  return out
