"""Host offload in fit: what a step keeps in host memory, judged against the
host's RAM, and offloads that did nothing named.

Compiled for a TPU topology (libtpu: its compiler counts host memory apart,
``host_*_size_in_bytes``) and for a GPU target (jax's CUDA plugin). Auto
axes throughout.
"""

import pathlib

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta._units import format_seconds

AUTO = (AxisType.Auto,)
LAYERS, WIDTH, BATCH = 8, 512, 256


def _optimizer_on_host(topology, host_kind=None):
  """A step whose optimizer state lives on ``pinned_host`` (donated); the
  host layout made by ``host_kind`` (default: jax's ``memory_kind``)."""
  mesh = fsm.make_mesh((4,), ('data',), topology=topology, axis_types=AUTO)
  dev = NamedSharding(mesh, P('data'))
  if host_kind is None:
    host = NamedSharding(mesh, P('data'), memory_kind='pinned_host')
  else:
    host = host_kind(dev)
  params = {'w': jax.ShapeDtypeStruct((4096, 1024), jnp.float32, sharding=dev)}
  opt = {
    k: jax.ShapeDtypeStruct((4096, 1024), jnp.float32, sharding=host)
    for k in ('mu', 'nu')
  }
  x = jax.ShapeDtypeStruct((64, 4096), jnp.float32, sharding=dev)

  def step(params, opt, x):
    g = jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p['w']) ** 2))(params)['w']
    on_chip = fsm.in_device_memory(dev)
    mu = 0.9 * jax.device_put(opt['mu'], on_chip) + 0.1 * g
    nu = 0.99 * jax.device_put(opt['nu'], on_chip) + 0.01 * g**2
    w = params['w'] - 0.01 * mu / (jnp.sqrt(nu) + 1e-8)
    return {'w': w}, {'mu': jax.device_put(mu, host), 'nu': jax.device_put(nu, host)}

  shardings = ({'w': dev}, {'mu': host, 'nu': host})
  jitted = jax.jit(step, donate_argnums=(0, 1), out_shardings=shardings)
  return mesh, jitted, (params, opt, x)


