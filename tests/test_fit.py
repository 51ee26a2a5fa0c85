"""``fsm.fit``: a training step's memory per chip, collectives and verdict.

On the 8 simulated CPU devices and on TPU topologies from libtpu (skipped only
where libtpu is missing; CI installs the ``tpu`` extra). Built-in steps use
Auto mesh axes, as the example models are written for.
"""

import json

import jax
import jax.numpy as jnp
import pytest
import treescope
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta import examples
from flax_shardmeta._capacity.fit import (
  compiling as compiling_lib,
  figure_cache as cache_lib,
  traced_step as step_lib,
)
from flax_shardmeta._devices import topology
from flax_shardmeta._devices.chips import chip_named
from flax_shardmeta._units import parse_bytes
from flax_shardmeta.examples import train

AUTO = (AxisType.Auto,) * 2
MEMORY_FIELDS = (
  'argument_size_in_bytes',
  'output_size_in_bytes',
  'alias_size_in_bytes',
  'temp_size_in_bytes',
  'generated_code_size_in_bytes',
)


def cpu_mesh():
  return jax.make_mesh((2, 4), ('data', 'model'), axis_types=AUTO)


def pod_mesh(name, shape):
  return fsm.make_mesh(shape, ('data', 'model'), topology=name, axis_types=AUTO)


def check_against_xla(report, step, state, batch):
  """fit's figures are XLA's own for the very same program."""
  direct = step.lower(state, batch).compile().memory_analysis()
  for field in MEMORY_FIELDS:
    assert report.memory_analysis[field] == getattr(direct, field), field
  m = report.memory_analysis
  assert report.total_bytes == (
    m['argument_size_in_bytes']
    + m['output_size_in_bytes']
    - m['alias_size_in_bytes']
    + m['temp_size_in_bytes']
    + m['generated_code_size_in_bytes']
  )
  # The breakdown adds up: to the total, and its argument rows to XLA's.
  assert sum(r.bytes for r in report.rows) == report.total_bytes
  assert report.argument_bytes == direct.argument_size_in_bytes
  assert report.donated_bytes == direct.alias_size_in_bytes


def expected_rows(state, mesh, rules):
  """Parameters and optimizer state per device, straight from the plan."""
  p = fsm.plan(state, mesh, rules)
  params = sum(e.bytes_per_device for e in p.entries if e.path.startswith('params/'))
  opt = sum(e.bytes_per_device for e in p.entries if e.path.startswith('opt_state/'))
  return params, opt


# On the CPU mesh
# ------------------------------------------------------------------------------


def test_figures_equal_xlas_on_the_cpu_mesh():
  mesh = cpu_mesh()
  step, state, batch = train.train_step('mlp', mesh, batch=64, dtype=jnp.float32)
  report = fsm.fit(step, state, batch, cache=False)
  check_against_xla(report, step, state, batch)
  params, opt = expected_rows(state, mesh, examples.model_rules('mlp'))
  assert report.row('parameters') == params == 4 * 1024 * 1024 * 2 * 4 // 4
  assert report.row('optimizer state') == opt  # adam's moments and step count
  # The batch (64 x 1024 float32 over 'data'=2) and TrainState.step.
  assert report.row('batch and other inputs') == 32 * 1024 * 4 + 4
  assert report.source == 'compiled' and report.fits is None  # CPU: no HBM size
  assert any('CPU' in note for note in report.notes)


def test_linen_train_state_and_nnx_optimizer_alike():
  mesh = cpu_mesh()
  linen = fsm.fit(*train.train_step('mlp', mesh, batch=64, dtype=jnp.float32))
  step, state, batch = train.train_step(
    'mlp', mesh, batch=64, api='nnx', dtype=jnp.float32
  )
  nnx = fsm.fit(step, state, batch)
  check_against_xla(nnx, step, state, batch)
  assert nnx.row('parameters') == linen.row('parameters') > 0
  # Both keep adam's moments; each adds its own step counters.
  assert abs(nnx.row('optimizer state') - linen.row('optimizer state')) <= 8
  assert nnx.row('optimizer state') >= 2 * nnx.row('parameters')


