"""flax's own sharding-metadata tests, run against flax_shardmeta.

The sdist of the installed flax ships its tests. The files selected below are
extracted and their import lines rewritten to import the shims of
``tests/flax_conformance/``: flax's modules with the sharding-metadata names
replaced by fsm's (``nn.Partitioned`` is ``fsm.Partitioned``...); test bodies
and assertions stay flax's. They run under pytest in separate processes
(flax's pytest settings, 8 simulated CPU devices, each file starting without
logical axis rules) and each selected flax test is one case here, named by its
flax id (``nnx.spmd_test.TestSPMD.test_init``).

Every selected test must pass, except those in ``EXPECTED_FAILURES``, which
must fail with the text listed for them: a listed test that passes fails the
suite until it is removed from the list. The listed ones also run unrewritten
and must pass there, so a listed failure is fsm's, never flax's.

The sdist is downloaded once (``pip download``) into pytest's cache
directory; when it cannot be, the suite is skipped with pip's error.

Run: ``python -m pytest tests/test_flax_conformance.py -m slow``.
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import fcntl
import importlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

pytestmark = pytest.mark.slow

FLAX_VERSION = importlib.metadata.version('flax')

# ---------------------------------------------------------------------------
# The selection: flax test files (under the sdist's tests/), by class.

WHOLE_FILES: dict[str, dict[str, str]] = {
  'core/core_meta_test.py': {
    'MetaTest': """
      test_boxed_param test_boxed_param_with_mesh test_boxed_variable
      test_get_partition_spec test_get_sharding test_partition_axis_unspecified
      test_scan_over_layers test_unbox
    """,
  },
  'linen/linen_meta_test.py': {
    'LinenMetaTest': 'test_boxed_param test_boxed_variable test_pjit_scan_over_layers',
  },
  'linen/partitioning_test.py': {
    'PartitioningTest': """
      test_axis_rules test_axis_rules_context test_logical_to_mesh_axes
      test_logical_to_mesh_axes_cases0 test_logical_to_mesh_axes_cases1
      test_logical_to_mesh_axes_cases2 test_logical_to_mesh_axes_cases3
      test_logical_to_mesh_axes_cases4 test_logical_to_mesh_axes_cases5
      test_logical_to_mesh_axes_cases6 test_logical_to_mesh_axes_cases7
      test_logical_to_mesh_axes_priorities
      test_logical_to_mesh_axes_resolves_to_none_or_unconstrained
      test_logical_with_mesh_and_rules test_param_pytree_with_axes
      test_param_with_axes test_param_with_axes_no_axes0
      test_param_with_axes_no_axes1 test_scan_with_axes test_variable_with_axes
      test_variable_with_axes_fallback test_variable_with_axes_no_axes0
      test_variable_with_axes_no_axes1 test_variable_with_empty_tuple_has_empty_axes
      test_vmap_with_axes test_with_sharding_constraint
      test_with_sharding_constraint_fallback
    """,
  },
  'nnx/spmd_test.py': {
    'TestSPMD': """
      test_add_remove_axis_in_transform test_eager_sharding_context0
      test_eager_sharding_context1 test_eval_shape_with_explicit_sharding
      test_eval_shape_with_sharding0 test_eval_shape_with_sharding1
      test_get_abstract_model test_get_abstract_no_sharding_metadata
      test_get_abstract_with_abstract_mesh test_get_abstract_with_per_variable_mesh
      test_init test_init_all_devices test_logical_rules0 test_logical_rules1
      test_out_sharding_conv test_out_sharding_dropout test_out_sharding_embed
      test_out_sharding_embed_attend test_out_sharding_linear_layers
      test_out_sharding_mha test_separate_opt_sharding test_shard_optimizer_state
      test_sharding_axis_types0 test_sharding_axis_types1 test_sharding_axis_types2
      test_transform_metadata_decorator
      test_transform_metadata_decorator_none_partition
      test_variable_out_sharding_types0 test_variable_out_sharding_types1
    """,
  },
}
"""Files about sharding metadata as a whole: every test of them is selected
(checked by ``test_whole_files_are_selected_whole``)."""

PICKED: dict[str, dict[str, str]] = {
  'nnx/bridge/module_test.py': {'TestBridgeModule': 'test_metadata'},
  'nnx/bridge/wrappers_test.py': {
    'TestCompatibility': """
      test_linen_to_nnx_metadata test_linen_to_nnx_external_metadata
      test_nnx_to_linen_metadata test_nnx_linen_nnx
    """,
  },
  'linen/summary_test.py': {'SummaryTest': 'test_partitioned_params'},
  'linen/linen_transforms_test.py': {'TransformTest': 'test_add_metadata_axis'},
  'nnx/transforms_test.py': {
    'TestScan': """
      test_scan_with_sharding test_scan_with_sharding_functional0
      test_scan_with_sharding_functional1
    """,
    'TestVmap': """
      test_metadata_graph_updates test_metadata_graph_updates_functional0
      test_metadata_graph_updates_functional1 test_metadata_transform_metadata
    """,
  },
}
"""The tests of other files that are about sharding metadata (through the NNX
bridge, ``tabulate``, and lifted / NNX transforms), picked by name."""

PICK_BY_NAME = re.compile(r'partition|metadata|sharding|logical|spmd')
"""Names of the tests ``PICKED`` chooses from; each test of a ``PICKED`` file
with such a name is picked or listed in ``NOT_PICKED`` (checked)."""

NOT_PICKED: dict[str, str] = {
  'nnx.bridge.wrappers_test.TestCompatibility.test_nnx_to_linen_metadata_transform': (
    'an empty test (a TODO in flax)'
  ),
  'nnx.bridge.wrappers_test.TestCompatibility.test_nnx_to_linen_external_metadata': (
    'a custom AxisMetadata box through the bridge, no sharding names'
  ),
  'nnx.transforms_test.TestJIT.test_apply_shardings': 'jit in/out_shardings',
  'nnx.transforms_test.TestJIT.test_apply_shardings_functional': (
    'jit in/out_shardings'
  ),
  'nnx.transforms_test.TestJIT.test_jit_static_args_with_shardings': (
    'jit in/out_shardings'
  ),
  'nnx.transforms_test.TestJIT.test_with_sharding_and_static_args': (
    'jit in/out_shardings'
  ),
  'nnx.transforms_test.TestJIT.test_with_sharding_and_static_args_functional': (
    'jit in/out_shardings'
  ),
  'nnx.transforms_test.TestTreeJIT.test_jit_partial_in_shardings_none_broadcast': (
    'jit in_shardings'
  ),
  'nnx.transforms_test.TestTreeJIT.test_jit_partial_in_shardings_named': (
    'jit in_shardings'
  ),
  'nnx.transforms_test.TestTreeJIT.test_jit_partial_mixed_shardings': (
    'jit in_shardings'
  ),
  'nnx.transforms_test.TestTreeJIT.test_jit_partial_in_shardings_non_tuple': (
    'jit in_shardings'
  ),
  'nnx.transforms_test.TestShardMap.test_shardmap_with_sharding_names': (
    'shard_map specs of Variables'
  ),
  'nnx.transforms_test.TestShardMap.test_shardmap_sharding_names_mutation': (
    'shard_map specs of Variables'
  ),
  'nnx.transforms_test.TestVmap.test_equivalent_state_sharding_mapping': (
    'vmap in_axes given as StateSharding'
  ),
  'nnx.transforms_test.TestVmap.test_equivalent_state_sharding_mapping_functional': (
    'vmap in_axes given as StateSharding'
  ),
}
"""Tests of ``PICKED`` files whose name matches ``PICK_BY_NAME`` but that do
not test sharding metadata, each with what they test instead."""

ONLY_IN: dict[str, str] = {
  'nnx.bridge.wrappers_test.TestCompatibility.test_linen_to_nnx_external_metadata': (
    'flax>=0.12.12'
  ),
  'nnx.bridge.wrappers_test.TestCompatibility.test_nnx_to_linen_external_metadata': (
    'flax>=0.12.12'
  ),
}
"""Selected (or not picked) tests that only some flax versions have."""


# ---------------------------------------------------------------------------
# What fails, and why.


@dataclasses.dataclass(frozen=True)
class Expected:
  """A selected flax test that fails on fsm.

  Attributes:
    test: the flax test id.
    category: 'difference' (a documented behaviour of fsm that differs from
      flax's), 'internal' (the test reads or patches a flax internal fsm has no
      counterpart for), 'defect' (fsm is wrong; to be fixed and removed) or
      'both' (flax itself fails it too on this stack: nothing to compare).
    reason: one line: why it fails.
    match: text the failure (message and traceback) must contain, so a test
      failing for another reason is not taken for this one.
    when: the stacks the entry holds for, as a requirement on an installed
      distribution ('jax>=0.12', 'flax<0.12.12'); '' for all of them.
  """

  test: str
  category: str
  reason: str
  match: str
  when: str = ''


CATEGORIES = ('difference', 'internal', 'defect', 'both')

_UNEVEN = (
  "fsm refuses a dimension its mesh axes do not divide (4 rows over 'in'=8 on "
  "8 devices); flax's constraint lets XLA shard it unevenly"
)
_UNEVEN_BOTH = (
  "4 rows over 'in'=8 on 8 devices: fsm refuses the uneven sharding, and so "
  'does jax under flax (IndivisibleError)'
)
_ONE_MESH = (
  'fsm.nnx.as_abstract lays the tree out on one mesh, given or set by '
  "jax.set_mesh, and raises NoMeshError without one; flax's uses each "
  "Variable's own `mesh` metadata and leaves unannotated ones unsharded"
)
_NO_RULES_METADATA = (
  'fsm.nnx.with_partitioning takes mesh-axis names and no other Variable '
  'metadata (sharding_rules=): logical names with their own rules are '
  'fsm.nnx.with_logical_partitioning(init, names, rules=...)'
)
_FLAX_WSC = (
  'mock-patches flax.linen.spmd._with_sharding_constraint, which '
  'fsm.with_logical_constraint does not call'
)

EXPECTED_FAILURES: tuple[Expected, ...] = (
  # 4 rows over 8 devices: an uneven sharding, which jax refuses too from 0.12
  # (0.10.2 allows it, 0.12.0.1 raises IndivisibleError under flax itself).
  Expected(
    'core.core_meta_test.MetaTest.test_boxed_param_with_mesh',
    'difference',
    _UNEVEN,
    match="is not divisible by 'in'=8",
    when='jax<0.12',
  ),
  Expected(
    'core.core_meta_test.MetaTest.test_boxed_param_with_mesh',
    'both',
    _UNEVEN_BOTH,
    match="is not divisible by 'in'=8",
    when='jax>=0.12',
  ),
  Expected(
    'linen.partitioning_test.PartitioningTest.test_logical_with_mesh_and_rules',
    'difference',
    _UNEVEN,
    match="is not divisible by 'in'=8",
    when='jax<0.12',
  ),
  Expected(
    'linen.partitioning_test.PartitioningTest.test_logical_with_mesh_and_rules',
    'both',
    _UNEVEN_BOTH,
    match="is not divisible by 'in'=8",
    when='jax>=0.12',
  ),
  Expected(
    'core.core_meta_test.MetaTest.test_partition_axis_unspecified',
    'difference',
    'a lifted transform without metadata_params={PARTITION_NAME: ...} adds an '
    'unsharded (None) axis to fsm boxes; flax raises PartitioningUnspecifiedError',
    match='PartitioningUnspecifiedError not raised',
  ),
  Expected(
    'nnx.spmd_test.TestSPMD.test_eval_shape_with_sharding0',
    'difference',
    _ONE_MESH,
    match='NoMeshError: as_abstract needs a mesh',
  ),
  Expected(
    'nnx.spmd_test.TestSPMD.test_get_abstract_with_per_variable_mesh',
    'difference',
    _ONE_MESH,
    match='NoMeshError: as_abstract needs a mesh',
  ),
  Expected(
    'nnx.spmd_test.TestSPMD.test_get_abstract_no_sharding_metadata',
    'difference',
    _ONE_MESH,
    match='NoMeshError: as_abstract needs a mesh',
  ),
  Expected(
    'nnx.spmd_test.TestSPMD.test_logical_rules0',
    'difference',
    _NO_RULES_METADATA,
    match="unexpected keyword argument 'sharding_rules'",
  ),
  Expected(
    'nnx.spmd_test.TestSPMD.test_logical_rules1',
    'difference',
    _NO_RULES_METADATA,
    match="unexpected keyword argument 'sharding_rules'",
  ),
  Expected(
    'nnx.bridge.wrappers_test.TestCompatibility.test_linen_to_nnx_metadata',
    'difference',
    "fsm.get_partition_spec gives names as written (P('out-alias')), resolving "
    "is fsm.get_sharding's; flax's nnx.get_partition_spec applies a Variable's "
    'sharding_rules',
    match="Resource axis: out-alias of P('out-alias',) is not found in mesh",
  ),
  Expected(
    'nnx.bridge.wrappers_test.TestCompatibility.test_nnx_linen_nnx',
    'difference',
    "fsm wants one name per dimension (('out-alias',) on a 2-D param is an "
    'error); flax hands the short spec to jax, which replicates the rest',
    match='1 names for a rank-2 array',
  ),
  Expected(
    'linen.partitioning_test.PartitioningTest.test_axis_rules',
    'internal',
    "reads flax's own rule storage (nn.spmd.get_logical_axis_rules) after "
    "setting fsm's rules",
    match='Tuples differ: () !=',
  ),
  Expected(
    'linen.partitioning_test.PartitioningTest.test_with_sharding_constraint',
    'internal',
    _FLAX_WSC,
    match='Actual: not called.',
  ),
  Expected(
    'linen.partitioning_test.PartitioningTest.test_with_sharding_constraint_fallback',
    'internal',
    _FLAX_WSC,
    match='Actual: not called.',
  ),
  Expected(
    'nnx.bridge.module_test.TestBridgeModule.test_metadata',
    'internal',
    "bridge.with_partitioning is hard-wired to flax's meta.Partitioned "
    "(linen_meta_type); fsm has no bridge initializer, so the box is not fsm's",
    match="is not an instance of <class 'flax_shardmeta._boxes.Partitioned'>",
  ),
)
"""Every selected test that fails on fsm. None is a 'defect' now; a failure
caused by an fsm bug goes here as one until the bug is fixed."""


# ---------------------------------------------------------------------------
# Tables to cases.


def _ids(
  table: dict[str, dict[str, str]], every_version: bool = False
) -> dict[str, list[str]]:
  """Flax test ids per file, as 'path.module.Class.test' (of the installed
  flax only, unless ``every_version``)."""
  out: dict[str, list[str]] = {}
  for path, classes in table.items():
    module = path.removesuffix('.py').replace('/', '.')
    out[path] = [
      f'{module}.{cls}.{name}'
      for cls, names in classes.items()
      for name in names.split()
      if every_version or _in_version(f'{module}.{cls}.{name}')
    ]
  return out


def _holds(when: str) -> bool:
  """Whether the installed stack meets ``when`` ('jax>=0.12'; '' always)."""
  if not when:
    return True
  required = Requirement(when)
  installed = importlib.metadata.version(required.name)
  return required.specifier.contains(Version(installed), prereleases=True)


def _in_version(test_id: str) -> bool:
  return _holds(ONLY_IN.get(test_id, ''))


def _expected(test_id: str) -> Expected | None:
  found = [e for e in EXPECTED_FAILURES if e.test == test_id and _holds(e.when)]
  if len(found) > 1:
    raise ValueError(f'{test_id} is listed {len(found)} times for flax {FLAX_VERSION}')
  return found[0] if found else None


SELECTED = {**_ids(WHOLE_FILES), **_ids(PICKED)}
CASES = [test_id for ids in SELECTED.values() for test_id in ids]
LISTED = [t for t in CASES if _expected(t) is not None]
"""The selected tests expected to fail with the installed flax."""


def _node_id(test_id: str) -> str:
  """pytest's node id of a flax test, relative to the sdist's root."""
  module, cls, name = test_id.rsplit('.', 2)
  return f'tests/{module.replace(".", "/")}.py::{cls}::{name}'


# ---------------------------------------------------------------------------
# Fetching, rewriting and running flax's tests.

SHIM_PACKAGE = 'flax_conformance'
SHIMS = {
  'flax.linen': 'shim_linen',
  'flax.linen.partitioning': 'shim_partitioning',
  'flax.core.meta': 'shim_meta',
  'flax.nnx': 'shim_nnx',
}
"""The flax modules a shim stands for, and the shim."""

RENAMED: dict[str, set[str]] = {
  'flax.linen': {
    'Partitioned', 'LogicallyPartitioned', 'PARTITION_NAME', 'with_partitioning',
    'with_logical_partitioning', 'get_partition_spec', 'get_sharding', 'unbox',
    'logical_axis_rules', 'set_logical_axis_rules', 'get_logical_axis_rules',
    'logical_to_mesh_axes', 'logical_to_mesh', 'logical_to_mesh_sharding',
    'with_logical_constraint', 'partitioning',
  },
  'flax.linen.partitioning': {
    'axis_rules', 'get_axis_rules', 'set_axis_rules', 'logical_to_mesh_axes',
    'logical_to_mesh', 'with_sharding_constraint', 'RulesFallback',
  },
  'flax.core.meta': {
    'Partitioned', 'PARTITION_NAME', 'with_partitioning', 'get_partition_spec',
    'get_sharding', 'unbox', 'replace_boxed',
  },
  'flax.nnx': {
    'with_partitioning', 'get_partition_spec', 'get_named_sharding',
    'eval_shape', 'as_abstract', 'abstract_with_sharding', 'logical_axis_rules',
    'PARTITION_NAME',
  },
}  # fmt: skip
"""The names each shim replaces by fsm's (checked against the shims)."""