def _scanned(topology, offloaded, *, on_carry=False):
  """Layers scanned under a remat policy that offloads ``offloaded`` names."""
  mesh = fsm.make_mesh((4,), ('data',), topology=topology, axis_types=AUTO)
  params = {
    'w': jax.ShapeDtypeStruct(
      (LAYERS, WIDTH, WIDTH), jnp.float32, sharding=NamedSharding(mesh, P())
    )
  }
  x = jax.ShapeDtypeStruct(
    (BATCH, WIDTH), jnp.float32, sharding=NamedSharding(mesh, P('data'))
  )
  policy = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=offloaded,
    offload_src='device',
    offload_dst='pinned_host',
  )

  def layer(h, w):
    if on_carry:  # the named value is what the scan carries to the next layer
      return checkpoint_name(jnp.tanh(h @ w), 'x'), None
    a = checkpoint_name(h @ w, 'x')  # a value inside the layer
    return jnp.sin(a) * h, None

  def loss(params, x):
    h, _ = jax.lax.scan(jax.checkpoint(layer, policy=policy), x, params['w'])
    return jnp.mean(h**2)

  def step(params, x):
    grads = jax.grad(loss)(params, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

  return mesh, jax.jit(step, donate_argnums=0), (params, x)


# The line of `a = checkpoint_name(h @ w, 'x')` in _scanned.
NAMED_LINE = next(
  i
  for i, line in enumerate(pathlib.Path(__file__).read_text().splitlines(), 1)
  if line.strip().startswith("a = checkpoint_name(h @ w, 'x')")
)


def _fit(mesh, jitted, args, **options):
  with jax.set_mesh(mesh):
    return fsm.fit(jitted, *args, cache=False, **options)


def _xla_device(report):
  m = report.memory_analysis
  return (
    m['argument_size_in_bytes']
    + m['output_size_in_bytes']
    - m['alias_size_in_bytes']
    + m['temp_size_in_bytes']
    + m['generated_code_size_in_bytes']
  )


def _xla_host(report):
  m = report.memory_analysis
  return (
    m['host_argument_size_in_bytes']
    + m['host_output_size_in_bytes']
    - m['host_alias_size_in_bytes']
    + m['host_temp_size_in_bytes']
  )


@pytest.mark.libtpu
def test_optimizer_state_on_the_host_is_counted_there_not_on_the_chip():
  mesh, jitted, args = _optimizer_on_host('v5p:2x2x1')
  report = _fit(mesh, jitted, args)
  # The device total is XLA's device figures, field by field.
  assert report.total_bytes == _xla_device(report)
  assert report.row('optimizer state') == 0
  # The host side is XLA's host figures: mu and nu, 4096 x 1024 f32 over 4 chips.
  shard = 4096 * 1024 * 4 // 4
  assert report.host_bytes == _xla_host(report) == 2 * shard
  host = report.host
  assert {(r.kind, r.what, r.bytes) for r in host.rows} == {
    ('argument', 'opt/mu', shard),
    ('argument', 'opt/nu', shard),
  }
  assert sum(r.bytes for r in host.rows) == report.host_bytes
  assert host.chips_per_host == 4 and host.per_host_bytes == 4 * 2 * shard
  # v5p's host: its machine type's RAM, with where that is from.
  assert (
    host.capacity_bytes == 448 * 2**30 and 'ct5p-hightpu-4t' in host.capacity_source
  )
  assert 'host memory: 32.00 MiB per host' in str(report)
  assert report.to_dict()['host']['per_chip_bytes'] == 2 * shard
  # Each step reads mu and nu in and writes them back; TPUs publish no host
  # link bandwidth, so their time is not guessed.
  assert (host.to_device_bytes, host.to_host_bytes) == (2 * shard, 2 * shard)
  assert host.transfer_s is None and report.roofline.transfer_s == 0
  assert 'no published host link bandwidth' in str(report)


@pytest.mark.libtpu
def test_the_host_verdict_both_ways():
  mesh, jitted, args = _optimizer_on_host('v5p:2x2x1')
  roomy = _fit(mesh, jitted, args, host_memory='1GiB')
  assert roomy.fits is True and roomy.host.fits is True
  tight = _fit(mesh, jitted, args, host_memory='16MiB')
  assert tight.host.fits is False and tight.fits_device is True
  assert tight.fits is False and tight.verdict_kind == 'does_not_fit'
  line = str(tight).splitlines()
  verdict = next(x for x in line if x.startswith('verdict:'))
  # Which side fails, and by how much: 32 MiB per host against 16 MiB.
  assert 'the hosts lack memory: 16.00 MiB over' in verdict
  assert 'the chips have room' in verdict
  with pytest.raises(fsm.FitError, match='host_memory'):
    _fit(mesh, jitted, args, host_memory='lots')


@pytest.mark.libtpu
def test_activations_offloaded_by_a_remat_policy_are_host_temporaries():
  mesh, jitted, args = _scanned('v5p:2x2x1', ['x'])
  report = _fit(mesh, jitted, args)
  # Each layer's `h @ w`, a (256 / 4, 512) f32 shard, for 8 layers.
  offloaded = LAYERS * (BATCH // 4) * WIDTH * 4
  assert report.memory_analysis['host_temp_size_in_bytes'] == offloaded
  assert report.host_bytes == _xla_host(report) == offloaded
  (row,) = report.host.rows
  assert row.kind == 'offloaded activations' and row.what == "'x'"
  assert row.where.endswith(f'test_host_offload.py:{NAMED_LINE}')
  assert not [n for n in report.notes if 'OFFLOAD DID NOTHING' in n]


@pytest.mark.libtpu
def test_an_offload_policy_name_the_step_lacks_is_said():
  mesh, jitted, args = _scanned('v5p:2x2x1', ['xx'])
  report = _fit(mesh, jitted, args)
  assert report.host_bytes == 0
  (note,) = [n for n in report.notes if 'OFFLOAD DID NOTHING' in n]
  assert "offloads 'xx'" in note and "did you mean 'x'?" in note


@pytest.mark.libtpu
def test_an_offload_the_compiled_program_did_not_make_is_said():
  # jax#23869: offloading what a scan carries changes nothing.
  mesh, jitted, args = _scanned('v5p:2x2x1', ['x'], on_carry=True)
  report = _fit(mesh, jitted, args)
  assert report.memory_analysis['host_temp_size_in_bytes'] == 0
  (note,) = [n for n in report.notes if 'OFFLOAD DID NOTHING' in n]
  assert "offloads 'x' (" in note and 'keeps no temporaries in host memory' in note


def test_a_step_without_offload_has_no_host_side():
  mesh = jax.make_mesh((8,), ('data',), axis_types=(AxisType.Auto,))
  step = jax.jit(lambda x: (x * 2).sum())
  x = jax.ShapeDtypeStruct(
    (1024,), jnp.float32, sharding=NamedSharding(mesh, P('data'))
  )
  with jax.set_mesh(mesh):
    report = fsm.fit(step, x, cache=False)
  assert report.host is None and report.host_bytes == 0
  assert report.to_dict()['host'] is None


@pytest.mark.cuda
def test_activations_offloaded_on_a_gpu_target_are_host_temporaries():
  mesh, jitted, args = _scanned('h100:1x4', ['x'])
  report = _fit(mesh, jitted, args)
  offloaded = LAYERS * (BATCH // 4) * WIDTH * 4
  assert report.host_bytes == report.memory_analysis['host_temp_size_in_bytes']
  assert report.host_bytes == offloaded
  # a3-megagpu-8g's 1872 GB for 8 GPUs: half for the 4 this host drives.
  assert report.host.chips_per_host == 4
  assert report.host.capacity_bytes == 1872 * 2**30 // 2
  # Out in the forward pass, back in the backward, at PCIe Gen5's 64 GB/s.
  host = report.host
  assert (host.to_device_bytes, host.to_host_bytes) == (offloaded, offloaded)
  assert host.transfer_s == pytest.approx(offloaded / 64e9)
  assert report.roofline.transfer_s == host.transfer_s
  assert host.overlapped is True  # XLA's schedule copies them asynchronously


@pytest.mark.cuda
def test_pinned_host_arguments_on_a_gpu_target_are_counted_apart():
  # A compile-only GPU topology's devices list no memories: jax drops the
  # kind of a sharding over them, silently. fsm.in_host_memory keeps it.
  mesh = fsm.make_mesh((4,), ('data',), topology='h100:1x4', axis_types=AUTO)
  plain = NamedSharding(mesh, P('data'), memory_kind='pinned_host')
  assert plain.memory_kind is None
  kept = fsm.in_host_memory(NamedSharding(mesh, P('data')))
  assert kept.memory_kind == 'pinned_host'
  assert fsm.in_device_memory(kept).memory_kind == 'device'
  mesh, jitted, args = _optimizer_on_host('h100:1x4', host_kind=fsm.in_host_memory)
  report = _fit(mesh, jitted, args)
  shard = 4096 * 1024 * 4 // 4
  # XLA's GPU compiler counts them apart: the device total leaves them out.
  assert report.total_bytes == _xla_device(report)
  assert report.row('optimizer state') == 0
  assert report.host_bytes == _xla_host(report) == 2 * shard
  assert {r.what for r in report.host.rows} == {'opt/mu', 'opt/nu'}
  assert report.host.method == "XLA's host figures (memory_analysis)"
  # mu and nu in and out each step at PCIe Gen5's 64 GB/s.
  assert report.host.transfer_s == pytest.approx(2 * shard / 64e9)


def _small_build(mesh, rules, remat, offload=None):
  """Eight scanned layers with adam-like state; ``offload.optimizer`` puts
  that state in host memory, moved to the chips once the gradients are made
  (not before: the backward pass's activations are the peak) and back."""
  del remat
  with fsm.logical_axis_rules(rules):
    spec = fsm.logical_to_mesh_axes(('layers', 'embed', 'mlp'))
    batch_spec = fsm.logical_to_mesh_axes(('batch', 'embed'))
  dev = NamedSharding(mesh, spec)
  on_host = offload is not None and offload.optimizer
  state = fsm.in_host_memory(dev) if on_host else dev
  w = jax.ShapeDtypeStruct((LAYERS, 1024, 1024), jnp.float32)
  opt = {k: jax.ShapeDtypeStruct((LAYERS, 1024, 1024), jnp.float32) for k in 'mn'}
  x = jax.ShapeDtypeStruct((4096, 1024), jnp.float32)

  def loss(w, x):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, w)
    return jnp.mean(h**2)

  def step(w, opt, x):
    g = jax.grad(loss)(w, x)
    if on_host:  # to the chips once the gradients are made, not before
      g, opt = jax.lax.optimization_barrier((g, opt))
      opt = jax.device_put(opt, fsm.in_device_memory({'m': dev, 'n': dev}))
    m, n = 0.9 * opt['m'] + 0.1 * g, 0.99 * opt['n'] + 0.01 * g * g
    new = {'m': m, 'n': n}
    if on_host:
      new = jax.device_put(new, {'m': state, 'n': state})
    return w - 0.01 * m / (jnp.sqrt(n) + 1e-8), new

  held = {'m': state, 'n': state}
  jitted = fsm.jit(
    step, mesh=mesh, rules=rules, donate_argnums=(0, 1), out_shardings=(dev, held),
    in_shardings=(dev, held, NamedSharding(mesh, batch_spec)),
  )  # fmt: skip
  return jitted, w, opt, x


FSDP4 = fsm.RulePreset('fsdp4', ('fsdp',), [('batch', 'fsdp'), ('embed', 'fsdp')])


@pytest.mark.libtpu
def test_suggest_ranks_offload_candidates():
  def ranked(hbm, host_memory=None):
    return fsm.suggest(
      _small_build, batch=256, topology='v5p:2x2x1', presets=[FSDP4],
      remat=['none'], offload=['none', 'optimizer'], hbm=hbm,
      host_memory=host_memory, progress=False, cache=False,
    )  # fmt: skip

  roomy = ranked('1GiB')
  assert [c.offload.name for c in roomy] == ['none', 'optimizer']
  plain, hosted = roomy
  assert plain.fits and hosted.fits
  # The state's 2 x 4 MiB per chip went to the host: counted there, not here.
  assert hosted.report.host_bytes == 2 * LAYERS * 1024 * 1024 * 4 // 4
  assert plain.report.host is None
  # No better step time (v5p publishes no host link bandwidth, so the
  # transfers are not timed): the offload ranks below the layout that fits
  # without it, and says what it moves.
  assert plain.rank_s <= hosted.rank_s
  assert (
    'offload optimizer state: 16.00 MiB in and 16.00 MiB out per step' in hosted.reason
  )
  assert 'no published host link bandwidth' in hosted.reason
  text = str(roomy)
  assert 'offload' in text.splitlines()[1] and 'host (per host)' in text
  assert roomy.to_dict()['ranked'][1]['offload'] == 'optimizer'
  # A host without room for the state: the offload does not fit, and ranks
  # below the layout that does.
  full = ranked('1GiB', host_memory='1MiB')
  assert [(c.offload.name, c.fits) for c in full] == [
    ('none', True),
    ('optimizer', False),
  ]
  assert full[1].report.fits_device is True
  assert 'DOES NOT FIT' in full[1].report.host.verdict()


def test_offload_needs_a_build_that_takes_it():
  def build(mesh, rules, remat):
    raise AssertionError('never built')

  with pytest.raises(fsm.FitError, match='fourth argument, the fsm.OffloadPreset'):
    fsm.suggest(
      build, batch=8, chip='v5p', offload=['none', 'optimizer'], progress=False
    )
  with pytest.raises(fsm.FitError, match="unknown offload preset 'optimiser'"):
    fsm.suggest(build, batch=8, chip='v5p', offload=['optimiser'], progress=False)


@pytest.mark.parametrize('api', ['linen', 'nnx'])
def test_the_built_in_step_offloads_as_its_preset_says(api):
  from flax_shardmeta._capacity.fit.offload import offload_asks
  from flax_shardmeta.examples import train

  mesh = jax.sharding.AbstractMesh((4,), ('fsdp',), axis_types=AUTO)
  rules = [('batch', 'fsdp'), ('embed', 'fsdp')]
  step, state, batch = train.train_step(
    'llama3-8b', mesh, rules=rules, batch=4, seq=16, num_layers=1, api=api,
    remat='full', offload='optimizer+activations',
  )  # fmt: skip
  flat = jax.tree_util.tree_flatten_with_path(
    step.in_shardings[0], is_leaf=lambda x: isinstance(x, NamedSharding)
  )[0]
  kinds = {jax.tree_util.keystr(p): s.memory_kind for p, s in flat}
  # The optimizer state in host memory, the parameters on the chip.
  hosted = {p for p, k in kinds.items() if k == 'pinned_host'}
  assert hosted and all('opt_state' in p for p in hosted)
  assert {p for p in kinds if 'opt_state' in p and 'mu' in p} <= hosted
  assert not [p for p in kinds if 'opt_state' not in p and kinds[p] == 'pinned_host']
  # Each layer's input offloaded by the remat policy, at the model's line.
  asks = offload_asks(step.trace(state, batch).jaxpr.jaxpr)
  ((name, line),) = asks.offloaded
  assert name == 'decoder_layer_input' and not asks.missing
  assert line.startswith(f'flax_shardmeta/examples/{api}.py:')
  with pytest.raises(ValueError, match="unknown offload 'optimiser'"):
    train.train_step('mlp', mesh, rules=rules, offload='optimiser')


@pytest.mark.libtpu
def test_offload_copies_are_their_own_kind_in_peak_and_why():
  mesh = fsm.make_mesh((4,), ('fsdp',), topology='v5p:2x2x1', axis_types=AUTO)
  step, *args = _small_build(
    mesh, FSDP4.rules, 'none', fsm.OFFLOAD_PRESETS['optimizer']
  )
  report = fsm.fit(step, *args, cache=False)
  # XLA's schedule starts copying the state in before the forward loop: the
  # offload holds it on the chip through both passes, and fit says so.
  (early,) = [n for n in report.notes if n.startswith('OFFLOAD ARRIVES EARLY')]
  assert 'copying opt/m, opt/n from host memory' in early
  assert 'before 2 loop(s)' in early
  peak = report.peak()
  shard = LAYERS * 1024 * 1024 * 4 // 4
  copies = {r.what: r.bytes for r in peak.rows if r.kind == 'offload'}
  # Each the state's shard on the chip, and the copy's few bytes of context.
  assert set(copies) == {'opt/m', 'opt/n'}
  assert all(shard <= b <= shard + 64 for b in copies.values())
  why = report.why()
  assert 'offload: 16.00 MiB to the chip and 16.00 MiB to the host' in why
  assert 'argument  opt/m' in why and 'in and out each step' in why


@pytest.mark.cuda
def test_suggest_times_an_offload_by_its_transfers_on_gpus():
  found = fsm.suggest(
    _small_build, batch=256, topology='h100:1x4', presets=[FSDP4], remat=['none'],
    offload=['optimizer', 'none'], progress=False, cache=False,
  )  # fmt: skip
  # Listed first, but ranked after the layout without it.
  assert [c.offload.name for c in found] == ['none', 'optimizer']
  plain, hosted = found
  host = hosted.report.host
  # mu and nu (8 layers of 1024 x 1024 f32 over 4 GPUs) in and out each step,
  # at PCIe Gen5's 64 GB/s: in the ranked time.
  assert host.transfer_s == pytest.approx(2 * LAYERS * 1024 * 1024 * 4 / 4 / 64e9)
  roof = hosted.report.roofline
  assert roof.transfer_s == host.transfer_s
  assert hosted.rank_s == max(roof.compute_s, roof.collective_s, roof.transfer_s)
  assert plain.rank_s <= hosted.rank_s
  assert f'{format_seconds(host.transfer_s)} (can overlap compute)' in (hosted.reason)