def test_hbm_gives_the_verdict_and_headroom():
  mesh = cpu_mesh()
  args = train.train_step('mlp', mesh, batch=64, dtype=jnp.float32)
  roomy = fsm.fit(*args, hbm='1GiB')
  tight = fsm.fit(*args, hbm=roomy.total_bytes - 1)
  assert roomy.fits and roomy.headroom_bytes == 2**30 - roomy.total_bytes
  assert 0 < roomy.headroom < 1
  assert tight.fits is False and tight.headroom_bytes == -1
  assert 'DOES NOT FIT' in str(tight) and 'FITS, headroom' in str(roomy)


def test_remat_trades_temporaries_for_recomputation():
  mesh = cpu_mesh()
  plain, full = (
    fsm.fit(*train.train_step('mlp', mesh, batch=64, dtype=jnp.float32, remat=r))
    for r in ('none', 'full')
  )
  assert full.row('temporaries') < plain.row('temporaries')
  assert full.row('parameters') == plain.row('parameters')
  assert full.flops > plain.flops  # the forward pass runs twice


def test_plain_jax_jit_under_set_mesh_with_boxed_arguments():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))  # Explicit axes, as jax defaults
  params = {
    'w': fsm.Partitioned(jax.ShapeDtypeStruct((512, 256), jnp.float32), (None, 'model'))
  }
  batch = fsm.Partitioned(jax.ShapeDtypeStruct((64, 512), jnp.float32), ('data', None))

  def step(params, x):
    return jnp.tanh(x @ fsm.unbox(params)['w']).sum()

  with jax.set_mesh(mesh):
    report = fsm.fit(jax.jit(step), params, batch, hbm='1MiB', cache=False)
    shardings = step_lib.prepare(step_lib.Step.of(jax.jit(step), 2), (params, batch))
  assert report.row('parameters') == 512 * 256 * 4 // 4
  assert report.row('batch and other inputs') == 64 * 512 * 4 // 2
  lowered_batch = shardings.lowered[1]  # the box around the batch is its layout
  assert isinstance(lowered_batch, jax.ShapeDtypeStruct)
  assert lowered_batch.sharding.spec == P('data', None)


def test_unlayable_annotations_raise_the_plans_error_not_xlas():
  mesh = cpu_mesh()
  params = {
    'w': fsm.Partitioned(jax.ShapeDtypeStruct((6, 8), jnp.float32), ('model', None))
  }
  step = fsm.jit(lambda p: fsm.unbox(p)['w'].sum(), mesh=mesh)
  with pytest.raises(fsm.ShardingError, match=r"p/w: shape \(6, 8\).*'model'=4"):
    fsm.fit(step, params)


@pytest.mark.parametrize('concrete', [True, False], ids=['compiled', 'estimate'])
def test_a_batch_its_in_shardings_cannot_split_names_the_argument(concrete):
  # Auto axes: 'batch' goes to 'data'=4, which a batch of 6 rows does not fill.
  sizes, names = (2, 4), ('model', 'data')
  mesh = (
    jax.make_mesh(sizes, names, axis_types=AUTO)
    if concrete
    else AbstractMesh(sizes, names, axis_types=AUTO)
  )
  step = fsm.jit(
    lambda params, batch: batch['tokens'].sum() * params['w'].sum(),
    mesh=mesh,
    rules=[('batch', 'data')],
    in_shardings=(None, ('batch', None)),
  )
  params = {'w': jax.ShapeDtypeStruct((4,), jnp.float32)}
  batch = {'tokens': jax.ShapeDtypeStruct((6, 16), jnp.int32)}
  with pytest.raises(fsm.ShardingError) as e:
    fsm.fit(step, params, batch, cache=False)
  assert str(e.value) == (
    '1 leaf cannot be sharded as annotated (in the arguments of the step):\n'
    "  - batch/tokens: shape (6, 16), names ('batch', None), spec P('data', None): "
    "dimension 0 of size 6 is not divisible by 'data'=4. Fix: make dimension 0 a "
    "multiple of 4 (e.g. 8), or map 'batch' to mesh axes that divide it in the "
    'rules (None replicates it)\n'
    '(what to do: flax-shardmeta explain ShardingError)'
  )
  assert e.value.problems[0].dims == (0,)


def test_fit_needs_a_mesh_and_well_formed_options():
  x = jax.ShapeDtypeStruct((8,), jnp.float32)
  with pytest.raises(fsm.NoMeshError, match='fit needs a mesh'):
    fsm.fit(jax.jit(lambda x: x * 2), x)
  with pytest.raises(fsm.FitError, match="hbm='lots'"):
    fsm.fit(jax.jit(lambda x: x), x, hbm='lots')
  with pytest.raises(fsm.FitError, match="chip='v99'.*v5p"):
    fsm.fit(jax.jit(lambda x: x), x, chip='v99')


