"""GPU clusters this machine does not have: compile-only devices from jax's CUDA
plugin (the ``gpu`` extra), laid out by ``fsm.make_mesh(topology='h100:4x8')``.

The plugin registers only when jax's platforms are ``cpu`` before the first
backend starts, as tests/conftest.py sets them. Meshes use Auto axes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta._capacity import gpu

AUTO = (AxisType.Auto,) * 2


@pytest.mark.cuda
@pytest.mark.parametrize(
  'name, kind, memory',
  [
    ('a100', 'NVIDIA A100-SXM4-80GB', 85100068864),
    ('h100', 'NVIDIA H100 80GB HBM3', 84942979072),
    ('h200', 'NVIDIA H200', 150754820096),
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
  with pytest.raises(fsm.TopologyError, match=r'flax_shardmeta\[gpu\]'):
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
