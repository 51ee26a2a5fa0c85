"""Imports point one way: down the layers of the package.

Each internal module may import only modules in lower layers (at module level
or inside a function); the public ``__init__`` only re-exports. Modules under
``if TYPE_CHECKING:`` are exempt: they cost nothing at run time.
"""

import ast
import pathlib

import flax_shardmeta

PACKAGE = pathlib.Path(flax_shardmeta.__file__).parent

# Lowest first. A module may import any module of an earlier layer, or of its
# own layer when listed before it.
LAYERS = [
  # The core: vocabulary -> rules -> placement -> boxes -> shardings -> constraints.
  ['_typing', '_specs', '_caches', '_frames', '_arrays', '_views'],
  ['_problem', '_error_pages', '_errors'],
  ['_units', '_memory_kinds'],
  # _programs: what jax traces and XLA compiles, read in one place.
  [
    '_programs.memory',
    '_programs.hosts',
    '_programs.jaxprs',
    '_programs.source_map',
    '_programs.name_stacks',
    '_programs.hlo_text',
    '_programs.compiled_text',
    '_programs.buffers',
  ],
  # How the rules enter jax.jit's cache key (the rule context sets it).
  ['_jit_key'],
  ['_names', '_unmapped', '_axis_typos'],
  ['_rules'],
  ['_resolution', '_standard_rules'],
  ['_validate'],
  ['_placement'],
  ['_explicit'],
  # _generate: one parameter made where it lives; the boxes call it.
  ['_generate.loops', '_generate.jaxpr_graph', '_generate.windowed', '_generate.fill'],
  ['_generate.generate'],
  # flax's view of fsm's rules: the Linen boxes hand it to nnx.bridge, the NNX
  # adapter writes it into Variables' metadata.
  ['_flax_adapter'],
  ['_boxes'],
  ['_paths'],
  ['_annotation'],
  # The Linen front end's readers, loaded by _annotation on its first box.
  ['_linen'],
  ['_sharding'],
  ['_abstract'],
  ['_spec_trees', '_constraints', '_regex_rules'],
  # _init: a whole init as one program, each parameter made by _generate.
  ['_init.sharded_init'],
  # _jit: fsm.jit.
  ['_jit.graph', '_jit.jit'],
  # _planning: whole-layout plans.
  ['_planning.explain', '_planning.format', '_planning.entry'],
  ['_planning.sharding_plan', '_planning.verify', '_planning.step_arguments'],
  # _devices: what the chips are, GPU clusters and TPU topologies, meshes over
  # their devices; below both _hosts and _capacity.
  [
    '_devices.quiet',
    '_devices.simulated',
    '_devices.chips',
    '_devices.gpu',
    '_devices.topology',
  ],
  # _restore: restoring a checkpoint onto another mesh, on plans' vocabulary.
  [
    '_restore.chunks',
    '_restore.checksums',
    '_restore.damage',
    '_restore.checkpoint',
    '_restore.reads',
    '_restore.schedule',
    '_restore.plan_text',
    '_restore.casts',
    '_restore.inputs',
    '_restore.targets',
    '_restore.reading_plan',
    '_restore.restore',
    '_restore.save',
  ],
  # _capacity: what a whole step costs, in its vocabulary.
  [
    '_capacity.vocabulary',
    '_capacity.fit.figure_cache',
    '_capacity.fit.donation',
    '_capacity.fit.host_memory',
    '_capacity.fit.host_side',
  ],
  # The memory a GPU run gives XLA, and compiling for it.
  ['_capacity.fit.usable'],
  # Layouts inside a traced step, the layout changes its constraints ask for,
  # and the lines that route tokens to experts.
  [
    '_capacity.estimate.propagate',
    '_capacity.why.layout_changes',
    '_capacity.why.routing_lines',
  ],
  # The compiled program's text: read, its data flow, why each collective is
  # there, then its loops, collectives and work.
  [
    '_capacity.why.traced_lines',
    '_capacity.fit.offload',
    '_capacity.hlo.flow',
    '_capacity.hlo.attribution',
    '_capacity.hlo.trip_counts',
    '_capacity.hlo.collectives',
    '_capacity.hlo.work',
    '_capacity.hlo.summary',
    '_capacity.peak.experts',
  ],
  [
    '_capacity.hlo.roofline',
    '_capacity.why.readable',
    '_capacity.estimate.unplaced',
    '_capacity.peak.rows',
    '_capacity.report_text',
    '_capacity.report',
  ],
  ['_capacity.suggest.presets', '_capacity.suggest.offload_presets'],
  # The step, the estimate without a compiler, the compiled figures, fit.
  [
    '_capacity.fit.traced_step',
    '_capacity.fit.host_report',
    '_capacity.peak.values',
    '_capacity.peak.holders',
    '_capacity.estimate.coverage',
    '_capacity.estimate.liveness',
    '_capacity.estimate.estimator',
  ],
  [
    '_capacity.fit.compiled_figures',
    '_capacity.fit.compiling',
    '_capacity.fit.compiled',
    '_capacity.fit.extrapolate',
    '_capacity.fit.gpu_verdict',
    '_capacity.fit.fit',
  ],
  [
    '_capacity.suggest.candidate',
    '_capacity.suggest.search',
    '_capacity.suggest.ranking',
    '_capacity.suggest.suggestions',
  ],
  # _snapshot: golden files of a step's layout, from fit's reading of it.
  ['_snapshot.schema', '_snapshot.compare', '_snapshot.record'],
  # _audit: a step written for Auto axes, traced on Explicit ones; the
  # compiled programs read as _capacity reads them.
  [
    '_audit',
    '_audit.intercept',
    '_audit.arguments',
    '_audit.replay',
    '_audit.figures',
    '_audit.rewrite',
    '_audit.sites',
  ],
  ['_audit.notes', '_audit.audit_text', '_audit.tracing', '_audit.audit_explicit'],
  # _hosts: devices, processes, data and transfers.
  ['_hosts.launch', '_hosts.mesh', '_hosts.data'],
  ['_hosts.transfer'],
  # Adapters at the edges.
  ['_nnx.metadata', '_nnx.writing'],
  ['_nnx.reading', '_nnx.construct'],
  ['nnx'],
  # Test helpers: golden files of a step's layout.
  ['testing'],
  [
    'examples._model_names',
    'examples._common',
    'examples.linen',
    'examples.nnx',
    'examples.state',
    'examples.demo',
    'examples.moe',
  ],
  ['examples.train'],
  [
    'cli.process',
    'cli.options',
    'cli.checks',
    'cli.rule_files',
    'cli.factory',
    'cli.step',
    'cli.demo',
    'cli.plan',
    'cli.fit',
    'cli.audit',
    'cli.suggest',
    'cli.snapshot',
    'cli.diff',
    'cli.restore_plan',
    'cli.explain',
    'cli.main',
    'cli',
    '__main__',
  ],
]
ORDER = {m: i for i, m in enumerate(m for layer in LAYERS for m in layer)}
SUBPACKAGES = (
  '_generate',
  '_init',
  '_jit',
  '_planning',
  '_devices',
  '_capacity',
  '_hosts',
  '_nnx',
  '_restore',
  '_audit',
  '_snapshot',
  '_programs',
)
# The capacity layer's rooms, one concept each.
ROOMS = tuple(
  f'_capacity.{room}' for room in ('hlo', 'estimate', 'why', 'fit', 'suggest', 'peak')
)
PACKAGES = {'', 'examples', *SUBPACKAGES, *ROOMS}


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE).with_suffix('').parts
  if parts[-1] == '__init__':
    parts = parts[:-1]
  return '.'.join(parts)