RUN_TIMEOUT = 900
"""Seconds one pytest run of flax's tests may take."""


class ImportRewriteError(ValueError):
  """An import of a shimmed flax module the rewrite cannot express."""


def _import_statements(node: ast.Import | ast.ImportFrom) -> list[str] | None:
  """The statements replacing ``node`` (None: it imports nothing shimmed)."""

  def alias_text(a: ast.alias) -> str:
    return a.name if a.asname is None else f'{a.name} as {a.asname}'

  if isinstance(node, ast.Import):
    if not any(a.name in SHIMS for a in node.names):
      return None
    out = []
    for a in node.names:
      if a.name not in SHIMS:
        out.append(f'import {alias_text(a)}')
      elif a.asname is None:
        raise ImportRewriteError(
          f'line {node.lineno}: `import {a.name}` binds `flax`, not the module; '
          f'only `import {a.name} as name` can be shimmed.'
        )
      else:
        out.append(f'from {SHIM_PACKAGE} import {SHIMS[a.name]} as {a.asname}')
    return out
  if node.level or node.module is None:
    return None
  # `from flax.linen import partitioning` imports a shimmed module itself;
  # `from flax.linen import Partitioned` a renamed name of one.
  modules = [a for a in node.names if f'{node.module}.{a.name}' in SHIMS]
  renamed = [
    a for a in node.names if a not in modules and a.name in RENAMED.get(node.module, ())
  ]
  if not modules and not renamed:
    return None
  kept = [alias_text(a) for a in node.names if a not in modules + renamed]
  out = [f'from {node.module} import {", ".join(kept)}'] if kept else []
  if renamed:
    names = ', '.join(alias_text(a) for a in renamed)
    out.append(f'from {SHIM_PACKAGE}.{SHIMS[node.module]} import {names}')
  for a in modules:
    shim = SHIMS[f'{node.module}.{a.name}']
    out.append(f'from {SHIM_PACKAGE} import {shim} as {a.asname or a.name}')
  return out


