"""fsm.fit and fsm.suggest on GPU clusters this machine does not have: compiled
by jax's CUDA plugin (the ``gpu`` extra) for H100 nodes, figures from XLA.

Every mesh here has Auto axes (fsm.make_mesh's default). The plugin registers
only when jax's platforms are ``cpu`` before the first backend starts, as
tests/conftest.py sets them.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta._capacity.fit.usable import GPU_COMPILER_OPTIONS
from flax_shardmeta._devices import gpu

pytestmark = pytest.mark.cuda

GIB = 1 << 30


def _fit(mesh, *args, **kwargs):
  with jax.set_mesh(mesh):
    return fsm.fit(*args, **kwargs)


def _mlp_step(mesh, batch=256, d=1024, h=4096):
  """A two-layer MLP's gradient step: w1 over 'model', the batch over 'data'."""
  ns = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
  params = {
    'w1': jax.ShapeDtypeStruct((d, h), jnp.float32, sharding=ns(None, 'model')),
    'w2': jax.ShapeDtypeStruct((h, d), jnp.float32, sharding=ns('model', None)),
  }
  x = jax.ShapeDtypeStruct((batch, d), jnp.float32, sharding=ns('data', None))

  def step(p, x):
    loss = lambda p: jnp.mean((jax.nn.relu(x @ p['w1']) @ p['w2'] - x) ** 2)  # noqa: E731
    grads = jax.grad(loss)(p)
    return jax.tree.map(lambda w, g: w - 1e-3 * g, p, grads)

  return jax.jit(step, donate_argnums=0), params, x


