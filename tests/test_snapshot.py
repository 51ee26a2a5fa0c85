"""Layouts as golden files: ``fsm.snapshot``, ``fsm.snapshot_diff``,
``fsm.testing.assert_snapshot`` and the ``snapshot`` / ``diff`` commands.

The model is written here, for these tests: three annotated matrices, one
``with_logical_constraint``, adam, an ``fsm.jit`` step on the (2, 4) mesh of
the 8 simulated CPU devices with Auto axes (the layout the rules give is what
the compiler keeps; nothing is a sharding type).
"""

import importlib
import json
import pathlib
import re
import runpy
import subprocess
import sys
import textwrap
import types

import pytest

import flax_shardmeta as fsm
from flax_shardmeta import _frames, cli
from flax_shardmeta._snapshot import (
  compare as snapshot_diff_module,
  record as snapshot_module,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Written to a file so that this process and a fresh one trace the same lines.
MODEL = textwrap.dedent(
  """
  import json, sys
  import jax, jax.numpy as jnp, flax.linen as nn, optax
  import flax_shardmeta as fsm

  RULES = (('batch', 'data'), ('embed', None), ('mlp', 'model'), ('vocab', 'model'))


  def param(module, name, names, shape):
    init = fsm.with_logical_partitioning(nn.initializers.lecun_normal(), names)
    return module.param(name, init, shape)


  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = jax.nn.relu(x @ param(self, 'w1', ('embed', 'mlp'), (16, 32)))
      h = fsm.with_logical_constraint(h, ('batch', 'mlp'))  # the constraint
      h = h @ param(self, 'w2', ('mlp', 'embed'), (32, 16))
      return h @ param(self, 'head', ('embed', 'vocab'), (16, 64))


  def build(rules=RULES):
    model, tx = Model(), optax.adam(1e-3)
    mesh = jax.make_mesh((2, 4), ('data', 'model'),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)

    def step(params, opt_state, x):
      loss = lambda p: jnp.mean(model.apply({'params': p}, x) ** 2)
      grads = jax.grad(loss)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    params = jax.eval_shape(model.init, jax.random.key(0), x)['params']
    opt_state = jax.eval_shape(tx.init, params)
    return fsm.jit(step, mesh=mesh, rules=rules), params, opt_state, x


  if __name__ == '__main__':
    snap = fsm.snapshot(*build(), cache=False)
    sys.stdout.write(json.dumps(snap, indent=1, sort_keys=True))
  """
)


@pytest.fixture(scope='module')
def model(tmp_path_factory):
  path = tmp_path_factory.mktemp('model') / 'layout_model.py'
  path.write_text(MODEL)
  return path, runpy.run_path(str(path))


@pytest.fixture(scope='module')
def snap(model):
  _, namespace = model
  return fsm.snapshot(*namespace['build'](), cache=False)


def _constraint_line(path):
  lines = path.read_text().splitlines()
  return next(n for n, line in enumerate(lines, 1) if '# the constraint' in line)


def test_the_snapshot_holds_specs_constraints_collectives_and_mesh(snap, model):
  assert snap['version'] == 2 and snap['source'] == 'compiled'
  assert snap['mesh'] == {
    'axis_names': ['data', 'model'],
    'axis_sizes': [2, 4],
    'axis_types': ['Auto', 'Auto'],
    'device_kind': 'cpu',
  }
  assert snap['parameters'] == {
    'params/head': "P(None, 'model')",
    'params/w1': "P(None, 'model')",
    'params/w2': "P('model', None)",
  }
  assert snap['optimizer_state']['opt_state/0/mu/w2'] == "P('model', None)"
  assert snap['optimizer_state']['opt_state/0/count'] == 'P()'
  assert snap['inputs'] == {'x': 'P(None, None)'}
  path, _ = model
  # Run by path, the file is in no module: named by its base name.
  where = f'layout_model.py:{_constraint_line(path)}'
  mine = [c for c in snap['constraints'] if where in c['where']]
  # Once as written (under jvp), once on the cotangent (its transpose).
  assert {(c['spec'], tuple(c['shape'])) for c in mine} == {
    ("P('data', 'model')", (8, 32))
  }
  assert [c['scope'] for c in mine] == ['jvp(Model)', 'transpose(jvp(Model))']
  assert all(c['where'] == [where] and c['count'] == 1 for c in mine)
  for c in snap['constraints']:
    assert not re.search(r':\d', c['scope']), 'a scope holds no line number'
    assert c['where'] and all(not w.startswith('/') for w in c['where'])
  assert snap['collectives'], 'the gradients are reduced over data'
  for row in snap['collectives']:
    assert set(row) == {
      'kind',
      'axes',
      'link',
      'reason',
      'parameters',
      'scope',
      'sources',
      'bytes',
      'count',
    }
    assert isinstance(row['bytes'], int) and row['count'] > 0


def test_the_snapshot_is_json_and_stable_in_one_process(snap, model):
  _, namespace = model
  text = json.dumps(snap, indent=1, sort_keys=True)
  assert json.loads(text) == snap
  again = fsm.snapshot(*namespace['build'](), cache=False)
  assert json.dumps(again, indent=1, sort_keys=True) == text
  assert fsm.snapshot_diff(snap, again) == []


def test_the_snapshot_is_the_same_text_in_another_process(snap, model):
  path, _ = model
  done = subprocess.run(
    [sys.executable, str(path)],
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout == json.dumps(snap, indent=1, sort_keys=True)


def test_one_rule_changes_one_parameter_and_the_diff_names_it(snap, model):
  _, namespace = model
  rules = tuple(r for r in namespace['RULES'] if r[0] != 'vocab') + (('vocab', None),)
  changed = fsm.snapshot(*namespace['build'](rules), cache=False)
  differ = {
    p for p in snap['parameters'] if snap['parameters'][p] != changed['parameters'][p]
  }
  assert differ == {'params/head'}
  lines = fsm.snapshot_diff(snap, changed)
  about_parameters = [
    line for line in lines if line.startswith('params/') or ' parameter ' in line
  ]
  assert about_parameters == ["params/head: P(None, 'model') -> P(None, None)"]
  assert "opt_state/0/mu/head: P(None, 'model') -> P(None, None)" in lines


def test_assert_snapshot_writes_compares_and_rewrites(snap, tmp_path, monkeypatch):
  monkeypatch.delenv('FLAX_SHARDMETA_UPDATE_SNAPSHOTS', raising=False)
  golden = tmp_path / 'layouts' / 'step.json'
  fsm.testing.assert_snapshot(snap, golden)  # missing: written
  text = golden.read_text()
  assert text == json.dumps(snap, indent=1, sort_keys=True) + '\n'
  fsm.testing.assert_snapshot(snap, golden)  # equal: passes
  moved = json.loads(text)
  moved['parameters']['params/w1'] = "P('model', None)"
  with pytest.raises(AssertionError) as info:
    fsm.testing.assert_snapshot(moved, golden)
  message = str(info.value)
  assert "params/w1: P(None, 'model') -> P('model', None)" in message
  assert 'FLAX_SHARDMETA_UPDATE_SNAPSHOTS=1' in message
  assert golden.read_text() == text, 'a failing comparison writes nothing'
  monkeypatch.setenv('FLAX_SHARDMETA_UPDATE_SNAPSHOTS', '1')
  fsm.testing.assert_snapshot(moved, golden)  # rewritten
  monkeypatch.delenv('FLAX_SHARDMETA_UPDATE_SNAPSHOTS')
  fsm.testing.assert_snapshot(moved, golden)
  assert json.loads(golden.read_text()) == moved


def test_testing_is_a_public_module_loaded_on_first_use():
  import flax_shardmeta.testing

  assert fsm.testing is flax_shardmeta.testing is sys.modules['flax_shardmeta.testing']
  assert issubclass(fsm.testing.SnapshotMismatch, AssertionError)


# Golden files that travel: the same text from any directory, wherever the
# model is, and no difference when its code only moves
# ------------------------------------------------------------------------------

PACKAGE = 'fsm_golden_pkg'  # a name no other test imports


@pytest.fixture
def package(tmp_path, monkeypatch):
  """Writes the model as ``PACKAGE.layout_model`` under a root and imports it
  from there (``sys.path`` set to the root), as a user's package would be."""
  monkeypatch.setattr(sys, 'path', list(sys.path))
  roots = []

  def load(root, text=MODEL):
    _forget()
    folder = tmp_path / root / PACKAGE
    folder.mkdir(parents=True, exist_ok=True)
    (folder / '__init__.py').write_text('')
    (folder / 'layout_model.py').write_text(text)
    sys.path[:] = [p for p in sys.path if p not in roots]
    roots.append(str(tmp_path / root))
    sys.path.insert(0, roots[-1])
    importlib.invalidate_caches()
    return importlib.import_module(f'{PACKAGE}.layout_model')

  yield load
  _forget()


def _forget():
  for name in [n for n in sys.modules if n.split('.')[0] == PACKAGE]:
    del sys.modules[name]


def _text(snap):
  return json.dumps(snap, indent=1, sort_keys=True)


def test_the_snapshot_is_the_same_from_any_directory_and_install(
  package, tmp_path, monkeypatch
):
  first = package('a')
  texts = {}
  for cwd in (ROOT, ROOT / 'tests', tmp_path / 'a', tmp_path / 'a' / PACKAGE):
    monkeypatch.chdir(cwd)
    texts[str(cwd)] = _text(fsm.snapshot(*first.build(), cache=False))
  moved = package('b')  # the same file in another tree
  assert moved.__file__ != first.__file__
  texts['b'] = _text(fsm.snapshot(*moved.build(), cache=False))
  assert len(set(texts.values())) == 1, texts.keys()
  text = texts['b']
  assert str(tmp_path) not in text and str(ROOT) not in text
  line = _constraint_line(pathlib.Path(moved.__file__))
  snap = json.loads(text)
  where = f'{PACKAGE}/layout_model.py:{line}'
  assert [c['scope'] for c in snap['constraints'] if where in c['where']] == [
    'jvp(Model)',
    'transpose(jvp(Model))',
  ]


def test_code_that_only_moves_is_no_difference(package, tmp_path, monkeypatch):
  monkeypatch.delenv('FLAX_SHARDMETA_UPDATE_SNAPSHOTS', raising=False)
  module = package('c')
  old = fsm.snapshot(*module.build(), cache=False)
  golden = tmp_path / 'layouts' / 'step.json'
  fsm.testing.assert_snapshot(old, golden)  # recorded
  path = pathlib.Path(module.__file__)
  path.write_text('# A comment above everything moves every line down.\n' + MODEL)
  module = importlib.reload(module)
  new = fsm.snapshot(*module.build(), cache=False)
  lines = {w for c in new['constraints'] for w in c['where']}
  assert f'{PACKAGE}/layout_model.py:{_constraint_line(path)}' in lines
  assert new != old, 'the lines moved'
  assert fsm.snapshot_diff(old, new) == []
  fsm.testing.assert_snapshot(new, golden)


def test_a_golden_file_of_version_1_is_to_be_recorded_again(snap, tmp_path):
  golden = tmp_path / 'step.json'
  old = {**json.loads(_text(snap)), 'version': 1}
  for c in old['constraints']:  # as version 1 wrote them: one line each
    c['where'] = c['where'][0]
  golden.write_text(json.dumps(old))
  with pytest.raises(fsm.FitError) as info:
    fsm.testing.assert_snapshot(snap, golden)
  message = str(info.value)
  assert str(golden) in message and 'version 1' in message
  assert 'must be recorded again' in message
  assert 'FLAX_SHARDMETA_UPDATE_SNAPSHOTS=1' in message
  with pytest.raises(fsm.FitError, match='old is a layout snapshot of version 1'):
    fsm.snapshot_diff(old, snap)


def test_a_constraint_with_no_user_frame_names_no_library_line(monkeypatch):
  from jax._src import source_info_util

  frame = source_info_util.Frame
  library = [
    frame(fsm.__file__, 'constrain', 12, 0, 12, 0),
    frame('/elsewhere/site-packages/flax/linen/module.py', 'apply', 9, 0, 9, 0),
  ]
  calls = [library, [*library, frame(__file__, 'step', 7, 0, 7, 0)]]
  monkeypatch.setattr(source_info_util, 'user_frames', lambda _: iter(calls.pop(0)))
  # Two equations, two tracebacks (a traceback's line is read once).
  first, second = (types.SimpleNamespace(traceback=object()) for _ in range(2))
  assert snapshot_module._where(first) == '(no user line)'
  assert snapshot_module._where(second) == f'{_frames.import_path(__file__)}:7'
  assert not _frames.import_path(__file__).startswith('/')


def test_import_path_is_the_path_from_the_import_root(package, tmp_path):
  import flax.linen.linear

  module = package('d')
  assert _frames.import_path(module.__file__) == f'{PACKAGE}/layout_model.py'
  init = sys.modules[PACKAGE].__file__
  assert init is not None
  assert _frames.import_path(init) == f'{PACKAGE}/__init__.py'
  assert _frames.import_path(flax.linen.linear.__file__) == 'flax/linen/linear.py'
  assert _frames.import_path(json.__file__) == 'json/__init__.py'
  # No module has it: under the longest sys.path entry, else its base name.
  loose = tmp_path / 'd' / 'tools' / 'run.py'
  assert _frames.import_path(str(loose)) == 'tools/run.py'
  assert _frames.import_path(str(tmp_path / 'nowhere' / 'run.py')) == 'run.py'


def test_library_files_are_told_here_and_from_other_machines():
  import flax.linen

  assert _frames.is_library_file(flax.linen.__file__)
  assert _frames.is_library_file(json.__file__)
  assert _frames.is_library_file(snapshot_module.__file__)
  for elsewhere in (
    '/opt/venv/lib/python3.12/site-packages/jax/_src/pjit.py',
    '/build/jaxlib/xla_client.py',
    'C:\\py\\Lib\\site-packages\\optax\\_src\\alias.py',
    'flax/linen/linear.py',
    'flax_shardmeta/_capacity/fit/fit.py',
  ):
    assert _frames.is_library_file(elsewhere), elsewhere
  for user in ('/home/me/flax_shardmeta/examples/models.py', '/srv/pkg/model.py'):
    assert not _frames.is_library_file(user), user
  assert not _frames.is_library_file(__file__)


# snapshot_diff on records written by hand
# ------------------------------------------------------------------------------


def _record(**sections):
  return {'version': 2, 'mesh': {'axis_names': ['data'], 'axis_sizes': [8]}, **sections}


def _row(nbytes, count=4, **attribution):
  row = {'kind': 'all-reduce', 'axes': ['model'], 'link': None, 'bytes': nbytes}
  return {**row, 'count': count, **attribution}


def test_collectives_are_matched_by_attribution_within_one_percent():
  grad = {'reason': 'gradient', 'parameters': ['params/w'], 'sources': ['m.py:4']}
  old = _record(collectives=[_row(16 * 2**20, **grad)])
  assert fsm.snapshot_diff(old, _record(collectives=[_row(16_700_000, **grad)])) == []
  assert fsm.snapshot_diff(old, _record(collectives=[_row(17_000_000, **grad)]))
  doubled = _record(collectives=[_row(32 * 2**20, count=8, **grad)])
  assert fsm.snapshot_diff(old, doubled) == [
    'all-reduce over model (gradient, params/w, m.py:4): 16.00 MiB -> 32.00 MiB '
    'per step',
    'all-reduce over model (gradient, params/w, m.py:4): 4 -> 8 times per step',
  ]
  gather = {'kind': 'all-gather', 'axes': ['data'], 'bytes': int(1.2 * 2**30)}
  gather |= {'count': 2, 'reason': 'activation', 'sources': ['model.py:88']}
  assert fsm.snapshot_diff(old, _record(collectives=[gather, *old['collectives']])) == [
    'new all-gather over data, 1.20 GiB/step, reason activation, model.py:88'
  ]
  assert fsm.snapshot_diff(old, _record()) == [
    'removed all-reduce over model, 16.00 MiB/step, reason gradient, params/w, m.py:4'
  ]


def test_collectives_are_matched_by_scope_not_source_line():
  grad = {'reason': 'gradient', 'parameters': ['params/w'], 'scope': 'Model/mlp'}
  old = _record(collectives=[_row(1024, sources=['pkg/m.py:4'], **grad)])
  moved = _record(collectives=[_row(1024, sources=['pkg/m.py:5'], **grad)])
  assert fsm.snapshot_diff(old, moved) == []
  other = _record(collectives=[_row(1024, sources=['pkg/m.py:4'], **grad)])
  other['collectives'][0]['scope'] = 'Model/attn'
  assert fsm.snapshot_diff(old, other) == [
    'new all-reduce over model, 1.00 KiB/step, reason gradient, params/w, '
    'in Model/attn, pkg/m.py:4',
    'removed all-reduce over model, 1.00 KiB/step, reason gradient, params/w, '
    'in Model/mlp, pkg/m.py:4',
  ]
  # A reason this version does not know is one more opaque reason.
  unknown = _record(collectives=[_row(1024, **{**grad, 'reason': 'unknown'})])
  assert fsm.snapshot_diff(unknown, unknown) == []
  assert fsm.snapshot_diff(old, unknown) == [
    'removed all-reduce over model, 1.00 KiB/step, reason gradient, params/w, '
    'in Model/mlp, pkg/m.py:4',
    'new all-reduce over model, 1.00 KiB/step, reason unknown, params/w, in Model/mlp',
  ]


def test_collective_rows_differing_only_in_lines_are_one_with_their_lines(
  tmp_path, monkeypatch
):
  monkeypatch.syspath_prepend(str(tmp_path))
  grad = {'reason': 'gradient', 'parameters': ['params/w'], 'scope': 'Model'}
  rows = [
    _row(1024, sources=[f'{tmp_path}/pkg/m.py:9', 'pkg/m.py:10'], **grad),
    _row(1024, sources=['pkg/m.py:10'], **grad),
  ]
  (merged,) = snapshot_diff_module.merge_collectives(rows)
  assert merged['bytes'] == 2048 and merged['count'] == 8
  # An absolute file is named from its import root (here a sys.path entry).
  assert merged['sources'] == ['pkg/m.py:10', 'pkg/m.py:9']


def test_rows_without_attribution_read_as_before_it():
  # Reports from before collectives were attributed: no reason, no paths.
  old = _record(collectives=[_row(1024)])
  assert fsm.snapshot_diff(old, _record(collectives=[_row(2048)])) == [
    'all-reduce over model: 1.00 KiB -> 2.00 KiB per step'
  ]
  # Rows a diff cannot tell apart are one: their bytes, counts and links summed.
  split = [{**_row(1024), 'link': 'ici'}, {**_row(1024), 'link': 'dcn'}]
  one = {**_row(2048, count=8), 'link': 'dcn+ici'}
  assert fsm.snapshot_diff(_record(collectives=split), _record(collectives=[one])) == []


def test_constraints_are_matched_by_scope_and_layout_not_line():
  def constraint(spec, shape=(8, 32), where=('model.py:40',)):
    row = {'scope': 'Model/attn', 'shape': list(shape), 'spec': spec}
    return {**row, 'where': list(where), 'count': 1}

  old = _record(constraints=[constraint("P('data', None)")])
  new = _record(constraints=[constraint("P(None, 'model')")])
  assert fsm.snapshot_diff(old, new) == [
    "constraint at model.py:40 (Model/attn): P('data', None) -> P(None, 'model')"
  ]
  wider = _record(constraints=[constraint("P('data', None)", (16, 32))])
  assert fsm.snapshot_diff(old, wider) == [
    "constraint at model.py:40 (Model/attn): P('data', None) on [8, 32] -> "
    "P('data', None) on [16, 32]"
  ]
  moved = _record(constraints=[constraint("P('data', None)", where=['model.py:41'])])
  assert fsm.snapshot_diff(old, moved) == []
  twice = constraint("P('data', None)", where=['model.py:9', 'model.py:41'])
  twice['count'] = 2
  assert fsm.snapshot_diff(old, _record(constraints=[twice])) == [
    "constraint at model.py:9, model.py:41 (Model/attn): P('data', None) on "
    '[8, 32]: 1 -> 2 times'
  ]
  elsewhere = {**constraint("P('data', None)"), 'scope': 'Model/mlp'}
  assert fsm.snapshot_diff(old, _record(constraints=[elsewhere])) == [
    "removed constraint at model.py:40 (Model/attn): P('data', None) on [8, 32]",
    "new constraint at model.py:40 (Model/mlp): P('data', None) on [8, 32]",
  ]


def test_mesh_and_sections_are_compared():
  old = _record(parameters={'params/w': 'P()'}, inputs={'x': "P('data')"})
  new = {**_record(parameters={'params/x': "P('data')"}), 'mesh': {}}
  assert fsm.snapshot_diff(old, new) == [
    'mesh: data=8 (?, abstract) -> no axes (?, abstract)',
    'removed parameter params/w: P()',
    "new parameter params/x: P('data')",
    "removed input x: P('data')",
  ]


@pytest.mark.parametrize(
  'bad, message',
  [
    ([], 'not a layout snapshot'),
    ({'parameters': {}}, 'not a layout snapshot'),
    ({'version': 99}, 'version 99'),
    ({'version': 1}, 'version 1.*must be recorded again'),
    ({'version': 2, 'constraints': {}}, r'new: "constraints" is \{\}; expected a list'),
    ({'version': 2, 'collectives': [{'bytes': 1}]}, r'new: collectives\[0\]\["kind"\]'),
  ],
)
def test_what_is_not_a_snapshot_is_said(bad, message):
  with pytest.raises(fsm.FitError, match=message):
    fsm.snapshot_diff(_record(), bad)


# The commands
# ------------------------------------------------------------------------------


def run(capsys, *argv):
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


def test_snapshot_and_diff_commands(capsys, tmp_path):
  mlp = ['snapshot', '--model', 'mlp', '--mesh', 'data=2,model=4', '--batch', '16']
  first, second = tmp_path / 'a.json', tmp_path / 'b.json'
  code, out, err = run(capsys, *mlp, '--out', str(first))
  assert (code, out) == (0, ''), err
  snap = json.loads(first.read_text())
  assert snap['source'] == 'estimate' and snap['mesh']['device_kind'] is None
  assert snap['parameters']
  code, out, _ = run(capsys, *mlp)
  assert code == 0 and json.loads(out) == snap
  assert run(capsys, 'diff', str(first), str(first)) == (0, '', '')
  other = '[["batch", "data"], ["hidden", null], ["embed", null], ["layers", null]]'
  assert run(capsys, *mlp, '--rules', other, '--out', str(second))[0] == 0
  code, out, _ = run(capsys, 'diff', str(first), str(second))
  assert code == 1
  assert "state/params/ScanDotReluDot_0/W2: P(None, 'model', None) -> " in out


FACTORY = textwrap.dedent(
  """
  import jax, jax.numpy as jnp, flax_shardmeta as fsm

  def make():
    w = jax.ShapeDtypeStruct((16, 8), jnp.float32)
    x = jax.ShapeDtypeStruct((32, 16), jnp.float32)
    step = lambda params, x: (x @ fsm.unbox(params)['w']).sum()
    return jax.jit(step), {'w': fsm.LogicalPartitioned(w, ('embed', 'mlp'))}, x
  """
)


def test_snapshot_command_of_your_own_step(capsys, tmp_path, monkeypatch):
  (tmp_path / 'snapshot_factory.py').write_text(FACTORY)
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, 'path', list(sys.path))
  argv = ['snapshot', '--module', 'snapshot_factory:make', '--mesh', 'data=2,model=4']
  code, out, err = run(capsys, *argv, '--rules', '[["mlp", "model"], ["embed", null]]')
  assert code == 0, err
  snap = json.loads(out)
  assert snap['parameters'] == {'params/w': "P(None, 'model')"}
  assert snap['inputs'] == {'x': 'P(None, None)'}


def test_diff_command_exits_2_on_bad_input(capsys, tmp_path):
  good, text, other = tmp_path / 'a.json', tmp_path / 'b.txt', tmp_path / 'c.json'
  good.write_text(json.dumps(_record()))
  text.write_text('not json')
  other.write_text('{"rows": []}')
  for argv, message in [
    ([str(good), str(tmp_path / 'missing.json')], 'cannot read'),
    ([str(good), str(text)], 'holds no JSON'),
    ([str(good), str(other)], 'not a layout snapshot'),
  ]:
    code, out, err = run(capsys, 'diff', *argv)
    assert code == 2 and out == '' and err.count('\n') == 1, err
    assert err.startswith('flax-shardmeta: error: ') and message in err


def test_snapshot_command_exits_2_on_bad_arguments(capsys, tmp_path):
  code, _, err = run(capsys, 'snapshot', '--model', 'gpt5', '--mesh', 'data=2')
  assert code == 2 and "unknown model 'gpt5'" in err
  argv = ['snapshot', '--model', 'mlp', '--mesh', 'data=2,model=4']
  code, _, err = run(capsys, *argv, '--out', str(tmp_path / 'no' / 'dir.json'))
  assert code == 2 and '--out' in err and err.count('\n') == 1
