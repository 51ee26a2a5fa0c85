"""Host offload in fit: what a step keeps in host memory, judged against the
host's RAM, and offloads that did nothing named.

Compiled for a TPU topology (libtpu: its compiler counts host memory apart,
``host_*_size_in_bytes``) and for a GPU target (jax's CUDA plugin). Auto
axes throughout.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm

AUTO = (AxisType.Auto,)
LAYERS, WIDTH, BATCH = 8, 512, 256
NAMED_LINE = 67  # the line of `a = checkpoint_name(h @ w, 'x')` below


def _optimizer_on_host(topology):
  """A step whose optimizer state lives on ``pinned_host`` (donated)."""
  mesh = fsm.make_mesh((4,), ('data',), topology=topology, axis_types=AUTO)
  dev = NamedSharding(mesh, P('data'))
  host = NamedSharding(mesh, P('data'), memory_kind='pinned_host')
  params = {'w': jax.ShapeDtypeStruct((4096, 1024), jnp.float32, sharding=dev)}
  opt = {
    k: jax.ShapeDtypeStruct((4096, 1024), jnp.float32, sharding=host)
    for k in ('mu', 'nu')
  }
  x = jax.ShapeDtypeStruct((64, 4096), jnp.float32, sharding=dev)

  def step(params, opt, x):
    g = jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p['w']) ** 2))(params)['w']
    mu = 0.9 * jax.device_put(opt['mu'], dev) + 0.1 * g
    nu = 0.99 * jax.device_put(opt['nu'], dev) + 0.01 * g**2
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


def _fit(mesh, jitted, args, **options):
  with jax.set_mesh(mesh):
    return fsm.fit(jitted, *args, cache=False, **options)


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
  m = report.memory_analysis
  # The device total is XLA's device figures, field by field.
  device = (
    m['argument_size_in_bytes']
    + m['output_size_in_bytes']
    - m['alias_size_in_bytes']
    + m['temp_size_in_bytes']
    + m['generated_code_size_in_bytes']
  )
  assert report.total_bytes == device
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
