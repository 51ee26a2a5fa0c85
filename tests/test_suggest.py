"""``fsm.suggest``: presets, candidates, pruning and ranking.

On the 8 simulated CPU devices with v5p figures (``chip='v5p'``) and a small
``hbm`` to force rejections; the CLI on a TPU topology where libtpu is
installed. Built-in steps (the MLP, Llama, the mixture-of-experts example) use
Auto mesh axes. GPU verdicts and ranking: tests/test_suggest_gpu.py.
"""

import json
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta import cli, examples
from flax_shardmeta._capacity.suggest import (
  presets as presets_lib,
  search as _search,
)
from flax_shardmeta.examples import linen, moe, train


def llama_specs(preset):
  """Specs of a few Llama-3-8B parameters under ``preset``, on an abstract mesh."""
  sizes = {'data': 2, 'fsdp': 4, 'model': 4, 'expert': 4}
  mesh = AbstractMesh(
    tuple(sizes[a] for a in preset.axes),
    preset.axes,
    axis_types=(AxisType.Auto,) * len(preset.axes),
  )
  _, state, _ = train.train_step('llama3-8b', mesh, rules=preset.rules, num_layers=2)
  plan = fsm.plan(state, mesh, preset.rules)
  names = ('embedding', 'layers/wq', 'layers/wk', 'layers/w1', 'lm_head')
  specs = {n: plan.entry(f'params/{n}').spec for n in names}
  specs['batch'] = fsm.logical_to_mesh_axes(('batch', None), preset.rules)
  return specs


@pytest.mark.parametrize(
  'name, expected',
  [
    (
      'fsdp',
      {
        'embedding': P(None, 'fsdp'),
        'layers/wq': P(None, 'fsdp', None, None),
        'layers/w1': P(None, 'fsdp', None),
        'batch': P(('data', 'fsdp'), None),
      },
    ),
    (
      'fsdp+tp',
      {
        'embedding': P('model', 'fsdp'),
        'layers/wq': P(None, 'fsdp', 'model', None),
        'layers/wk': P(None, 'fsdp', 'model', None),
        'layers/w1': P(None, 'fsdp', 'model'),
        'lm_head': P('fsdp', 'model'),
        'batch': P(('data', 'fsdp'), None),
      },
    ),
    (
      'tp',
      {
        'embedding': P('model', None),
        'layers/wq': P(None, None, 'model', None),
        'layers/w1': P(None, None, 'model'),
        'batch': P('data', None),
      },
    ),
    ('t5x-1d', {'layers/w1': P(None, None, 'model'), 'batch': P('data', None)}),
    ('t5x-2d', {'layers/w1': P(None, 'data', 'model'), 'batch': P('data', None)}),
    ('ep', {'layers/w1': P(None, None, None), 'batch': P(('data', 'expert'), None)}),
    (
      'ep+tp',
      {
        'layers/wq': P(None, None, 'model', None),
        'layers/w1': P(None, None, 'model'),
        'batch': P(('data', 'expert'), None),
      },
    ),
  ],
)
def test_presets_give_their_documented_specs(name, expected):
  specs = llama_specs(fsm.RULE_PRESETS[name])
  for param, spec in expected.items():
    assert specs[param] == spec, (name, param)
  assert name in presets_lib.__doc__


def test_presets_are_validated_and_loaded():
  with pytest.raises(fsm.InvalidRulesError, match=r"use mesh axes \['model'\]"):
    fsm.RulePreset('bad', ('data',), [('mlp', 'model')])
  with pytest.raises(fsm.InvalidRulesError, match="unknown rule preset 'zero3'"):
    presets_lib.resolve(['fsdp', 'zero3'])
  (mine,) = presets_lib.load(
    '[presets.mine]\naxes = ["data", "model"]\n'
    'rules = [["batch", "data"], ["mlp", "model"], ["embed", []]]'
  )
  assert mine.rules == (('batch', 'data'), ('mlp', 'model'), ('embed', None))
  with pytest.raises(fsm.InvalidRulesError, match='needs axes and rules'):
    presets_lib.load('{"mine": {"axes": ["data"]}}')


