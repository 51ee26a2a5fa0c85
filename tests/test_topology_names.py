"""Topology names: the accelerator is read before a platform is chosen.

An accelerator fsm does not know ('h900:1x8') is answered with the closest
known names, whether or not libtpu or jax's CUDA plugin is installed; a known
TPU generation still goes to libtpu, a known GPU to the CUDA plugin.
"""

import os
import subprocess
import sys

import pytest

import flax_shardmeta as fsm
from flax_shardmeta import _errors, cli
from flax_shardmeta._devices import gpu, topology

H900 = (
  "unknown accelerator 'h900' in topology 'h900:1x8': did you mean h100 or h200? "
  '(GPUs: a100, h100, h200, b200, custom; TPUs: v4, v5e, v5p, v6e, tpu7x)'
)
SECTION = '(what to do: flax-shardmeta explain TopologyError)'


@pytest.mark.parametrize('libtpu', [True, False])
def test_an_unknown_gpu_is_named_with_the_closest_ones(monkeypatch, libtpu):
  # Without libtpu the name used to go down the TPU path and ask for the tpu
  # extra; with it, libtpu was asked about a GPU.
  monkeypatch.setattr(topology, 'libtpu_available', lambda: libtpu)
  asked = []
  monkeypatch.setattr(topology, '_devices', lambda *a: asked.append(a))
  with pytest.raises(fsm.TopologyError) as info:
    fsm.make_mesh((8,), ('data',), topology='h900:1x8')
  assert str(info.value) == f'{H900}\n{SECTION}'
  assert asked == []
  # Also with target_config=, which is not the mistake here.
  with pytest.raises(fsm.TopologyError, match='did you mean h100 or h200'):
    fsm.make_mesh((8,), ('data',), topology='h900:1x8', target_config='x { }')
  with pytest.raises(fsm.TopologyError, match='did you mean h100 or h200'):
    topology.topology_devices('h900:1x8')


def test_the_accelerator_decides_the_platform():
  assert topology.platform_of('h100:4x8') == 'gpu'
  assert topology.platform_of('custom:2x8') == 'gpu'
  assert topology.platform_of('H100:4x8') == 'gpu'
  # A known GPU in a form only TPUs use: the GPU path refuses the form.
  assert topology.platform_of('h100_4x8') == 'gpu'
  for name in ('v4:2x2x1', 'v5e:4x4', 'v5p:4x4x8', 'v6e:8x8', 'tpu7x:2x2x1'):
    assert topology.platform_of(name) == 'tpu'
  # libtpu's own spellings: 'v5' (v5p), v2 and v3, 'TPU v4', '_' and '='.
  for name in (
    'v5:2x2x1',
    'v2:2x2',
    'v3:2x2',
    'TPU v4:2x2x1',
    'v5p_2x2x1',
    'v5p=2x2x1',
  ):
    assert topology.platform_of(name) == 'tpu'
  # No ACCELERATOR:SHAPE at all: left to the accepted-forms message.
  assert topology.platform_of('v5p8') is None
  assert topology.platform_of(None) is None
  assert topology.TPU_GENERATIONS == ('v4', 'v5e', 'v5p', 'v6e', 'tpu7x')


@pytest.mark.parametrize(
  'name, message',
  [
    ('h900:1x8', 'did you mean h100 or h200?'),
    ('H900:1x8', "unknown accelerator 'H900' in topology 'H900:1x8': did you mean"),
    ('a10:1x8', 'did you mean a100?'),
    ('v6p:4x4', 'did you mean v5p or v6e?'),
    ('tpu7:2x2x1', 'did you mean tpu7x?'),
    ('v5litepod:4x4', 'did you mean v5e?'),
    ('v9:2x2', "unknown accelerator 'v9' in topology 'v9:2x2': use one of these (GPUs"),
    ('mi300x:1x8', 'use one of these (GPUs: a100, h100, h200, b200, custom; TPUs'),
  ],
)
def test_unknown_accelerators_in_one_line(name, message):
  with pytest.raises(fsm.TopologyError) as info:
    topology.platform_of(name)
  text = _errors.message(info.value)
  assert message in text and '\n' not in text
  assert text.endswith('TPUs: v4, v5e, v5p, v6e, tpu7x)')
  assert str(info.value) == f'{text}\n{SECTION}'