def _type_checking_lines(tree: ast.AST) -> set[int]:
  lines: set[int] = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.If) and 'TYPE_CHECKING' in ast.unparse(node.test):
      for child in ast.walk(node):
        if hasattr(child, 'lineno'):
          lines.add(child.lineno)
  return lines


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
  """(line, flax_shardmeta module) for every import of the package's modules."""
  tree = ast.parse(path.read_text())
  skip = _type_checking_lines(tree)
  found = []
  for node in ast.walk(tree):
    if node.lineno in skip if hasattr(node, 'lineno') else True:
      continue
    if isinstance(node, ast.ImportFrom) and node.module:
      if node.module == 'flax_shardmeta':
        found += [(node.lineno, a.name) for a in node.names]
      elif node.module.startswith('flax_shardmeta.'):
        module = node.module.removeprefix('flax_shardmeta.')
        for a in node.names:  # `from flax_shardmeta.examples import linen`
          sub = f'{module}.{a.name}'
          found.append((node.lineno, sub if sub in ORDER else module))
    elif isinstance(node, ast.Import):
      found += [
        (node.lineno, a.name.removeprefix('flax_shardmeta.'))
        for a in node.names
        if a.name.startswith('flax_shardmeta.')
      ]
  return found


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for p in PACKAGE.rglob('*.py')}