@pytest.mark.parametrize(
  'topology, shape', [('h100:1x8', (1, 8)), ('h100:4x8', (4, 8))]
)
def test_fit_figures_are_xla_own_for_the_same_program(topology, shape):
  mesh = fsm.make_mesh(shape, ('data', 'model'), topology=topology)
  jitted, params, x = _mlp_step(mesh)
  report = _fit(mesh, jitted, params, x, cache=False)
  # fit compiles a GPU program with its matmuls as cuBLAS calls, the most
  # memory a real run's autotuning can pick (usable.GPU_COMPILER_OPTIONS).
  compiled = jitted.lower(params, x).compile(compiler_options=GPU_COMPILER_OPTIONS)
  memory = compiled.memory_analysis()
  assert report.source == 'compiled'
  assert report.plan is not None and report.plan.cublas_matmuls is True
  assert any('with its matmuls as cuBLAS calls' in n for n in report.notes)
  assert report.memory_analysis['temp_size_in_bytes'] == memory.temp_size_in_bytes
  assert report.memory_analysis['argument_size_in_bytes'] == (
    memory.argument_size_in_bytes
  )
  expected = (
    memory.argument_size_in_bytes
    + memory.output_size_in_bytes
    - memory.alias_size_in_bytes
    + memory.temp_size_in_bytes
    + memory.generated_code_size_in_bytes
  )
  assert report.total_bytes == expected
  # Plain arrays, no plan: every argument is an input, as each GPU holds it.
  held = 2 * 1024 * 4096 * 4 // 8 + 256 * 1024 * 4 // shape[0]
  assert report.row('parameters') + report.row('batch and other inputs') == held
  assert report.chip.name == 'h100' and report.usable.device_bytes == 84942979072
  assert report.hbm_bytes == report.usable.usable_bytes
  assert report.fits is True
  assert any(
    "does not check a program against the GPU's memory" in n for n in report.notes
  )
  # flops from XLA's cost model over the optimised program (no cost_analysis on
  # a compile-only GPU executable): at least the two forward matmuls' share.
  per_gpu_forward = 2 * 2 * (256 // shape[0]) * 1024 * (4096 // 8)
  assert report.flops is not None and report.flops >= per_gpu_forward
  assert report.roofline is not None and report.roofline.chip.name == 'h100'


def test_collectives_are_labelled_by_the_link_they_use():
  mesh = fsm.make_mesh((4, 8), ('data', 'model'), topology='h100:4x8')
  jitted, params, x = _mlp_step(mesh)
  report = _fit(mesh, jitted, params, x, cache=False)
  links = {row.axes: row.link for row in report.collectives}
  # 'model' is inside a node (NVLink), 'data' across the 4 nodes.
  assert links[('model',)] == 'nvlink'
  assert links[('data',)] == 'network'
  rows = report.to_dict()['collectives']
  assert {(tuple(r['axes']), r['link']) for r in rows} >= {
    (('model',), 'nvlink'),
    (('data',), 'network'),
  }
  assert 'nvlink' in str(report) and 'network' in str(report)
  # Across nodes the 46 GB/s NCCL reaches per GPU, inside the 360 of NVLink.
  data = next(r for r in report.collectives if r.axes == ('data',))
  model = next(r for r in report.collectives if r.axes == ('model',))
  assert data.seconds / data.bytes > 5 * model.seconds / model.bytes


def test_a_mesh_whose_axes_straddle_nodes_sends_those_over_the_network():
  # data=8 x model=4 over 4 nodes of 8: two rows per node; 'data' groups hold
  # two GPUs of each node and so cross nodes: network.
  mesh = fsm.make_mesh((8, 4), ('data', 'model'), topology='h100:4x8')
  jitted, params, x = _mlp_step(mesh)
  links = {
    r.axes: r.link for r in _fit(mesh, jitted, params, x, cache=False).collectives
  }
  assert links[('model',)] == 'nvlink' and links[('data',)] == 'network'
  with pytest.raises(fsm.MeshShapeError, match="'model' groups of 4 would straddle"):
    fsm.make_mesh(
      (6, 4), ('data', 'model'), topology='custom:4x6', target_config=_custom()
    )


def test_an_oversized_step_does_not_fit_with_both_figures():
  mesh = fsm.make_mesh((1, 2), ('data', 'model'), topology='h100:1x2')
  # Two weights of 128 GiB (f32) over two GPUs: 128 GiB each.
  jitted, params, x = _mlp_step(mesh, batch=8, d=131072, h=262144)
  report = _fit(mesh, jitted, params, x, cache=False)
  assert report.refusal is None  # the GPU compiler compiles it anyway
  assert report.fits is False
  assert report.total_bytes >= 128 * GIB and report.usable.device_bytes == 84942979072
  text = str(report)
  assert 'DOES NOT FIT' in text and '79.11 GiB' in text


def test_hbm_is_the_gpu_memory_the_allocator_takes_its_fraction_of():
  mesh = fsm.make_mesh((2, 4), ('data', 'model'), topology='h100:2x4')
  jitted, params, x = _mlp_step(mesh)
  total = _fit(mesh, jitted, params, x).total_bytes
  whole = {'mem_fraction': 1.0, 'reserve': 0}
  assert _fit(mesh, jitted, params, x, hbm=total, **whole).fits is True
  small = _fit(mesh, jitted, params, x, hbm=total - 1, **whole)
  assert small.fits is False and small.usable.device_bytes == total - 1
  # At jax's default fraction a quarter of it is not XLA's.
  default = _fit(mesh, jitted, params, x, hbm=total, reserve=0)
  assert default.hbm_bytes == int(0.75 * total) and default.fits is False


def _custom(kind='Lab GPU 24GB', memory=24 * GIB):
  text = gpu.described_config('h100')
  text = text.replace('"NVIDIA H100 80GB HBM3"', f'"{kind}"')
  return text.replace(
    'device_memory_size: 84942979072', f'device_memory_size: {memory}'
  )


def test_a_custom_gpu_is_judged_against_its_own_memory():
  mesh = fsm.make_mesh(
    (1, 2), ('data', 'model'), topology='custom:1x2', target_config=_custom()
  )
  assert mesh.devices.flat[0].device_kind == 'Lab GPU 24GB'
  jitted, params, x = _mlp_step(mesh, batch=8, d=16384, h=131072)  # 8 GiB each
  report = _fit(mesh, jitted, params, x, cache=False)
  assert report.usable.device_bytes == 24 * GIB
  assert report.chip is None and report.roofline is None
  assert any("chip= (e.g. 'h100') for a roofline" in n for n in report.notes)
  assert report.fits is (report.total_bytes <= report.usable.usable_bytes)


def test_suggest_keeps_tensor_parallel_axes_inside_a_node():
  def build(mesh, rules, remat):
    w = jax.ShapeDtypeStruct((2048, 2048), jnp.float32)
    params = {'w': fsm.LogicalPartitioned(w, ('embed', 'mlp'))}
    x = fsm.LogicalPartitioned(
      jax.ShapeDtypeStruct((64, 2048), jnp.float32), ('batch', 'embed')
    )
    loss = lambda p, x: jnp.tanh(x @ fsm.unbox(p)['w']).sum()  # noqa: E731
    return fsm.jit(jax.grad(loss), mesh=mesh, rules=rules), params, x

  found = fsm.suggest(
    build,
    batch=64,
    topology='h100:2x4',
    presets=['fsdp+tp', 'tp'],
    remat=['none'],
    max_candidates=3,
    progress=False,
  )
  assert len(found) >= 2 and found[0].fits
  for candidate in [*found, *found.rejected, *found.skipped]:
    assert candidate.shape.get('model', 1) <= 4  # 4 GPUs a node
  assert found[0].report.chip.name == 'h100'
  assert "topology='h100:2x4'" in found[0].make_mesh_call()


def _cli(*argv):
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
  return subprocess.run(
    [sys.executable, '-m', 'flax_shardmeta', *argv],
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
    check=False,
  )


def test_cli_exit_codes_for_gpu_topologies(tmp_path):
  common = ['fit', '--model', 'mlp', '--mesh', 'data=2,model=4', '--no-cache']
  fits = _cli(*common, '--topology', 'h100:2x4', '--format', 'json')
  assert fits.returncode == 0, fits.stderr
  report = json.loads(fits.stdout)
  assert report['fits'] is True and report['chip']['name'] == 'h100'
  assert {r['link'] for r in report['collectives']} <= {'nvlink', 'network'}
  too_small = _cli(*common, '--topology', 'h100:2x4', '--hbm', '1MiB')
  assert too_small.returncode == 1, too_small.stderr
  assert 'DOES NOT FIT' in too_small.stdout
  config = tmp_path / 'lab.txtpb'
  config.write_text(_custom())
  custom = _cli(*common, '--topology', 'custom:2x4', '--target-config', str(config))
  assert custom.returncode == 0, custom.stderr
  assert 'Lab GPU 24GB' in custom.stdout and '24.00 GiB' in custom.stdout
  unknown = _cli(*common, '--topology', 'v100:2x4')
  assert unknown.returncode == 2
  assert 'h100' in unknown.stderr and 'a100' in unknown.stderr
  straddling = _cli(*common[:3], '--mesh', 'data=4,model=2', '--topology', 'h100:4x2')
  assert straddling.returncode == 0, straddling.stderr  # model=2 is a whole node
  assert fits.stderr == ''  # the plugin's start-up lines stay out of the output


def test_fsdp_gradients_reduce_scatter_across_nodes():
  # Parameters over 'data' (FSDP): XLA reduce-scatters their gradients, as
  # async reduce-scatter-start / -done pairs on GPUs, across the two nodes.
  mesh = fsm.make_mesh((2, 4), ('data', 'model'), topology='h100:2x4')
  ns = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
  w = jax.ShapeDtypeStruct((4096, 4096), jnp.float32, sharding=ns('data', 'model'))
  x = jax.ShapeDtypeStruct((256, 4096), jnp.float32, sharding=ns('data', None))

  def step(w, x):
    return w - 1e-3 * jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)

  report = _fit(mesh, jax.jit(step, donate_argnums=0), w, x, cache=False)
  kinds = {(r.kind, r.axes, r.link) for r in report.collectives}
  assert ('reduce-scatter', ('data',), 'network') in kinds
  assert not any('reader disagrees' in n for n in report.notes)