def test_report_prints_serialises_and_renders():
  mesh = cpu_mesh()
  report = fsm.fit(
    *train.train_step('mlp', mesh, batch=64, dtype=jnp.float32), chip='v5p'
  )
  text = str(report)
  for line in ('parameters', 'optimizer state', 'temporaries', 'verdict: FITS'):
    assert line in text
  assert 'collectives per step' in text and 'all-reduce' in text
  assert report.roofline is not None and report.roofline.step_s > 0
  data = json.loads(json.dumps(report.to_dict()))
  assert data['fits'] is True and data['chip']['name'] == 'v5p'
  assert sum(r['bytes'] for r in data['rows']) == data['total_bytes']
  assert 'FITS' in treescope.render_to_text(report)


def test_the_cache_returns_the_same_figures(monkeypatch, tmp_path):
  monkeypatch.setenv('FLAX_SHARDMETA_CACHE', str(tmp_path))
  cache_lib.clear()
  mesh = cpu_mesh()
  args = train.train_step('mlp', mesh, batch=64, dtype=jnp.float32)
  first = fsm.fit(*args)
  cache_lib.clear()  # only the disk copy is left
  second = fsm.fit(*args)
  assert not first.cached and second.cached and second.compile_seconds == 0
  assert second.rows == first.rows and second.collectives == first.collectives
  assert second.peak() == first.peak()  # what holds the peak, from the cache too
  assert len(list(tmp_path.glob('*.json'))) == len(list(tmp_path.glob('*.hlo.gz'))) == 1
  other = fsm.fit(*train.train_step('mlp', mesh, batch=32, dtype=jnp.float32))
  assert not other.cached  # another program, another key


def test_a_deep_scanned_model_by_layers_has_the_whole_compiles_figures():
  # Compiled whole or extrapolated (which, and why: tests/test_fit_depth.py),
  # scanned layers give the figures of the whole compile.
  mesh = cpu_mesh()

  def build(n):
    return train.train_step('mlp', mesh, batch=64, dtype=jnp.float32, num_layers=n)

  fast = fsm.fit(build, layers=8)
  whole = fsm.fit(build, layers=8, exact=True)
  assert fast.rows == whole.rows and fast.total_bytes == whole.total_bytes
  assert [(c.kind, c.axes, c.count) for c in fast.collectives] == [
    (c.kind, c.axes, c.count) for c in whole.collectives
  ]
  assert fast.flops == pytest.approx(whole.flops, rel=1e-9)
  with pytest.raises(fsm.FitError, match='layers=0'):
    fsm.fit(build, layers=0)


# Estimates on abstract meshes
# ------------------------------------------------------------------------------


def test_estimate_on_an_abstract_mesh():
  mesh = AbstractMesh((32, 4), ('data', 'model'), axis_types=AUTO)
  step, state, batch = train.train_step('llama3-8b', mesh, batch=32, num_layers=2)
  plain = fsm.fit(step, state, batch, chip='v5p')
  full = fsm.fit(
    *train.train_step('llama3-8b', mesh, batch=32, num_layers=2, remat='full'),
    chip='v5p',
  )
  assert plain.source == 'estimate' and plain.memory_analysis is None
  params, opt = expected_rows(state, mesh, examples.model_rules('llama3-8b'))
  assert plain.row('parameters') == params and plain.row('optimizer state') >= opt
  assert plain.row('gradients') == params
  assert plain.row('batch and other inputs') == 2049 * 4 + 4  # a sequence, the step
  assert (
    0 < full.row('activations and workspace') < plain.row('activations and workspace')
  )
  assert plain.fits is True and plain.hbm_bytes == chip_named('v5p').hbm_bytes
  assert 'estimate' in str(plain)


def test_estimate_is_exact_per_value_under_explicit_axes():
  mesh = AbstractMesh((2, 4), ('data', 'model'), axis_types=(AxisType.Explicit,) * 2)
  x = jax.ShapeDtypeStruct(
    (1024, 1024), jnp.float32, sharding=NamedSharding(mesh, P('data', 'model'))
  )

  def step(x):
    y = jnp.sin(x) * 2  # sharded like x
    return (y * jnp.cos(y)).sum()

  with jax.sharding.use_abstract_mesh(mesh):
    report = fsm.fit(jax.jit(step), x, hbm='1GiB')
  shard = 1024 * 1024 * 4 // 8
  assert report.row('batch and other inputs') == shard
  # Nothing in this step is ever replicated: the peak is a few shards, far
  # below one replicated 4 MiB copy.
  assert report.row('activations and workspace') < 4 * shard
  assert not any('counted replicated' in n for n in report.notes)


