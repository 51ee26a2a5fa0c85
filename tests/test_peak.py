"""What holds the peak: ``FitReport.peak()`` splits fit's total per chip by
argument path, output and the values XLA's buffer assignment has alive at
the heap's peak. On the 8 simulated CPU devices (Auto mesh axes); TPU
topologies and GPU targets in the slow tests, skipped only where libtpu or
jax's CUDA plugin is missing (CI installs both).
"""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
import treescope
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta import cli
from flax_shardmeta._programs import buffers as buffers_lib

AUTO = (AxisType.Auto,) * 2
HIDDEN_LINE = 26  # the line of `hidden = ...` below: the activation's source


def loss(params, x):
  hidden = jnp.tanh(x @ params['w1'])  # saved for the backward pass
  return jnp.mean((hidden @ params['w2']) ** 2)


def step(params, x):
  grads = jax.grad(loss)(params, x)
  return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def remat_step(params, x):
  grads = jax.grad(jax.checkpoint(loss))(params, x)
  return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def arguments(mesh):
  def struct(shape, spec):
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))

  # The activation (batch x hidden) is 16x a parameter: it holds the peak.
  params = {
    'w1': struct((256, 4096), P(None, 'model')),
    'w2': struct((4096, 256), P('model', None)),
  }
  return params, struct((8192, 256), P('data', None))


@pytest.fixture(scope='module')
def mesh():
  return jax.make_mesh((2, 4), ('data', 'model'), axis_types=AUTO)


@pytest.fixture(scope='module')
def reports(mesh):
  params, x = arguments(mesh)
  with jax.set_mesh(mesh):
    plain = fsm.fit(jax.jit(step, donate_argnums=0), params, x, cache=False)
    remat = fsm.fit(jax.jit(remat_step, donate_argnums=0), params, x, cache=False)
  return plain, remat


def test_the_rows_add_up_to_fits_total(reports):
  for report in reports:
    peak = report.peak()
    assert sum(r.bytes for r in peak.rows) == report.total_bytes == peak.total_bytes
    assert peak.named_fraction >= 0.9
    assert peak.phase in ('forward', 'backward', 'optimizer update')


def test_parameters_by_path_with_their_bytes_per_chip(reports):
  rows = {(r.kind, r.what): r.bytes for r in reports[0].peak().rows}
  per_chip = 256 * 4096 * 4 // 4  # sharded 4 ways over 'model'
  assert rows[('parameter', 'params/w1')] == per_chip
  assert rows[('parameter', 'params/w2')] == per_chip
  assert rows[('batch and other inputs', 'x')] == 8192 * 256 * 4 // 2


def test_the_saved_activation_is_at_its_line_with_its_bytes(reports):
  peak = reports[0].peak()
  at_line = [
    r
    for r in peak.rows
    if r.where.endswith(f'test_peak.py:{HIDDEN_LINE}') and r.kind == 'activation'
  ]
  hidden_per_chip = 8192 * 4096 * 4 // 8  # batch over 'data', hidden over 'model'
  assert sum(r.bytes for r in at_line) >= hidden_per_chip, peak.format(top=20)
  assert peak.phase == 'backward'


def test_remat_shrinks_the_activation_and_the_diff_adds_up(reports):
  plain, remat = (r.peak() for r in reports)
  diff = plain.diff(remat)
  assert sum(r.change for r in diff.rows) == diff.change
  assert diff.change == remat.total_bytes - plain.total_bytes

  def saved(peak):
    return sum(
      r.bytes
      for r in peak.rows
      if r.kind == 'activation' and r.where.endswith(f'test_peak.py:{HIDDEN_LINE}')
    )

  assert saved(remat) < saved(plain)
  assert str(diff).startswith('peak ') and len(str(diff).splitlines()) > 1