def test_candidates_keep_model_axes_inside_a_host():
  splits = list(_search.factorizations(('data', 'fsdp', 'model'), 128, 4, 1))
  assert (1, 32, 4) in splits and (2, 16, 4) in splits
  assert all(model in (2, 4) for _, _, model in splits)  # 4 chips a host
  assert not any(fsdp == 1 for _, fsdp, _ in splits)  # that is the 'tp' preset
  assert (128, 1) in list(_search.factorizations(('data', 'fsdp'), 128, 4, 1))
  sliced = list(_search.factorizations(('data', 'model'), 16, 4, 2))
  assert all(data % 2 == 0 for data, _ in sliced)  # 'data' spans both slices
  # The model axis inside a host; an expert axis may span hosts (its routing
  # crosses the network there, as expert parallelism across nodes does).
  both = list(_search.factorizations(('data', 'expert', 'model'), 16, 4, 1))
  assert (1, 8, 2) in both and (2, 2, 4) in both and (1, 2, 8) not in both
  assert all(model in (2, 4) for _, _, model in both)
  shared = list(_search.factorizations(('data', 'fsdp', 'expert'), 64, 4, 1))
  assert {e for _, _, e in shared} == {2, 4, 8, 16, 32} and (1, 8, 8) in shared


def test_the_pick_takes_each_presets_best_before_another_knob_value():
  memory = _search.Memory(64 << 30, None)
  made = []
  for name, shape in (
    ('fsdp', {'data': 1, 'fsdp': 8}),
    ('ep', {'data': 2, 'expert': 4}),
  ):
    for k, factor in enumerate((1.0, 1.25, 2.0)):
      c = fsm.Candidate(fsm.RULE_PRESETS[name], shape, 'full')
      c.knobs = (('capacity_factor', factor),)
      c.estimate, c.estimate_verdict = (1 + k) << 30, 'fits'
      made.append(c)
  made[3].estimate = 10 << 30  # ep's best estimates more than every fsdp value
  picked = _search.pick(made, 2, memory)
  assert {c.preset.name for c in picked} == {'fsdp', 'ep'}
  assert [c.preset.name for c in _search.pick(made, 6, memory)].count('ep') == 3


def grid(**kwargs):
  options = dict(
    batch=64,
    chip='v5p',
    presets=['fsdp', 'tp'],
    remat=['none'],
    max_candidates=20,
    progress=False,
  )
  options.update(kwargs)
  return fsm.suggest(train.builder('mlp', batch=64), **options)


def test_ranking_agrees_with_fit_on_each_candidate():
  found = grid(hbm='100MiB', max_candidates=4)
  assert len(found) >= 2 and found[0].fits
  mesh_of = {}
  for c in (found[0], found[1]):
    mesh = jax.make_mesh(
      tuple(c.shape.values()), tuple(c.shape), axis_types=(AxisType.Auto,) * 2
    )
    mesh_of[c.label] = mesh
    alone = fsm.fit(
      *train.builder('mlp', batch=64)(mesh, c.preset.rules, c.remat),
      hbm='100MiB',
      chip='v5p',
    )
    assert alone.total_bytes == c.total_bytes and alone.fits == c.fits
    assert alone.roofline is not None and c.report is not None
    assert alone.roofline.step_s == pytest.approx(c.step_s)
  # Fitting ones first, then by estimated step time.
  fitting = [c for c in found if c.fits]
  assert found[: len(fitting)] == fitting
  steps = [c.step_s for c in fitting]
  assert steps == sorted(steps)
  assert found[0].reason and 'vs the next' in found[0].reason
  compared = found[0].compare()
  assert 'mesh and rules for the training script:' in compared
  assert 'fsm.make_mesh(' in compared and 'rules = [' in compared
  # explain(): its former name, deprecated (an explanation is per dimension).
  with pytest.deprecated_call(match=r'use Candidate\.compare\(\)'):
    assert found[0].explain() == compared