def rewrite_imports(source: str) -> tuple[str, list[tuple[str, str]]]:
  """``source`` with its imports of shimmed flax modules importing the shims.

  Only import statements change; each stays on its line(s) (several
  statements joined by ``;``, the extra lines of a multi-line import left
  blank), so line numbers in tracebacks are flax's.

  Returns:
    The new source and the (old, new) text of each rewritten statement.
  """
  lines = source.splitlines(keepends=True)
  changes = []
  for node in ast.walk(ast.parse(source)):
    if not isinstance(node, ast.Import | ast.ImportFrom):
      continue
    statements = _import_statements(node)
    if statements is None:
      continue
    first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1
    head, tail = lines[first][: node.col_offset], lines[last][node.end_col_offset :]
    if head.strip() or tail.strip():
      raise ImportRewriteError(
        f'line {node.lineno}: the import shares its line with other code.'
      )
    old = ''.join(lines[first : last + 1])
    new = head + '; '.join(statements)
    lines[first] = new + '\n'
    for i in range(first + 1, last + 1):
      lines[i] = '\n'
    changes.append((old.strip(), new.strip()))
  return ''.join(lines), changes


def _download_sdist(cache: Path) -> Path | str:
  """flax's sdist in ``cache`` (downloaded if absent), or why it cannot be."""
  name = f'flax-{FLAX_VERSION}.tar.gz'
  if (cache / name).exists():
    return cache / name
  with tempfile.TemporaryDirectory(dir=cache) as scratch:
    command = [sys.executable, '-m', 'pip', 'download', '--no-deps']
    command += ['--no-binary', ':all:', f'flax=={FLAX_VERSION}', '-d', scratch]
    try:
      done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
      return f'`pip download flax=={FLAX_VERSION}` took more than 10 minutes'
    got = Path(scratch) / name
    if done.returncode != 0 or not got.exists():
      output = (done.stderr or done.stdout).strip().splitlines()
      errors = [line for line in output if line.startswith('ERROR')] or output[-3:]
      return f'`pip download flax=={FLAX_VERSION}` failed: ' + ' / '.join(errors)
    # Renamed into place whole, so a concurrent run never reads half a file.
    os.replace(got, cache / name)
  return cache / name