def test_a_scanned_models_rows_say_their_layer_count(mesh):
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      w = self.param('w', nn.initializers.lecun_normal(), (256, 256))
      return jnp.tanh(x @ w), None

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      layers = nn.scan(
        Block, variable_axes={'params': 0}, split_rngs={'params': True}, length=6
      )
      return layers()(x, None)[0]

  model = Model()
  x = jax.ShapeDtypeStruct(
    (512, 256), jnp.float32, sharding=NamedSharding(mesh, P('data'))
  )
  params = jax.eval_shape(model.init, jax.random.key(0), x)['params']

  def train(params, x):
    grads = jax.grad(lambda p: jnp.mean(model.apply({'params': p}, x) ** 2))(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

  with jax.set_mesh(mesh):
    report = fsm.fit(jax.jit(train, donate_argnums=0), params, x, cache=False)
  peak = report.peak()
  assert sum(r.bytes for r in peak.rows) == report.total_bytes
  stacked = [r for r in peak.rows if r.layers == 6]
  assert stacked, peak.format(top=30)
  assert any('x 6 layers' in line for line in peak.format(top=30).splitlines())


def test_the_estimate_splits_the_arguments_and_says_what_it_cannot():
  mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'), axis_types=AUTO)
  params, x = arguments(mesh)
  with jax.sharding.use_abstract_mesh(mesh):
    report = fsm.fit(jax.jit(step, donate_argnums=0), params, x, chip='v5p')
  peak = report.peak()
  assert report.source == 'estimate'
  assert sum(r.bytes for r in peak.rows) == report.total_bytes
  assert {'params/w1', 'params/w2', 'x'} <= {r.what for r in peak.rows}
  assert any('estimate' in n for n in peak.notes)


def test_the_record_reads_back_and_renders(reports):
  peak = reports[0].peak()
  data = json.loads(json.dumps(peak.to_dict()))
  back = fsm.PeakMemory.from_dict(data)
  assert back.rows == peak.rows and back.total_bytes == peak.total_bytes
  assert fsm.PeakMemory.from_dict(reports[0].to_dict()).rows == peak.rows
  text = treescope.render_to_text(peak)
  assert 'parameter' in text and 'params/w1' in text
  assert 'tanh' in treescope.render_to_text(peak.diff(reports[1].peak()))


def test_the_buffer_assignment_is_xlas_temporaries_on_the_cpu(mesh):
  params, x = arguments(mesh)
  lowered = jax.jit(step).lower(params, x)
  compiled, found = buffers_lib.compile_dumped(lowered)
  assert found is not None
  assert found.temporaries == compiled.memory_analysis().temp_size_in_bytes
  assert 0 < found.live_bytes <= found.temporaries
  assert found.at_peak and found.peak_instruction


def test_a_report_that_does_not_fit_names_its_largest_rows(mesh):
  params, x = arguments(mesh)
  with jax.set_mesh(mesh):
    report = fsm.fit(
      jax.jit(step, donate_argnums=0), params, x, hbm='1MiB', cache=False
    )
  text = str(report)
  assert report.fits is False
  assert 'largest at the peak' in text


def test_the_command_line_prints_the_peak_and_diffs_against_a_saved_report(
  capsys, tmp_path
):
  args = ['fit', '--model', 'mlp', '--mesh', 'data=2,model=4', '--chip', 'v5p']
  assert cli.main([*args, '--batch', '64', '--format', 'json']) in (0, 1, 3)
  saved = tmp_path / 'before.json'
  saved.write_text(capsys.readouterr().out)
  code = cli.main([*args, '--batch', '128', '--peak', '--against', str(saved)])
  out = capsys.readouterr().out
  assert code in (0, 1, 3)
  assert 'What holds the peak' in out and '(before) against this step' in out
  assert cli.main([*args, '--against', str(saved)]) == 2
  assert '--against: goes with --peak' in capsys.readouterr().err


# On TPU topologies (libtpu) and GPU targets (jax's CUDA plugin)
# ------------------------------------------------------------------------------


def test_a_checkpoint_name_given_after_a_helper_names_the_helpers_row(mesh):
  from jax.ad_checkpoint import checkpoint_name

  def dense(x, w):
    return jnp.tanh(x @ w)  # the value the backward pass keeps is made here

  def helper_loss(params, x):
    hidden = dense(x, params['w1'])
    hidden = checkpoint_name(hidden, 'hidden')  # named a line later
    out = checkpoint_name(dense(hidden, params['w2']), 'out')  # another shape
    return jnp.mean(out**2)

  def helper_step(params, x):
    grads = jax.grad(helper_loss)(params, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

  params, x = arguments(mesh)
  with jax.set_mesh(mesh):
    report = fsm.fit(jax.jit(helper_step, donate_argnums=0), params, x, cache=False)
  made_at = f'test_peak.py:{dense.__code__.co_firstlineno + 1}'
  rows = [r for r in report.peak().rows if r.where.endswith(made_at)]
  rows = [r for r in rows if r.kind == 'activation']
  named = {r.shape.split('{')[0]: r.checkpoint for r in rows}
  # Each chip holds a (8192 / 2, 4096 / 4) shard of `hidden`: both names are
  # given at the helper's line, and only the one of hidden's shape is its.
  assert named.get('f32[4096,1024]') == 'hidden', rows


@pytest.mark.slow
@pytest.mark.parametrize(
  'topology',
  [
    pytest.param('v5p:2x2x2', marks=pytest.mark.libtpu),
    pytest.param('h100:1x8', marks=pytest.mark.cuda),
  ],
)
def test_a_scanned_llama_on_a_pod_is_split_and_named(topology):
  from flax_shardmeta.examples import train

  mesh = fsm.make_mesh((2, 4), ('data', 'model'), topology=topology, axis_types=AUTO)
  # Long enough sequences that the layers' saved activations hold the peak.
  step, state, batch = train.train_step(
    'llama3-8b', mesh, batch=16, seq=1024, num_layers=2
  )
  report = fsm.fit(step, state, batch, cache=False)
  peak = report.peak()
  assert sum(r.bytes for r in peak.rows) == report.total_bytes
  assert peak.named_fraction >= 0.9, peak.format(top=40)
  assert peak.phase in ('forward', 'backward', 'optimizer update')
  kinds = peak.by_kind()
  assert kinds['parameter'] == report.row('parameters')
  assert kinds['optimizer state'] == report.row('optimizer state')
  # Every source is the user's line (here the example model's), never jax's.
  assert all('site-packages' not in r.where for r in peak.rows)
  assert any(r.layers == 2 for r in peak.rows), peak.format(top=40)


def test_a_named_checkpoint_is_on_its_activations_row(mesh):
  from jax.ad_checkpoint import checkpoint_name

  def named_loss(params, x):
    hidden = checkpoint_name(jnp.tanh(x @ params['w1']), 'hidden')
    return jnp.mean((hidden @ params['w2']) ** 2)

  def named_step(params, x):
    grads = jax.grad(named_loss)(params, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

  def remat_named_step(params, x):
    grads = jax.grad(jax.checkpoint(named_loss))(params, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

  params, x = arguments(mesh)
  with jax.set_mesh(mesh):
    report = fsm.fit(jax.jit(named_step, donate_argnums=0), params, x, cache=False)
    remat = fsm.fit(jax.jit(remat_named_step, donate_argnums=0), params, x, cache=False)
  rows = [r for r in report.peak().rows if r.checkpoint == 'hidden']
  assert rows and all(r.kind == 'activation' for r in rows)
  assert "'hidden'" in report.peak().format(top=20)
  # What remat took away keeps its name in the diff.
  diff = report.peak().diff(remat.peak())
  went = [r for r in diff.rows if r.checkpoint == 'hidden']
  assert went and sum(r.change for r in went) < 0
  assert "'hidden'" in diff.format(top=20)


@pytest.mark.slow
@pytest.mark.cuda
def test_a_cached_gpu_fit_reads_its_peak_from_the_dumped_program(monkeypatch, tmp_path):
  # jax 0.12's CUDA plugin names some buffers as only XLA's dump of the
  # program does: that program is cached beside as_text()'s.
  from flax_shardmeta._capacity.fit import figure_cache
  from flax_shardmeta.examples import train

  monkeypatch.setenv('FLAX_SHARDMETA_CACHE', str(tmp_path))
  figure_cache.clear()
  mesh = fsm.make_mesh((2, 4), ('data', 'model'), topology='h100:1x8', axis_types=AUTO)
  args = train.train_step('llama3-8b', mesh, batch=16, seq=1024, num_layers=2)
  first = fsm.fit(*args)
  figure_cache.clear()  # only the disk copy is left
  second = fsm.fit(*args)
  assert second.cached and second.peak() == first.peak()
  assert second.peak().named_fraction >= 0.9


def test_a_routing_rows_advice_and_per_layer_bytes():
  dispatch = fsm.PeakRow(
    'activation', 'dot_general', 'moe.py:9', 8 << 20, 'Moe/layers', 4, role='dispatch'
  )
  mask = fsm.PeakRow('activation', 'eq', 'moe.py:5', 6 << 20, 'Moe/layers', role='mask')
  saved = fsm.PeakRow('activation', 'tanh', 'mlp.py:3', 4 << 20, 'Mlp')
  peak = fsm.PeakMemory((dispatch, mask, saved), 18 << 20)
  advice = peak.advice()
  assert 'capacity_factor' in advice[1] and 'dispatch buffer' in advice[1]
  assert 'one-hot masks' in advice[2] and 'remat' in advice[3]
  # Stacked over a scan's 4 layers: a quarter each; the running layer's mask.
  assert [(m.layers, m.bytes) for m in peak.moe_layers()] == [
    (4, {'dispatch': 2 << 20}),
    (1, {'mask': 6 << 20}),
  ]
  assert peak.by_role() == {'dispatch': 8 << 20, 'mask': 6 << 20}
  text = peak.format()
  assert 'Moe/layers, each of 4 layers' in text and 'routing masks' in text
  # A step with no experts says nothing of them.
  assert 'mixture' not in fsm.PeakMemory((saved,), 4 << 20).format()


def test_a_dense_step_has_no_routing_roles(reports):
  for report in reports:
    peak = report.peak()
    assert not [r for r in peak.rows if r.role] and peak.moe_layers() == ()
    assert peak.to_dict()['by_role'] == {}