def test_pruning_never_rejects_a_layout_that_compiles_within_the_hbm():
  # A small HBM rejects the replicated layouts before compiling; compile
  # every rejected one anyway: none of them fits.
  found = grid(hbm='10MiB', presets=['fsdp', 'tp', 't5x-2d'])
  assert found.rejected, 'the grid should reject something'
  for c in found.rejected:
    mesh = jax.make_mesh(
      tuple(c.shape.values()), tuple(c.shape), axis_types=(AxisType.Auto,) * 2
    )
    args = train.builder('mlp', batch=64)(mesh, c.preset.rules, c.remat)
    try:
      report = fsm.fit(*args, hbm='10MiB')
    except fsm.ShardingError:
      assert 'shapes do not divide' in (c.rejected or '')
      continue
    assert report.fits is False, c.label
  assert any('alone need' in (c.rejected or '') for c in found.rejected)


def test_batch_that_does_not_divide_is_rejected_with_the_reason():
  found = fsm.suggest(
    train.builder('mlp', batch=6),
    batch=6,
    chip='v5p',
    presets=['fsdp'],
    remat=['none'],
    progress=False,
  )
  reasons = {c.label: c.rejected for c in found.rejected}
  assert reasons['fsdp data=1 fsdp=8, remat none'] == (
    'the batch of 6 does not divide over 8 batch shards'
  )


def test_nothing_fits_names_the_closest():
  found = grid(hbm='1MiB', max_candidates=2)
  assert found.fitting == [] or all(not c.fits for c in found)
  text = str(found)
  if found:
    assert 'nothing fits; closest:' in text
  json.dumps(found.to_dict())


def test_bad_arguments_are_named():
  with pytest.raises(fsm.FitError, match='batch=0'):
    grid(batch=0)
  with pytest.raises(fsm.FitError, match='max_candidates=0'):
    grid(max_candidates=0)


def test_an_estimate_too_close_to_call_is_compiled_before_one_over():
  # Ordering only: estimates on the same preset and remat, the smallest over
  # the memory by more than the estimate's error, one within it.
  def candidate(shape, estimate, verdict):
    c = fsm.Candidate(fsm.RULE_PRESETS['fsdp'], shape, 'none')
    c.estimate, c.estimate_verdict = estimate, verdict
    return c

  over = candidate({'data': 1, 'fsdp': 8}, 50, 'does_not_fit')
  close = candidate({'data': 2, 'fsdp': 4}, 100, 'too_close')
  fits = candidate({'data': 4, 'fsdp': 2}, 200, 'fits')
  memory = _search.Memory(capacity=90, usable=None)
  assert _search.pick([over, close, fits], 2, memory) == [close, fits]


def _names(module_and_input):
  return presets_lib.model_names([examples.abstract_linen_params(*module_and_input)])


def test_every_built_in_preset_shards_names_an_example_model_carries():
  models = {
    'mlp': _names(linen.model('mlp')),
    'llama3-8b': _names(linen.model('llama3-8b', num_layers=2)),
    'moe-tiny': _names(moe.model('moe-tiny')),
  }
  assert 'expert' in models['moe-tiny'] and 'hidden' in models['mlp']
  meant_for = {
    'fsdp': ('mlp', 'llama3-8b'),
    'fsdp+tp': ('mlp', 'llama3-8b'),
    'tp': ('mlp', 'llama3-8b'),
    't5x-1d': ('llama3-8b',),
    't5x-2d': ('llama3-8b',),
    'ep': ('moe-tiny',),
    'ep+tp': ('moe-tiny',),
    'ep+fsdp': ('moe-tiny',),
  }
  assert set(meant_for) == set(fsm.RULE_PRESETS)
  for name, preset in fsm.RULE_PRESETS.items():
    for model in meant_for[name]:
      assert presets_lib.unused_presets([preset], models[model]) == {}, (name, model)
  # The 'ep' preset once mapped 'experts', a name the MoE example does not use.
  stale = fsm.RulePreset(
    'ep', ('data', 'expert'), [('batch', ('data', 'expert')), ('experts', 'expert')]
  )
  with pytest.warns(UserWarning, match=r"'experts' -> did you mean 'expert'\?"):
    assert 'ep' in presets_lib.unused_presets([stale], models['moe-tiny'])