def _extract(sdist: Path, into: Path) -> Path:
  """The sdist's tests/ and pyproject.toml (flax's pytest settings) in ``into``."""
  top = f'flax-{FLAX_VERSION}/'
  with tarfile.open(sdist) as tar:
    members = [
      m
      for m in tar.getmembers()
      if m.name.startswith(top + 'tests/') or m.name == top + 'pyproject.toml'
    ]
    tar.extractall(into, members=members, filter='data')
  return into / top


@dataclasses.dataclass(frozen=True)
class Outcome:
  """What one flax test did: 'passed', 'failed' or 'skipped', and the text."""

  outcome: str
  details: str = ''


@dataclasses.dataclass
class Run:
  """One pytest run of flax test files.

  Attributes:
    outcomes: by flax test id.
    errors: what went wrong outside the tests (collection errors, a crash, a
      timeout); a test with no outcome is explained here.
  """

  outcomes: dict[str, Outcome]
  errors: list[str]


def _read_junit(path: Path) -> Run:
  """A run's outcomes from pytest's junit XML."""
  run = Run({}, [])
  for case in ET.parse(path).getroot().iter('testcase'):
    text = '\n'.join(
      f'{c.get("message", "")}\n{c.text or ""}'.strip()
      for c in case
      if c.tag in ('failure', 'error', 'skipped')
    )
    if not case.get('classname'):  # a file that could not be collected
      run.errors.append(f'{case.get("name")}: {text}')
      continue
    # 'tests.nnx.spmd_test.TestSPMD' + 'test_init' -> 'nnx.spmd_test.TestSPMD.test_init'
    test_id = f'{case.get("classname", "").removeprefix("tests.")}.{case.get("name")}'
    tags = {c.tag for c in case}
    if tags & {'failure', 'error'}:
      run.outcomes[test_id] = Outcome('failed', text)
    elif 'skipped' in tags:
      run.outcomes[test_id] = Outcome('skipped', text)
    else:
      run.outcomes[test_id] = Outcome('passed')
  return run