def test_known_names_keep_their_paths(monkeypatch):
  # A known TPU generation still asks for libtpu when it is missing.
  monkeypatch.setattr(topology, 'libtpu_available', lambda: False)
  with pytest.raises(fsm.TopologyError, match=r"needs libtpu.*pip install '\.\[tpu\]'"):
    fsm.make_mesh((8,), ('data',), topology='v5p:2x2x2')
  # A known GPU still asks for the CUDA plugin when it is missing.
  monkeypatch.setattr(gpu, 'cuda_plugin_available', lambda: False)
  with pytest.raises(fsm.TopologyError, match=r"pip install '\.\[gpu\]'"):
    fsm.make_mesh((8,), ('data',), topology='h100:1x8')
  # A name that is no topology at all lists the accepted forms.
  with pytest.raises(fsm.TopologyError, match="unknown topology 'v5p8'.*h100:4x8"):
    fsm.make_mesh((4,), ('data',), topology='v5p8')


def test_the_cli_answers_without_libtpu_in_one_line(capsys, monkeypatch):
  monkeypatch.setattr(topology, 'libtpu_available', lambda: False)
  argv = ['fit', '--model', 'mlp', '--topology', 'h900:1x8', '--mesh', 'data=8']
  code = cli.main(argv)
  out, err = capsys.readouterr()
  assert (code, out) == (2, '')
  assert err == f'flax-shardmeta: error: {H900} {SECTION}\n'


def test_the_cli_command_exits_2_with_the_did_you_mean():
  done = subprocess.run(
    [
      sys.executable,
      '-m',
      'flax_shardmeta',
      'fit',
      '--model',
      'mlp',
      '--topology',
      'h900:1x8',
      '--mesh',
      'data=8',
    ],
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
    check=False,
  )
  assert done.returncode == 2, done.stderr
  assert done.stdout == ''
  assert done.stderr.splitlines() == [f'flax-shardmeta: error: {H900} {SECTION}']


@pytest.mark.parametrize(
  'given, expected',
  [
    # Cloud TPU's accelerator types: TensorCores for v4 and v5p (two a chip),
    # chips for v5e (v5litepod) and v6e.
    ('v5p-8', 'v5p:2x2x1'),
    ('v5p-16', 'v5p:2x2x2'),
    ('v5p-128', 'v5p:4x4x4'),
    ('v5p-256', 'v5p:4x4x8'),
    ('v4-32', 'v4:2x2x4'),
    ('v5litepod-1', 'v5e:1x1'),
    ('v5litepod-8', 'v5e:2x4'),
    ('v5litepod-16', 'v5e:4x4'),
    ('V6E-256', 'v6e:16x16'),
    ('v6e-64', 'v6e:8x8'),
    ('v5p:4x4x8', None),
    ('h100:4x8', None),
  ],
)
def test_accelerator_types_as_consoles_print_them(given, expected):
  assert topology.accelerator_topology(given) == expected


@pytest.mark.parametrize('given', ['v5p-6', 'v5p-12', 'v6e-12'])
def test_an_accelerator_type_no_slice_has_is_refused(given):
  with pytest.raises(fsm.TopologyError, match='is no .* slice'):
    topology.accelerator_topology(given)


@pytest.mark.libtpu
def test_a_mesh_over_an_accelerator_type():
  mesh = fsm.make_mesh((4,), ('data',), topology='v5p-8')
  assert mesh.devices.size == 4 and mesh.devices.flat[0].device_kind == 'TPU v5'
  assert (
    len(fsm.make_mesh((16,), ('data',), topology='v5litepod-16').devices.flat) == 16
  )