# On TPU topologies (libtpu)
# ------------------------------------------------------------------------------


@pytest.mark.libtpu
@pytest.mark.parametrize(
  'name, shape',
  [('v5p:2x2x1', (2, 2)), pytest.param('v6e:2x4', (2, 4), marks=pytest.mark.slow)],
  ids=['v5p', 'v6e'],
)
def test_figures_equal_xlas_on_tpu_topologies(name, shape):
  mesh = pod_mesh(name, shape)
  step, state, batch = train.train_step('mlp', mesh, batch=64)
  report = fsm.fit(step, state, batch)
  check_against_xla(report, step, state, batch)
  chip = report.chip
  assert chip is not None and report.hbm_bytes == chip.hbm_bytes
  assert report.fits is True and report.roofline is not None
  # TPU pads small arrays to tiles: that is the argument padding row.
  assert report.row('argument padding') >= 0
  text = step.lower(state, batch).compile().as_text()
  in_text = sum(
    text.count(f' {kind}(') + text.count(f' {kind}-start(')
    for kind in (
      'all-gather',
      'reduce-scatter',
      'all-reduce',
      'all-to-all',
      'collective-permute',
    )
  )
  assert in_text > 0
  # Loops of the scanned layers run their collectives every trip.
  assert sum(c.count for c in report.collectives) >= in_text
  # One slice: every collective is on the chips' own interconnect.
  assert {c.link for c in report.collectives} == {'ici'}
  assert {r['link'] for r in report.to_dict()['collectives']} == {'ici'}


@pytest.mark.libtpu
def test_collectives_across_slices_are_on_the_data_centre_network():
  mesh = fsm.make_mesh((2, 4), ('data', 'model'), topology='v5p:2x2x1', num_slices=2)
  step, state, batch = train.train_step('mlp', mesh, batch=64)
  links = {c.axes: c.link for c in fsm.fit(step, state, batch).collectives}
  assert links[('data',)] == 'dcn' and links[('model',)] == 'ici'


@pytest.mark.libtpu
@pytest.mark.slow
def test_nnx_optimizer_step_on_a_topology():
  mesh = pod_mesh('v5p:2x2x1', (2, 2))
  linen = fsm.fit(*train.train_step('mlp', mesh, batch=64))
  step, state, batch = train.train_step('mlp', mesh, batch=64, api='nnx')
  nnx = fsm.fit(step, state, batch)
  check_against_xla(nnx, step, state, batch)
  assert nnx.row('parameters') == linen.row('parameters')


@pytest.mark.libtpu
def test_a_refused_program_is_a_verdict_not_an_exception():
  mesh = pod_mesh('v5e:2x2', (2, 2))  # 15.75 GiB per chip

  def step(s):
    n = 12_000_000_000  # two 48 GB temporaries per chip
    a = jnp.arange(n, dtype=jnp.float32) * s
    b = jnp.arange(n, dtype=jnp.float32) + s
    a, b = jax.lax.optimization_barrier((a, b))
    return (a * b).sum()

  s = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, P()))
  report = fsm.fit(fsm.jit(step, mesh=mesh), s)
  assert report.fits is False and report.refusal is not None
  assert report.refusal.available_bytes == pytest.approx(15.75 * 2**30, rel=1e-3)
  assert report.refusal.required_bytes > report.refusal.available_bytes
  assert report.total_bytes == report.refusal.required_bytes
  assert report.hbm_bytes == report.refusal.available_bytes
  assert 'the compiler needs' in str(report)