def test_a_preset_the_model_has_no_names_for_is_skipped_with_a_warning():
  typo = fsm.RulePreset(
    'typo', ('data', 'model'), [('batch', 'data'), ('hiden', 'model')]
  )
  with pytest.warns(
    UserWarning,
    match=r"rule preset 'typo' shards logical names \['hiden'\], none of which the "
    r"model's arguments carry \(their names: \['embed', 'hidden', 'layers'\]\) "
    r"\('hiden' -> did you mean 'hidden'\?\)",
  ):
    found = grid(presets=['fsdp', typo], max_candidates=1)
  tried = [*found, *found.rejected, *found.skipped]
  assert tried and {c.preset.name for c in tried} == {'fsdp'}
  assert list(found.skipped_presets) == ['typo']
  assert 'presets skipped (1):' in str(found)
  assert found.to_dict()['skipped_presets']['typo'].startswith("rule preset 'typo'")


DATA_PARALLEL = fsm.RulePreset('dp', ('data',), [('batch', 'data')])


def moe_build():
  """The tiny mixture-of-experts example, float32 and SGD: quick to compile."""
  return train.builder(
    'moe-tiny', batch=8, seq=8, optimizer_name='sgd', dtype=jnp.float32
  )


def _parameter_bytes(params):
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(fsm.unbox(params)))


def test_the_ep_preset_shards_the_moe_examples_experts():
  found = fsm.suggest(
    moe_build(),
    batch=8,
    chip='v5p',
    presets=['ep', DATA_PARALLEL],
    remat=['none'],
    max_candidates=1,
    progress=False,
  )
  (best,) = found
  assert best.preset.name == 'ep' and best.fits
  mesh = _search.abstract_mesh(best)
  _, state, _ = moe_build()(mesh, best.preset.rules, 'none')
  spec = fsm.plan(state, mesh, best.preset.rules).entry('params/layers/w1').spec
  assert spec == P(None, 'expert', None, None)
  # Plain data parallelism holds every parameter on every chip.
  (dp,) = [c for c in found.skipped if c.preset.name == 'dp']
  replicated = _parameter_bytes(state.params)
  assert dp.lower_bound == 2 * replicated  # SGD: no optimizer state
  assert best.report.row('parameters') < replicated / 2


def test_a_knob_grid_builds_each_layout_once_per_value():
  found = fsm.suggest(
    moe_build(),
    batch=8,
    chip='v5p',
    presets=['ep'],
    remat=['none'],
    knobs={'capacity_factor': [0.5, 2.0]},
    max_candidates=2,
    progress=False,
  )
  tried = [*found, *found.rejected, *found.skipped]
  assert {c.knobs for c in tried} == {
    (('capacity_factor', 0.5),),
    (('capacity_factor', 2.0),),
  }
  # One compiled per value: the pick spreads over the knobs' values.
  by_value = {dict(c.knobs)['capacity_factor']: c for c in found}
  assert sorted(by_value) == [0.5, 2.0] and all(c.fits for c in found)
  # Twice the capacity per expert: the dispatch buffers grow with it.
  assert by_value[2.0].total_bytes > by_value[0.5].total_bytes
  # seq 8, top-2 of 8 experts: 2 tokens per expert and row, 1 slot at 0.5.
  assert by_value[0.5].knob_notes == (
    'capacity_factor=0.5 drops 50% of the routed tokens at uniform routing'
  )
  assert by_value[2.0].knob_notes.endswith('drops no token at uniform routing')
  assert all(c.knob_notes in c.reason for c in found)
  assert by_value[0.5].label.endswith(', remat none, capacity_factor=0.5')
  assert by_value[0.5].to_dict()['knobs'] == {'capacity_factor': 0.5}
  table = found.format()
  assert 'knobs' in table.splitlines()[1] and 'capacity_factor=2.0' in table
  # The tokens routed to the experts and back, a column of their own.
  assert 'routing' in table.splitlines()[1]
  # (Which layouts move tokens is XLA's choice: some do.)
  assert any(c.routing_bytes for c in found)
  assert all(c.to_dict()['routing_bytes'] == c.routing_bytes for c in found)


def test_knobs_the_build_cannot_take_are_refused_up_front():
  with pytest.raises(fsm.FitError, match='knobs.*capacity'):
    fsm.suggest(
      moe_build(),
      batch=8,
      chip='v5p',
      presets=['ep'],
      knobs={'capacity': [1.0]},
      progress=False,
    )
  for bad in ({'capacity_factor': []}, [('capacity_factor', 1.0)]):
    with pytest.raises(fsm.FitError, match='knob'):
      fsm.suggest(moe_build(), batch=8, chip='v5p', knobs=bad, progress=False)
  with pytest.raises(ValueError, match='capacity_factor is a setting'):
    train.train_step('mlp', AbstractMesh((8,), ('data',)), capacity_factor=1.0)


