"""Golden files edited by hand, misnamed or misread: each is fsm's own error
naming the file, the entry and what it should be, or compared for what it
means; never a raw Python error nor a silent wrong answer.

The snapshots here are written as JSON by hand, as a reviewer edits them; no
mesh is made (the axis types recorded are Auto).
"""

import json

import pytest

import flax_shardmeta as fsm
from flax_shardmeta import cli

GOOD = {
  'version': 2,
  'mesh': {
    'axis_names': ['data', 'model'],
    'axis_sizes': [2, 4],
    'axis_types': ['Auto', 'Auto'],
    'device_kind': None,
  },
  'source': 'estimate',
  'parameters': {'params/w': "P(None, 'model')"},
  'constraints': [
    {'scope': 'Model', 'shape': [8, 32], 'spec': "P('data', 'model')", 'count': 1,
     'where': ['model.py:40']},
  ],
  'collectives': [
    {'kind': 'all-reduce', 'axes': ['data'], 'link': None, 'reason': 'gradient',
     'parameters': ['params/w'], 'scope': 'Model', 'sources': ['model.py:40'],
     'bytes': 1024, 'count': 1},
  ],
}  # fmt: skip


def _edited(**changes):
  """GOOD, with fields of its first collective row replaced."""
  snap = json.loads(json.dumps(GOOD))
  snap['collectives'][0].update(changes)
  return snap


def _write(tmp_path, content, name='layout.json'):
  path = tmp_path / name
  path.write_text(content if isinstance(content, str) else json.dumps(content))
  return path


def _compare(tmp_path, content):
  """``assert_snapshot`` of GOOD against a golden file holding ``content``."""
  path = _write(tmp_path, content)
  fsm.testing.assert_snapshot(GOOD, path)
  return path


@pytest.mark.parametrize(
  'content, field, expected',
  [
    (_edited(bytes='1 KiB'), r'collectives\[0\]\["bytes"\]', 'whole number'),
    ('{"version": 2, "collectives": [{"kind": "all-reduce", "bytes": NaN}]}',
     r'collectives\[0\]\["bytes"\]', 'whole number'),
    (_edited(count=1.5), r'collectives\[0\]\["count"\]', 'whole number'),
    ({**GOOD, 'constraints': [{**GOOD['constraints'][0], 'shape': 5}]},
     r'constraints\[0\]\["shape"\]', 'list of dimension sizes'),
    ({**GOOD, 'parameters': {'params/w': 5}}, r"parameters\['params/w'\]", 'spec text'),
    ({**GOOD, 'mesh': {**GOOD['mesh'], 'axis_sizes': ['2', 4]}},
     r'mesh\["axis_sizes"\]\[0\]', 'whole number'),
  ],
)  # fmt: skip
def test_a_hand_edited_field_is_named_with_the_file(tmp_path, content, field, expected):
  # Was: a raw ValueError / TypeError from int() deep in the diff, no file.
  with pytest.raises(fsm.FitError, match=field) as info:
    _compare(tmp_path, content)
  text = str(info.value)
  assert str(tmp_path / 'layout.json') in text and expected in text
  assert 'FLAX_SHARDMETA_UPDATE_SNAPSHOTS=1' in text


@pytest.mark.parametrize('content', ['[]', 'null', '{}', '"layout"'])
def test_what_is_no_snapshot_is_named_by_its_path(tmp_path, content):
  with pytest.raises(fsm.FitError, match='not a layout snapshot') as info:
    _compare(tmp_path, content)
  assert str(tmp_path / 'layout.json') in str(info.value)


def test_a_directory_is_said_to_be_one(tmp_path):
  # Was: IsADirectoryError from reading it.
  with pytest.raises(fsm.FitError, match='is a directory') as info:
    fsm.testing.assert_snapshot(GOOD, tmp_path)
  assert str(tmp_path) in str(info.value)


def test_a_file_that_cannot_be_read_is_named(tmp_path):
  path = tmp_path / 'layout.json'
  path.write_bytes(b'\xff\xfe\x00')  # no text in any encoding read
  with pytest.raises(fsm.FitError, match='cannot read') as info:
    fsm.testing.assert_snapshot(GOOD, path)
  assert str(path) in str(info.value)


@pytest.mark.parametrize(
  'written', ["P(None,'model')", 'P(None, "model")', "P(None, ('model',))",
              "P(None, 'model', None)", "PartitionSpec(None, 'model')"]
)  # fmt: skip
def test_spec_text_is_compared_for_what_it_lays_out(tmp_path, written):
  # Was: "P(None,'model')" without the space reported as a change.
  _compare(tmp_path, {**GOOD, 'parameters': {'params/w': written}})
  assert fsm.snapshot_diff({**GOOD, 'parameters': {'params/w': written}}, GOOD) == []


def test_a_real_spec_change_still_differs_and_reads_canonically():
  moved = {**GOOD, 'parameters': {'params/w': "P('model',None)"}}
  assert fsm.snapshot_diff(moved, GOOD) == [
    "params/w: P('model', None) -> P(None, 'model')"
  ]
  constraint = {**GOOD['constraints'][0], 'spec': "P('data',)"}
  moved = {**GOOD, 'constraints': [constraint]}
  # P('data') on a matrix is P('data', None): a change of the second entry.
  assert fsm.snapshot_diff(moved, GOOD) == [
    "constraint at model.py:40 (Model): P('data', None) -> P('data', 'model')"
  ]