def test_every_module_has_a_layer():
  missing = sorted(set(_modules()) - set(ORDER) - PACKAGES)
  assert not missing, f'add these modules to LAYERS: {missing}'


def test_imports_point_down_the_layers():
  wrong = []
  for name, path in _modules().items():
    if name in PACKAGES:
      continue  # package __init__ files only re-export or document
    for line, target in _imports(path):
      if target in ORDER and ORDER[target] >= ORDER[name]:
        wrong.append(f'{name}:{line} imports {target}')
  assert not wrong, 'imports against the layering:\n' + '\n'.join(wrong)


def test_the_check_sees_function_level_imports():
  # A lazy import inside a function would hide a cycle from Python itself.
  source = PACKAGE / '_restore' / 'reading_plan.py'
  assert any(target == '_restore.plan_text' for _, target in _imports(source))
  assert any(
    target == 'examples.nnx'
    for _, target in _imports(PACKAGE / 'examples' / 'state.py')
  )


def test_subpackages_say_what_they_may_import():
  # The layer a subpackage forms is documented where its modules live.
  for sub in SUBPACKAGES:
    doc = ast.get_docstring(ast.parse((PACKAGE / sub / '__init__.py').read_text()))
    assert doc and 'may import' in doc, f'{sub}/__init__.py: say what it may import'


# The parts above a whole init: plans, devices, steps, hosts and the adapters.
ABOVE_THE_INIT = (
  '_planning',
  '_devices',
  '_capacity',
  '_audit',
  '_hosts',
  '_jit',
  'nnx',
  'examples',
  'cli',
)
# What each part of the package never imports, whatever the layer order says.
NEVER = {
  # The core builds no plans and costs no steps.
  '': ABOVE_THE_INIT,
  # Making a parameter knows nothing of whole inits, plans, devices, steps,
  # hosts or adapters.
  '_generate': ('_init', *ABOVE_THE_INIT),
  # Creating values knows nothing of plans, devices, steps, hosts or adapters.
  '_init': ABOVE_THE_INIT,
  # Planning and capacity run on abstract meshes with no processes.
  '_planning': ('_devices', '_capacity', '_hosts', '_jit', 'nnx', 'examples', 'cli'),
  '_capacity': ('_audit', '_hosts', '_jit', 'nnx', 'examples', 'cli'),
  # Devices are described, not used: nothing of layouts, plans or steps.
  '_devices': ('_generate', '_init', *(p for p in ABOVE_THE_INIT if p != '_devices')),
  # Restore plans run on abstract meshes too: plans and device figures only.
  '_restore': ('_capacity', '_audit', '_hosts', '_jit', 'nnx', 'examples', 'cli'),
  # The audit compiles steps and reads them as the capacity layer does.
  '_audit': ('_hosts', '_jit', 'nnx', 'examples', 'cli'),
  '_jit': (
    '_planning',
    '_devices',
    '_capacity',
    '_audit',
    '_hosts',
    'nnx',
    'examples',
    'cli',
  ),
  # The NNX adapter's implementation serves the public nnx module, not a plan.
  '_nnx': ABOVE_THE_INIT,
}


def _part(name: str) -> str:
  head = name.split('.')[0]
  return head if '.' in name and head in SUBPACKAGES else ''


def test_each_part_never_imports_what_sits_above_it():
  wrong = [
    f'{name}:{line} imports {target}'
    for name, path in _modules().items()
    if name not in PACKAGES and name[:1] == '_' != name[1:2] and _part(name) in NEVER
    for line, target in _imports(path)
    if target.split('.')[0] in NEVER[_part(name)]
  ]
  assert not wrong, '\n'.join(wrong)