def test_the_ep_tp_preset_produces_candidates():
  found = fsm.suggest(
    moe_build(),
    batch=8,
    chip='v5p',
    presets=['ep+tp'],
    remat=['none'],
    max_candidates=1,
    progress=False,
  )
  tried = [*found, *found.rejected, *found.skipped]
  assert {tuple(c.shape) for c in tried} == {('data', 'expert', 'model')}
  assert found[0].fits and found[0].preset.name == 'ep+tp'
  mesh = _search.abstract_mesh(found[0])
  rules = found[0].preset.rules
  _, state, _ = moe_build()(mesh, rules, 'none')
  spec = fsm.plan(state, mesh, rules).entry('params/layers/w1').spec
  assert spec == P(None, 'expert', None, 'model')
  # model=4 does not divide the tiny model's two kv heads.
  assert any('shapes do not divide' in (c.rejected or '') for c in found.rejected)


def test_the_expert_axis_shared_with_fsdp_is_ranked_over_expert_degrees():
  found = fsm.suggest(
    moe_build(),
    batch=8,
    chip='v5p',
    presets=['fsdp', 'ep', 'ep+fsdp'],
    remat=['none'],
    max_candidates=3,
    progress=False,
  )
  tried = [*found, *found.rejected, *found.skipped]
  shared = [c for c in tried if c.preset.name == 'ep+fsdp']
  # Every split of 8 chips with both axes: expert degree 2 and 4.
  assert {(c.shape['fsdp'], c.shape['expert']) for c in shared} >= {
    (2, 2),
    (4, 2),
    (2, 4),
  }
  assert {c.preset.name for c in found} == {'fsdp', 'ep', 'ep+fsdp'}
  (best_shared,) = [c for c in found if c.preset.name == 'ep+fsdp']
  mesh = _search.abstract_mesh(best_shared)
  rules = best_shared.preset.rules
  _, state, _ = moe_build()(mesh, rules, 'none')
  plan = fsm.plan(state, mesh, rules)
  # The experts on their axis, their embed over fsdp; the rest over both.
  assert plan.entry('params/layers/w1').spec == P(None, 'expert', 'fsdp', None)
  assert plan.entry('params/layers/wq').spec[1] == ('fsdp', 'expert')
  # Expert-parallel: the experts stay, no finding.
  assert best_shared.fits and best_shared.report is not None
  assert not [n for n in best_shared.report.notes if 'expert-parallel' in n]
  assert not [
    r
    for r in best_shared.report.collectives
    if r.reason == 'parameter'
    and r.parameters[0].endswith(('/w1', '/w2', '/w3'))
    and 'expert' in r.axes
  ]
  # The rest is FSDP over both axes: the attention's weights gathered over them.
  assert [
    r
    for r in best_shared.report.collectives
    if r.reason == 'parameter'
    and r.parameters[0].endswith('/wq')
    and r.axes == ('fsdp', 'expert')
  ]


@pytest.mark.libtpu
@pytest.mark.slow
def test_cli_ranks_and_explains_on_a_topology(capsys):
  argv = [
    'suggest',
    '--model',
    'mlp',
    '--topology',
    'v5p:2x2x1',
    '--batch',
    '64',
    '--presets',
    'fsdp,tp',
    '--remat',
    'none',
  ]
  code = cli.main(argv)
  out, err = capsys.readouterr()
  assert code == 0, err
  assert 'compiled layouts fit; best first:' in out
  assert 'mesh and rules for the training script:' in out
  code = cli.main([*argv, '--hbm', '1KiB'])
  out, err = capsys.readouterr()
  assert code == 1
  assert 'nothing fits; closest is' in err or 'alone need' in out
  code = cli.main([*argv, '--presets', 'zero3'])
  _, err = capsys.readouterr()
  assert code == 2 and "'zero3' is neither a preset" in err


