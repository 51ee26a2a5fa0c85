"""GPU clusters this machine does not have: compile-only devices from jax's CUDA
plugin (the ``gpu`` extra), laid out by ``fsm.make_mesh(topology='h100:4x8')``.

The plugin registers only when jax's platforms are ``cpu`` before the first
backend starts, as tests/conftest.py sets them. Meshes use Auto axes.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta._capacity.hlo import roofline
from flax_shardmeta._capacity.hlo.collectives import CollectiveOp
from flax_shardmeta._devices import gpu
from flax_shardmeta._devices.chips import CHIPS, chip_named

AUTO = (AxisType.Auto,) * 2


@pytest.mark.cuda
@pytest.mark.parametrize(
  'name, kind, memory',
  [
    ('a100', 'NVIDIA A100-SXM4-80GB', 85100068864),
    ('h100', 'NVIDIA H100 80GB HBM3', 84942979072),
    ('h200', 'NVIDIA H200', 150109880320),
    ('b200', 'NVIDIA B200', 191514411008),
  ],
)
def test_each_described_gpu_gives_its_devices(name, kind, memory):
  devices = gpu.gpu_devices(f'{name}:2x4')
  assert len(devices) == 8
  assert {d.device_kind for d in devices} == {kind}
  assert [d.process_index for d in devices] == [0] * 4 + [1] * 4
  assert f'device_memory_size: {memory}' in gpu.described_config(name)


@pytest.mark.cuda
def test_node_local_axes_stay_inside_a_node():
  mesh = fsm.make_mesh((4, 8), ('data', 'model'), topology='h100:4x8', axis_types=AUTO)
  nodes = np.vectorize(lambda d: d.process_index)(mesh.devices)
  # Each row (one data index) is one node's 8 GPUs: 'model' is NVLink-local.
  assert [set(row) for row in nodes] == [{0}, {1}, {2}, {3}]


@pytest.mark.cuda
def test_a_mesh_that_cannot_fit_the_nodes_says_why():
  with pytest.raises(fsm.MeshShapeError, match='16'):
    fsm.make_mesh((4, 8), ('data', 'model'), topology='h100:2x8', axis_types=AUTO)


@pytest.mark.cuda
def test_a_step_compiles_for_the_cluster_with_xla_memory_figures():
  mesh = fsm.make_mesh((2, 8), ('data', 'model'), topology='h100:2x8', axis_types=AUTO)
  w = jax.ShapeDtypeStruct(
    (1024, 4096), jnp.float32, sharding=NamedSharding(mesh, P(None, 'model'))
  )
  x = jax.ShapeDtypeStruct(
    (64, 1024), jnp.float32, sharding=NamedSharding(mesh, P('data'))
  )
  compiled = jax.jit(lambda w, x: jnp.tanh(x @ w).sum()).lower(w, x).compile()
  memory = compiled.memory_analysis()
  # Each GPU holds its eighth of w and its half of x.
  assert memory.argument_size_in_bytes == 1024 * 4096 * 4 // 8 + 64 * 1024 * 4 // 2


@pytest.mark.cuda
def test_a_custom_description_gives_its_device_kind(tmp_path):
  text = gpu.described_config('h100').replace(
    'device_description_str: "NVIDIA H100 80GB HBM3"',
    'device_description_str: "My H100 variant"',
  )
  path = tmp_path / 'mine.txtpb'
  path.write_text(text)
  for config in (text, str(path)):
    mesh = fsm.make_mesh(
      (8,), ('model',), topology='custom:1x8', target_config=config, axis_types=AUTO[:1]
    )
    assert mesh.devices.flat[0].device_kind == 'My H100 variant'


def test_unknown_gpus_and_forms_list_the_accepted_names():
  for name in ('v100:2x8', 'h100:2', 'h100:0x8'):
    with pytest.raises(fsm.TopologyError, match='h100') as info:
      gpu.gpu_devices(name) if name != 'v100:2x8' else gpu._parse(name)
    assert 'a100' in str(info.value) or 'at least one' in str(info.value)
  with pytest.raises(fsm.TopologyError, match='needs target_config='):
    gpu.gpu_devices('custom:1x8')
  with pytest.raises(fsm.TopologyError, match='neither a file'):
    gpu.gpu_devices('custom:1x8', target_config='no/such/file.txtpb')
  with pytest.raises(fsm.MeshShapeError, match="topology='custom:NxG'"):
    fsm.make_mesh((8,), ('model',), topology='v5p:2x2x2', target_config='x { }')


def test_a_missing_plugin_names_the_extra(monkeypatch):
  monkeypatch.setattr(gpu, 'cuda_plugin_available', lambda: False)
  with pytest.raises(fsm.TopologyError, match=r"pip install '\.\[gpu\]'"):
    fsm.make_mesh((2, 8), ('data', 'model'), topology='h100:2x8')


@pytest.mark.cuda
def test_a_description_the_plugin_refuses_is_a_topology_error():
  with pytest.raises(fsm.TopologyError, match='refused the description'):
    gpu.gpu_devices(
      'custom:1x8',
      target_config='gpu_device_info { device_memory_size: 1 no_such_field: 1 }\n'
      'device_description_str: "X"',
    )
  with pytest.raises(fsm.TopologyError, match='no device_description_str'):
    gpu.gpu_devices('custom:1x8', target_config='gpu_device_info { core_count: 1 }')
  with pytest.raises(fsm.TopologyError, match='device_memory_size'):
    gpu.gpu_devices('custom:1x8', target_config='device_description_str: "X" a { }')


def _field(gpu_name, field):
  text = gpu.described_config(gpu_name)
  return re.search(rf'\b{field}\s*:\s*(\d+)', text).group(1)


@pytest.mark.parametrize('name', list(gpu.GPUS))
def test_one_memory_and_one_hbm_bandwidth_per_gpu(name):
  chip = chip_named(name)
  # The description XLA plans with and the table fit judges against hold the
  # same memory: CUDA's totalGlobalMem, to the byte.
  assert int(_field(name, 'device_memory_size')) == chip.hbm_bytes
  assert gpu._MEMORY.search(gpu.described_config(name)).group(1) == str(chip.hbm_bytes)
  assert f'with {chip.hbm_bytes}B RAM' in gpu.described_config(name)
  # And the same HBM bandwidth, up to the datasheet's rounding (3.35 TB/s for
  # H100's 3.35232).
  described = int(_field(name, 'memory_bandwidth'))
  assert chip.hbm_bandwidth == pytest.approx(described, rel=1e-3)


def test_memory_is_what_cuda_reports_not_nvidia_smi():
  # H100: 81,008 MiB (CUDA) where nvidia-smi says 81,559; H200: 139.80 GiB
  # where nvidia-smi says 143,771 MiB.
  assert chip_named('h100').hbm_bytes == 81008 * 2**20 - 2**16
  assert chip_named('h200').hbm_bytes == 150109880320
  assert round(chip_named('h200').hbm_bytes / 2**30, 2) == 139.80
  assert chip_named('h200').hbm_bytes < 143771 * 2**20
  assert chip_named('b200').hbm_bandwidth == 7.67232e12  # not the datasheet's 8


@pytest.mark.parametrize(
  'name, nvlink, nvlink_bus, network, network_bus',
  [
    ('a100', 300e9, 230e9, 25e9, 24e9),
    ('h100', 450e9, 360e9, 50e9, 46e9),
    ('h200', 450e9, 360e9, 50e9, 46e9),
    ('b200', 900e9, 720e9, 50e9, 46e9),
  ],
)
def test_gpu_collectives_are_timed_at_the_bus_bandwidth_nccl_reaches(
  name, nvlink, nvlink_bus, network, network_bus
):
  chip = chip_named(name)
  # The link's peak stays in the table; collectives use what NCCL reaches.
  assert (chip.ici_bandwidth, chip.dcn_bandwidth) == (nvlink, network)
  assert chip.collective_bandwidth(crosses_slices=False) == nvlink_bus
  assert chip.collective_bandwidth(crosses_slices=True) == network_bus
  gib = 2**30
  ops = [
    # 8 GPUs of a node: a ring all-gather moves 7/8 of the buffer, an
    # all-reduce twice that (nccl-tests' busbw factors).
    CollectiveOp('all-gather', 'ag', 8 * gib, 3, 8, ('model',), link='nvlink'),
    CollectiveOp('all-reduce', 'ar', 8 * gib, 1, 8, ('model',), link='nvlink'),
    # 4 nodes: a reduce-scatter moves 3/4 over the network.
    CollectiveOp(
      'reduce-scatter', 'rs', 4 * gib, 2, 4, ('data',), True, link='network'
    ),
  ]
  rows = roofline.group(ops, chip)
  seconds = {r.kind: r.seconds for r in rows}
  assert seconds['all-gather'] == pytest.approx(3 * 8 * gib * 7 / 8 / nvlink_bus)
  assert seconds['all-reduce'] == pytest.approx(2 * 8 * gib * 7 / 8 / nvlink_bus)
  assert seconds['reduce-scatter'] == pytest.approx(2 * 4 * gib * 3 / 4 / network_bus)
  estimate = roofline.roofline(chip, 0.0, 0.0, rows)
  assert estimate.collective_s == pytest.approx(sum(seconds.values()))
  # Slower than the links' peaks would say, by the protocol's share.
  at_peak = 3 * 7 + 2 * 7
  assert estimate.collective_s > at_peak * gib / nvlink + 2 * 3 * gib / network


def test_tpu_collectives_keep_their_link_figures():
  for chip in CHIPS:
    if chip.device_kind.startswith('TPU'):
      assert chip.ici_bus_bandwidth is None and chip.dcn_bus_bandwidth is None
      assert chip.collective_bandwidth(crosses_slices=False) == chip.ici_bandwidth
      assert chip.collective_bandwidth(crosses_slices=True) == chip.dcn_bandwidth
  v5p = chip_named('v5p')
  op = CollectiveOp('all-reduce', 'ar', 2**30, 1, 4, ('data',), link='ici')
  assert roofline.op_seconds(op, v5p) == pytest.approx(2 * 2**30 * 3 / 4 / 400e9)