def _pytest(root: Path, name: str, targets: list[str]) -> Run:
  """Runs flax test files or tests (``targets``, relative to ``root``) under
  pytest with flax's settings and the plugin of ``flax_conformance``."""
  junit = root / f'{name}.xml'
  command = [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider']
  command += ['-p', f'{SHIM_PACKAGE}.plugin', '-c', str(root / 'pyproject.toml')]
  command += ['--rootdir', str(root), '--continue-on-collection-errors']
  command += [f'--junitxml={junit}', *targets]
  # The run is its own pytest session: nothing of this one's settings leaks in.
  env = {k: v for k, v in os.environ.items() if not k.startswith('PYTEST_')}
  env['PYTHONPATH'] = os.pathsep.join(
    filter(None, [str(Path(__file__).parent), env.get('PYTHONPATH')])
  )
  try:
    done = subprocess.run(
      command, cwd=root, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT
    )
  except subprocess.TimeoutExpired:
    return Run({}, [f'{name}: pytest ran over {RUN_TIMEOUT} s'])
  run = _read_junit(junit) if junit.exists() else Run({}, [])
  if done.returncode not in (0, 1) or not run.outcomes:
    output = (done.stdout + done.stderr).strip().splitlines()[-40:]
    run.errors.append(f'{name}: pytest exited {done.returncode}:\n' + '\n'.join(output))
  return run


def _targets(files: list[str]) -> list[str]:
  """pytest targets of the selection in ``files``: a whole file, or its tests."""
  targets = []
  for file in files:
    if file in WHOLE_FILES:
      targets.append(f'tests/{file}')
    else:
      targets += [_node_id(t) for t in SELECTED[file]]
  return targets


def _run_all(sdist: Path, workdir: Path) -> tuple[Run, Run]:
  """The selection on fsm, and the listed failures on flax itself.

  The fsm run is one process per front end (NNX files, the others), so both
  CPUs of a small machine work; flax's run is a third.
  """
  on_fsm = _extract(sdist, workdir / 'fsm')
  for file in SELECTED:
    path = on_fsm / 'tests' / file
    source, changes = rewrite_imports(path.read_text())
    if not changes:
      raise ImportRewriteError(f'tests/{file}: no import of a shimmed module')
    path.write_text(source)
  on_flax = _extract(sdist, workdir / 'flax')
  nnx_files = [f for f in SELECTED if f.startswith('nnx/')]
  other_files = [f for f in SELECTED if not f.startswith('nnx/')]
  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    fsm_runs = [
      pool.submit(_pytest, on_fsm, 'fsm-nnx', _targets(nnx_files)),
      pool.submit(_pytest, on_fsm, 'fsm-linen', _targets(other_files)),
    ]
    flax_targets = [_node_id(t) for t in LISTED]
    flax_run = pool.submit(_pytest, on_flax, 'flax', flax_targets) if LISTED else None
    on_fsm_run = Run({}, [])
    for job in fsm_runs:
      part = job.result()
      on_fsm_run.outcomes.update(part.outcomes)
      on_fsm_run.errors += part.errors
    return on_fsm_run, flax_run.result() if flax_run else Run({}, [])


def _shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
  """A directory for this test run, shared by its pytest-xdist workers.

  Their base temporary directories are siblings, removed with them.
  """
  run = os.environ.get('PYTEST_XDIST_TESTRUNUID')
  if run is None:
    return tmp_path_factory.mktemp('flax-conformance')
  shared = tmp_path_factory.getbasetemp().parent / f'flax-conformance-{run}'
  shared.mkdir(exist_ok=True)
  return shared


def _sdist_cache(config: pytest.Config) -> Path:
  """Where the sdist is kept between test runs: pytest's cache directory."""
  cache = getattr(config, 'cache', None)
  if cache is not None:
    return cache.mkdir('flax-sdist')
  fallback = Path(tempfile.gettempdir()) / 'flax-shardmeta-flax-sdist'
  fallback.mkdir(exist_ok=True)
  return fallback


@dataclasses.dataclass
class Runs:
  """The selection on fsm (rewritten), the listed failures on flax (as
  shipped), and the extracted, unrewritten test files."""

  fsm: Run
  flax: Run
  tests: Path


def _run_to_json(run: Run) -> dict[str, Any]:
  outcomes = {k: dataclasses.asdict(v) for k, v in run.outcomes.items()}
  return {'outcomes': outcomes, 'errors': run.errors}


def _run_from_json(data: dict[str, Any]) -> Run:
  return Run({k: Outcome(**v) for k, v in data['outcomes'].items()}, data['errors'])


@pytest.fixture(scope='session')
def runs(
  request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Runs:
  """The runs, done once per test run (pytest-xdist workers share them)."""
  shared = _shared_dir(tmp_path_factory)
  with open(shared / 'lock', 'w') as lock:
    # The first worker runs; the others wait here and read its results.
    fcntl.flock(lock, fcntl.LOCK_EX)
    results = shared / 'results.json'
    if not results.exists():
      sdist = _download_sdist(_sdist_cache(request.config))
      if isinstance(sdist, str):
        data: dict[str, Any] = {'skip': sdist}
      else:
        on_fsm, on_flax = _run_all(sdist, shared)
        data = {
          'skip': None,
          'fsm': _run_to_json(on_fsm),
          'flax': _run_to_json(on_flax),
          'tests': str(shared / 'flax' / f'flax-{FLAX_VERSION}' / 'tests'),
        }
      results.write_text(json.dumps(data))
    data = json.loads(results.read_text())
  if data['skip']:
    pytest.skip(data['skip'])
  return Runs(
    _run_from_json(data['fsm']), _run_from_json(data['flax']), Path(data['tests'])
  )


# ---------------------------------------------------------------------------
# The tests.


def verdict(
  flax_test: str, result: Outcome | None, expected: Expected | None
) -> tuple[str, str]:
  """What a flax test's result on fsm means for its case here.

  Returns:
    ('pass' | 'fail' | 'skip' | 'xfail', the message).
  """
  if result is None:
    return 'fail', (
      f"{flax_test}: no result in flax {FLAX_VERSION}'s tests (renamed or "
      'removed? update the selection)'
    )
  if result.outcome == 'skipped':
    return 'skip', f'flax skips it: {result.details}'
  if expected is None:
    if result.outcome == 'passed':
      return 'pass', ''
    return 'fail', f'{flax_test} fails on fsm:\n{result.details}'
  listed = f'({expected.category}: {expected.reason})'
  if result.outcome == 'passed':
    return 'fail', (
      f'{flax_test} now passes on fsm: remove it from EXPECTED_FAILURES {listed}.'
    )
  if expected.match not in result.details:
    return 'fail', (
      f'{flax_test} fails, but without {expected.match!r} as listed {listed}:\n'
      f'{result.details}'
    )
  return 'xfail', f'{expected.category}: {expected.reason}'


@pytest.mark.parametrize('flax_test', CASES)
def test_flax_test_on_fsm(flax_test: str, runs: Runs) -> None:
  action, message = verdict(
    flax_test, runs.fsm.outcomes.get(flax_test), _expected(flax_test)
  )
  if action == 'fail':
    pytest.fail('\n'.join([message, *runs.fsm.errors]), pytrace=False)
  if action == 'skip':
    pytest.skip(message)
  if action == 'xfail':
    pytest.xfail(message)


def test_verdicts() -> None:
  """A listed test that passes, or fails otherwise than listed, fails its case."""
  listed = Expected('m.C.test_a', 'difference', 'why', match='ValueError: x')
  fails_as_listed = Outcome('failed', 'E   ValueError: x is wrong')
  assert verdict('m.C.test_a', Outcome('passed'), None) == ('pass', '')
  assert verdict('m.C.test_a', fails_as_listed, listed) == (
    'xfail',
    'difference: why',
  )
  action, message = verdict('m.C.test_a', Outcome('passed'), listed)
  assert action == 'fail' and 'remove it from EXPECTED_FAILURES' in message
  action, message = verdict('m.C.test_a', Outcome('failed', 'TypeError'), listed)
  assert action == 'fail' and "without 'ValueError: x' as listed" in message
  assert verdict('m.C.test_a', fails_as_listed, None)[0] == 'fail'
  assert verdict('m.C.test_a', None, None)[0] == 'fail'
  assert verdict('m.C.test_a', Outcome('skipped', 'no TPU'), listed)[0] == 'skip'


def test_listed_failures_pass_on_flax(runs: Runs) -> None:
  """Each test of EXPECTED_FAILURES passes on flax itself, unrewritten (so the
  failure is fsm's, not flax's or the machine's), except the 'both' ones,
  which must fail there too."""
  wrong = {}
  for t in LISTED:
    on_flax = runs.flax.outcomes.get(t)
    expected = _expected(t)
    fails_on_flax = expected is not None and expected.category == 'both'
    if on_flax is None or on_flax.outcome != ('failed' if fails_on_flax else 'passed'):
      wrong[t] = on_flax or Outcome('no result')
  assert not wrong, (
    f'on flax {FLAX_VERSION} itself, against EXPECTED_FAILURES: '
    + '\n'.join(f'{t}: {r.outcome}\n{r.details}' for t, r in wrong.items())
    + '\n'.join(runs.flax.errors)
  )


def test_whole_files_are_selected_whole(runs: Runs) -> None:
  """A test flax adds to a WHOLE_FILES file must be added to the selection."""
  for file, listed in _ids(WHOLE_FILES).items():
    module = file.removesuffix('.py').replace('/', '.') + '.'
    found = {t for t in runs.fsm.outcomes if t.startswith(module)}
    assert found == set(listed), (
      f'tests/{file} of flax {FLAX_VERSION}: not selected '
      f'{sorted(found - set(listed))}, selected but absent '
      f'{sorted(set(listed) - found)}\n' + '\n'.join(runs.fsm.errors)
    )


def test_picked_files_have_no_unreviewed_metadata_test(runs: Runs) -> None:
  """Each test of a PICKED file named like a metadata test is picked or in
  NOT_PICKED, so a new one in a later flax is looked at."""
  unreviewed = []
  for file in PICKED:
    module = file.removesuffix('.py').replace('/', '.')
    tree = ast.parse((runs.tests / file).read_text())
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
      for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef) or not fn.name.startswith('test'):
          continue
        test_id = f'{module}.{cls.name}.{fn.name}'
        picked = any(
          re.fullmatch(re.escape(test_id) + r'\d*', t) for t in SELECTED[file]
        )
        if PICK_BY_NAME.search(fn.name) and not picked and test_id not in NOT_PICKED:
          unreviewed.append(test_id)
  assert not unreviewed, (
    f'flax {FLAX_VERSION} tests named like metadata tests, neither in PICKED '
    f'nor in NOT_PICKED: {unreviewed}'
  )


def test_expected_failures_are_well_formed() -> None:
  selected = _ids({**WHOLE_FILES, **PICKED}, every_version=True).values()
  for e in EXPECTED_FAILURES:
    assert e.category in CATEGORIES, e
    assert e.reason and e.match, e
    assert any(e.test in ids for ids in selected), f'{e.test} is not selected'
    _holds(e.when)  # raises on a malformed requirement
    _expected(e.test)  # raises on one test listed twice for a version


def test_rewrite_changes_only_imports() -> None:
  source = (
    'import os\n'
    'from flax import linen as nn, struct\n'
    'from flax.core import init, lift, meta, nn as core_nn\n'
    'import flax.linen as nn2\n'
    'from flax.linen import partitioning\n'
    'from flax.nnx import bridge\n'
    'from flax.linen import Dense, Partitioned as P\n'
    'def f():\n'
    '  from flax import nnx\n'
    '  return nn.Partitioned, nnx\n'
  )
  new, changes = rewrite_imports(source)
  assert new.splitlines() == [
    'import os',
    'from flax import struct; from flax_conformance import shim_linen as nn',
    'from flax.core import init, lift, nn as core_nn; '
    'from flax_conformance import shim_meta as meta',
    'from flax_conformance import shim_linen as nn2',
    'from flax_conformance import shim_partitioning as partitioning',
    'from flax.nnx import bridge',
    'from flax.linen import Dense; '
    'from flax_conformance.shim_linen import Partitioned as P',
    'def f():',
    '  from flax_conformance import shim_nnx as nnx',
    '  return nn.Partitioned, nnx',
  ]
  assert len(changes) == 6
  with pytest.raises(ImportRewriteError, match='binds `flax`'):
    rewrite_imports('import flax.linen\n')


def test_shims_change_only_sharding_names() -> None:
  """Every name of each flax module is in its shim, flax's own unless renamed."""
  sys.path.insert(0, str(Path(__file__).parent))
  try:
    for module_name, shim_name in SHIMS.items():
      flax_module = importlib.import_module(module_name)
      shim = importlib.import_module(f'{SHIM_PACKAGE}.{shim_name}')
      assert RENAMED[module_name] <= set(vars(flax_module)), module_name
      for name, value in vars(flax_module).items():
        if name.startswith('__'):
          continue
        assert hasattr(shim, name), f'{shim_name} lacks {module_name}.{name}'
        if name in RENAMED[module_name]:
          # fsm's PARTITION_NAME is flax's string; the rest are fsm's objects.
          assert isinstance(value, str) or getattr(shim, name) is not value, name
        else:
          assert getattr(shim, name) is value, f"{shim_name}.{name} is not flax's"
  finally:
    sys.path.remove(str(Path(__file__).parent))
    for name in [m for m in sys.modules if m.startswith(SHIM_PACKAGE)]:
      del sys.modules[name]