MY_SEARCH = textwrap.dedent(
  """
  import jax, jax.numpy as jnp, flax_shardmeta as fsm

  CALLS = []

  def make(batch, remat='none'):
    mesh = jax.sharding.get_abstract_mesh()
    CALLS.append((mesh.axis_names, fsm.get_logical_axis_rules(), batch, remat))
    w = jax.ShapeDtypeStruct((256, 512), jnp.float32)
    tokens = jax.ShapeDtypeStruct((batch, 256), jnp.float32)
    return (
      lambda w, x: jnp.tanh(x @ w).sum(),
      fsm.LogicalPartitioned(w, ('embed', 'mlp')),
      fsm.LogicalPartitioned(tokens, ('batch', 'embed')),
    )

  def fixed():
    return make(64)
  """
)
SEARCH = ['suggest', '--topology', 'v5p:2x2x1', '--batch', '64', '--presets', 'tp']


@pytest.fixture
def my_search(tmp_path, monkeypatch):
  """``my_search.py`` (the factories above) on the path."""
  (tmp_path / 'my_search.py').write_text(MY_SEARCH)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.delitem(sys.modules, 'my_search', raising=False)


@pytest.mark.libtpu
def test_cli_searches_your_own_step(capsys, my_search):
  code = cli.main([*SEARCH, '--module', 'my_search:make', '--max-candidates', '1'])
  out, err = capsys.readouterr()
  assert code == 0, err
  assert out.startswith('1 of 1 compiled layouts fit; best first:')
  calls = sys.modules['my_search'].CALLS
  # Each candidate's mesh and preset rules, the given batch, each remat policy.
  tp = fsm.RULE_PRESETS['tp'].rules
  assert {(names, rules, batch) for names, rules, batch, _ in calls} == {
    (('data', 'model'), tp, 64)
  }
  assert {remat for *_, remat in calls} == {'none', 'full'}


def test_cli_options_your_factory_does_not_take_are_errors(capsys, my_search):
  code = cli.main([*SEARCH, '--module', 'my_search:fixed'])
  out, err = capsys.readouterr()
  assert (code, out) == (2, '')
  assert err == (
    'flax-shardmeta: error: --batch 64: my_search:fixed() takes no batch keyword '
    'argument; add the parameter (or **kwargs), or leave --batch out\n'
  )


def test_cli_presets_file_with_a_misspelt_axis(capsys, tmp_path):
  path = tmp_path / 'mine.toml'
  path.write_text(
    '[presets.mine]\naxes = ["data", "model"]\n'
    'rules = [["batch", "data"], ["mlp", "modle"]]\n'
  )
  code = cli.main(['suggest', '--model', 'mlp', *SEARCH[1:5], '--presets', str(path)])
  _, err = capsys.readouterr()
  assert code == 2
  assert err == (
    f"flax-shardmeta: error: --presets '{path}': preset 'mine' shards over mesh axis "
    "'modle', which is not among its axes ('data', 'model'): did you mean 'model'?\n"
  )


def test_python_users_get_the_presets_misspelt_axis_and_one_rules_reader():
  # The hint the command line gives for a presets file, for RulePreset itself.
  with pytest.raises(fsm.InvalidRulesError, match="did you mean 'model'"):
    fsm.RulePreset('mine', ('data', 'model'), [('batch', 'data'), ('mlp', 'modle')])
  # A presets file's rules and a --rules file are read by one function: an
  # empty list is replicated, and a malformed rule names its preset.
  (p,) = presets_lib.load('[presets.dp]\naxes = ["data"]\nrules = [["embed", []]]')
  assert p.rules == (('embed', None),)
  with pytest.raises(fsm.InvalidRulesError, match="preset 'bad' in <presets>"):
    presets_lib.load('[presets.bad]\naxes = ["data"]\nrules = [["embed"]]')


@pytest.mark.parametrize('spelling', ['t5x', 't5x-1d', 't5x-2d'])
def test_rules_accept_the_preset_spelling(spelling):
  from flax_shardmeta.cli import rule_files

  wanted = fsm.RULE_PRESETS['t5x-2d' if spelling == 't5x-2d' else 't5x-1d'].rules
  assert rule_files.load_rules(spelling) == wanted