@pytest.mark.libtpu
def test_topology_meshes_and_their_errors(monkeypatch):
  mesh = fsm.make_mesh({'data': -1, 'model': 4}, topology='v5p:4x4x8')
  assert dict(mesh.shape) == {'data': 32, 'model': 4}
  assert {d.device_kind for d in mesh.devices.flat} == {'TPU v5'}
  assert len({d.process_index for d in mesh.devices.flat}) == 32  # 4 chips a host
  # 64 is no product of the torus's 4, 4 and 8: a physical axis is split.
  odd = fsm.make_mesh({'data': 64, 'model': 2}, topology='v5p:4x4x8')
  assert len({d.id for d in odd.devices.flat}) == 128
  sliced = fsm.make_mesh((4, 4), ('data', 'model'), topology='v5p:2x2x2', num_slices=2)
  by_row = [{d.slice_index for d in row} for row in sliced.devices]
  assert by_row == [{0}, {0}, {1}, {1}]  # 'data' spans the slices, 'model' does not
  v4 = fsm.make_mesh((4,), ('data',), topology='v4:2x2x1')
  assert len(v4.devices.flat) == 4  # one device per v4 chip, as on a v4 VM
  with pytest.raises(
    fsm.TopologyError, match=r"unknown accelerator 'v9' in topology 'v9:2x2'.*v5p"
  ):
    fsm.make_mesh((4,), ('data',), topology='v9:2x2')
  with pytest.raises(fsm.TopologyError, match="unknown topology 'v5p8'.*h100:4x8"):
    fsm.make_mesh((4,), ('data',), topology='v5p8')
  with pytest.raises(fsm.MeshShapeError, match='does not fit 4 devices'):
    fsm.make_mesh((8,), ('data',), topology='v5p:2x2x1')
  monkeypatch.setattr(topology, 'libtpu_available', lambda: False)
  with pytest.raises(fsm.TopologyError, match=r"pip install '\.\[tpu\]'"):
    fsm.make_mesh((8,), ('data',), topology='v5p:2x2x2')


def test_refusal_messages_are_read():
  r = compiling_lib.parse_refusal(
    'RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for '
    'HLO temporaries (252.84G) exceeds available HBM (95.74G).'
  )
  assert r is not None
  assert (r.required_bytes, r.available_bytes) == (
    int(252.84 * 2**30),
    int(95.74 * 2**30),
  )
  r = compiling_lib.parse_refusal(
    'RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory '
    'space hbm. Used 20.50G of 15.75G hbm. Exceeded hbm capacity by 4.75G.'
  )
  assert r is not None and r.required_bytes == int(20.5 * 2**30)
  assert compiling_lib.parse_refusal('INVALID_ARGUMENT: something else') is None


def test_sizes_parse():
  assert parse_bytes('95GiB') == 95 * 2**30
  assert parse_bytes('16 GB') == 16 * 10**9
  assert parse_bytes(123) == 123
  # A neutral error: each caller names its own argument, in its own error.
  with pytest.raises(fsm.SizeError, match="'12 parsecs' is not a size") as raised:
    parse_bytes('12 parsecs')
  assert not isinstance(raised.value, fsm.FitError)
  with pytest.raises(
    fsm.FitError, match="hbm='12 parsecs': '12 parsecs' is not a size"
  ):
    fsm.suggest(lambda *a: a, batch=8, hbm='12 parsecs', devices=jax.devices())


def test_explicit_axes_sharding_type_errors_are_named():
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(AxisType.Explicit,) * 2)
  w = jax.ShapeDtypeStruct(
    (64, 32), jnp.float32, sharding=NamedSharding(mesh, P('model', None))
  )
  x = jax.ShapeDtypeStruct(
    (8, 64), jnp.float32, sharding=NamedSharding(mesh, P(None, 'model'))
  )

  def step(x, w):
    return (x @ w).sum()  # contracts 'model': ambiguous on Explicit axes

  with jax.set_mesh(mesh):
    with pytest.raises(fsm.ExplicitShardingError, match=r'test_fit.py:\d+'):
      fsm.fit(step, x, w, cache=False)
    with pytest.raises(fsm.ExplicitShardingError, match='out_sharding'):
      fsm.fit(jax.jit(step), x, w, cache=False)


def test_rows_are_keyed_by_category_not_their_text():
  from flax_shardmeta._capacity.vocabulary import Category

  mesh = cpu_mesh()
  layout = NamedSharding(mesh, P('data'))
  x = jax.ShapeDtypeStruct((256, 64), jnp.float32, sharding=layout)
  with jax.set_mesh(mesh):
    report = fsm.fit(jax.jit(lambda a: a * 2), x, cache=False)
  assert report.row(Category.INPUTS) == report.row('batch and other inputs') > 0
  assert {r.name for r in report.rows} <= set(Category)
  # The JSON keeps the display text; a name that is no row is refused.
  assert 'batch and other inputs' in json.dumps(report.to_dict())
  with pytest.raises(fsm.FitError, match="no report row is called 'inputs'"):
    report.row('inputs')