def test_axes_written_as_one_name_are_one_axis():
  # Was: "axes": "data" displayed as d+a+t+a, and was a change.
  one = _edited(axes='data')
  assert fsm.snapshot_diff(one, GOOD) == []
  grown = _edited(axes='data', bytes=4096)
  (line,) = fsm.snapshot_diff(GOOD, grown)
  assert line.startswith('all-reduce over data (') and 'd+a' not in line
  with pytest.raises(fsm.FitError, match=r'collectives\[0\]\["axes"\]'):
    fsm.snapshot_diff(_edited(axes='data model'), GOOD)


@pytest.mark.parametrize('value', ['1', 'true', 'True', 'YES', 'on', ' On '])
def test_the_usual_truthy_spellings_record(tmp_path, monkeypatch, value):
  # Was: only '1' recorded; 'true' silently compared (and failed).
  path = _write(tmp_path, {**GOOD, 'parameters': {'params/w': "P('model', None)"}})
  monkeypatch.setenv(fsm.testing.UPDATE_VARIABLE, value)
  fsm.testing.assert_snapshot(GOOD, path)
  assert json.loads(path.read_text()) == GOOD


@pytest.mark.parametrize('value', ['0', 'false', 'No', 'off', ''])
def test_the_usual_falsy_spellings_compare(tmp_path, monkeypatch, value):
  path = _write(tmp_path, {**GOOD, 'parameters': {'params/w': "P('model', None)"}})
  monkeypatch.setenv(fsm.testing.UPDATE_VARIABLE, value)
  with pytest.raises(fsm.testing.SnapshotMismatch):
    fsm.testing.assert_snapshot(GOOD, path)


def test_an_update_value_not_understood_is_an_error(tmp_path, monkeypatch):
  path = _write(tmp_path, GOOD)
  monkeypatch.setenv(fsm.testing.UPDATE_VARIABLE, 'please')
  with pytest.raises(fsm.FitError, match="FLAX_SHARDMETA_UPDATE_SNAPSHOTS='please'"):
    fsm.testing.assert_snapshot(GOOD, path)


@pytest.mark.parametrize('version', [2.0, '2', True, None, [2]])
def test_the_version_is_an_integer_and_nothing_else(version):
  # Was: 2.0 accepted while "2" was refused.
  with pytest.raises(fsm.FitError, match=r'"version" is .*expected an integer, 2'):
    fsm.snapshot_diff({**GOOD, 'version': version}, GOOD)


def test_an_unknown_field_is_named():
  # A misspelt section would otherwise pin nothing, silently.
  with pytest.raises(fsm.FitError, match="'paramters'"):
    fsm.snapshot_diff({**GOOD, 'paramters': {}}, GOOD)
  with pytest.raises(fsm.FitError, match=r"collectives\[0\].*'byte'"):
    fsm.snapshot_diff(_edited(byte=3), GOOD)


def test_extra_and_missing_entries_are_differences():
  fewer = {**GOOD, 'parameters': {}, 'collectives': []}
  assert fsm.snapshot_diff(GOOD, fewer) == [
    "removed parameter params/w: P(None, 'model')",
    'removed all-reduce over data, 1.00 KiB/step, reason gradient, params/w, '
    'in Model, model.py:40',
  ]


def run(capsys, *argv):
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


@pytest.mark.parametrize(
  'content, message',
  [
    (_edited(bytes='1 KiB'), 'collectives[0]["bytes"]'),
    ('{"version": 2, "collectives": [{"kind": "all-reduce", "bytes": NaN}]}',
     'collectives[0]["bytes"] is nan'),
    ({**GOOD, 'version': '2'}, '"version" is \'2\''),
    ('[]', 'not a layout snapshot'),
  ],
)  # fmt: skip
def test_diff_of_a_malformed_file_is_bad_input(capsys, tmp_path, content, message):
  # Was: exit 1 ("differ") with a raw traceback.
  good, bad = _write(tmp_path, GOOD, 'good.json'), _write(tmp_path, content, 'bad.json')
  code, out, err = run(capsys, 'diff', str(good), str(bad))
  assert (code, out) == (2, '') and err.count('\n') == 1, err
  assert err.startswith('flax-shardmeta: error: ') and 'Traceback' not in err
  assert str(bad) in err and message in err


def test_diff_of_a_directory_is_bad_input(capsys, tmp_path):
  good = _write(tmp_path, GOOD, 'good.json')
  code, _, err = run(capsys, 'diff', str(good), str(tmp_path))
  assert code == 2 and 'cannot read' in err and err.count('\n') == 1


@pytest.mark.parametrize('given', [None, {'parameters': {}}, {**GOOD, 'x': object()}])
def test_what_is_no_snapshot_is_never_written_as_a_golden_file(tmp_path, given):
  # Was: None written as "null" (or a raw TypeError), found only on the next run.
  path = tmp_path / 'layout.json'
  with pytest.raises(fsm.FitError, match='the snapshot given'):
    fsm.testing.assert_snapshot(given, path)
  assert not path.exists()
