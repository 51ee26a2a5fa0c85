"""The pieces the command line is built from, public for Python users too:
each does what the command does with it. Meshes: abstract, Auto axes."""

import importlib.util
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm

AUTO = (AxisType.Auto,) * 2


def test_restore_plan_replicates_unannotated_leaves_when_asked():
  saved = AbstractMesh((8, 1), ('data', 'model'), axis_types=AUTO)
  target = AbstractMesh((2, 4), ('data', 'model'), axis_types=AUTO)
  w = jax.ShapeDtypeStruct((16, 8), jnp.float32)
  step = jax.ShapeDtypeStruct((), jnp.int32)
  source = {
    'w': jax.ShapeDtypeStruct(
      w.shape, w.dtype, sharding=NamedSharding(saved, P('data'))
    ),
    'step': jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(saved, P())),
  }
  # A step count has no annotation.
  tree = {'w': fsm.LogicalPartitioned(w, ('embed', 'mlp')), 'step': step}
  rules = [('mlp', 'model')]
  plain = fsm.restore_plan(source, tree, mesh=target, rules=rules)
  assert [p.path for p in plain.problems] == ['step']  # it would keep the saved layout
  asked = fsm.restore_plan(source, tree, mesh=target, rules=rules,
                           replicate_unannotated=True)  # fmt: skip
  assert asked.problems == ()
  assert asked.entry('step').spec == P() and asked.entry('w').spec == P(None, 'model')
  with pytest.raises(fsm.RestoreError, match='replicate_unannotated'):
    fsm.restore_plan(source, tree, mesh=target, replicate_unannotated='yes')


def test_simulated_devices_are_refused_once_the_backends_run():
  jax.devices()  # this process's backends have started: its devices are fixed
  assert fsm.simulate_cpu_devices(16) is False
  assert jax.device_count() == 8


def test_simulated_devices_after_jax_is_imported_before_a_device_query():
  code = (
    'import jax, flax_shardmeta as fsm\n'
    'assert fsm.simulate_cpu_devices(12)\n'
    'print(jax.device_count())\n'
  )
  env = {'JAX_PLATFORMS': 'cpu', 'PATH': '/usr/bin:/bin'}
  done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                        env=env, timeout=300)  # fmt: skip
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.split()[-1] == '12'


def test_snapshot_diff_names_the_one_that_is_not_a_snapshot():
  good = {'version': 2, 'parameters': {'w': 'P()'}}
  with pytest.raises(fsm.FitError, match='new.json'):
    fsm.snapshot_diff(good, {'version': '2'}, names=('old.json', 'new.json'))


def test_an_errors_message_and_its_page_are_what_str_joins():
  e = fsm.RuleConflictError('two rules for embed')
  assert str(e) == f'{e.message}\n{e.errors_page}'
  assert e.errors_page.endswith('explain RuleConflictError)')


def test_the_quiet_start_installs_its_import_hook_once(monkeypatch):
  from flax_shardmeta._devices import quiet

  monkeypatch.setattr(quiet, 'on_an_nvidia_machine', lambda: False)
  monkeypatch.setattr(sys, 'meta_path', list(sys.meta_path))
  # The venvs' start-up helper loads the same file as a module of its own: its
  # hook is another class, and two hooks asking each other would never end.
  spec = importlib.util.spec_from_file_location('_fsm_quiet_copy', quiet.__file__)
  assert spec is not None and spec.loader is not None
  copy = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(copy)
  copy.quiet_cuda_plugin()
  fsm.cpu_only_jax()
  fsm.cpu_only_jax()
  hooks = [f for f in sys.meta_path if getattr(f, 'fsm_quiet_cuda', False)]
  assert len(hooks) == 1
  # A lookup of a module it watches goes on to the other finders and ends.
  hooks[0].find_spec('jax_plugins.xla_cuda12', None)


def test_a_chips_kind_and_a_preset_file_read_as_the_command_reads_them():
  assert fsm.chip_named('h200').is_gpu and not fsm.chip_named('v5p').is_gpu
  assert fsm.is_gpu_topology('h100:4x8') and not fsm.is_gpu_topology('v5p:4x4x8')
  text = json.dumps({'mine': {'axes': ['data'], 'rules': [['batch', 'data']]}})
  (preset,) = fsm.RulePreset.load(text, 'mine.json')
  assert preset.rules == (('batch', 'data'),)
  with pytest.raises(
    fsm.InvalidRulesError, match="'data', which is not among its axes"
  ):
    fsm.RulePreset.load(json.dumps({'x': {'axes': ['dta'], 'rules': [['b', 'data']]}}))
