"""Sharding plans: entries, totals, problems, replicate_indivisible, explanations,
verify."""

import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta import examples
from flax_shardmeta.examples import linen as models, nnx as models_nnx
from flax_shardmeta.examples.linen import LLAMA_RULES, MLP, MLP_RULES, LlamaConfig

TINY_LLAMA = LlamaConfig(
  vocab_size=256,
  dim=64,
  num_layers=3,
  num_heads=4,
  num_kv_heads=2,
  head_dim=16,
  ffn_dim=128,
)


def _sds(shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


def _mlp_state(use_scan=True, num_layers=4, depth=1024, optimizer='adam'):
  params = examples.abstract_linen_params(
    MLP(num_layers=num_layers, depth=depth, use_scan=use_scan), _sds((8, depth))
  )
  return examples.abstract_train_state(params, optimizer)


def test_plan_on_abstract_64x16_mesh():
  mesh = AbstractMesh((64, 16), ('data', 'model'))
  p = fsm.plan(_mlp_state(), mesh, MLP_RULES)
  assert isinstance(p, fsm.ShardingPlan)
  kernel = p.entry('params/ScanDotReluDot_0/Dense_0/kernel')
  assert isinstance(kernel, fsm.PlanEntry)
  assert kernel.shape == (4, 1024, 1024)
  assert kernel.dtype == jnp.float32
  assert kernel.names == ('layers', 'embed', 'hidden')
  assert kernel.spec == P(None, None, 'model')
  assert kernel.shard_shape == (4, 1024, 64)
  assert kernel.bytes_per_device == 4 * 1024 * 64 * 4
  # Adam moments mirror their parameter.
  assert p.entry('opt_state/0/mu/ScanDotReluDot_0/W2').spec == P(None, 'model', None)
  assert p.entry('opt_state/0/count').spec == P()
  assert p.total_bytes == sum(e.size * 4 for e in p.entries)
  assert p.bytes_per_device == sum(e.bytes_per_device for e in p.entries)
  assert p.num_devices == 1024
  assert p.num_elements('params/') == 2 * 4 * 1024 * 1024
  assert not p.problems and not p.adjustments


def test_llama3_70b_has_the_published_parameter_count():
  mesh = AbstractMesh((32, 8), ('data', 'model'))
  state = examples.abstract_state('llama3-70b', optimizer_name='none')
  p = fsm.plan(state, mesh, LLAMA_RULES)
  assert p.num_elements('params/') == 70_553_706_496
  assert not p.problems


@pytest.mark.parametrize('name', ['llama3-8b', 'llama3-405b'])
def test_llama_configs_match_their_names(name):
  billions = models.LLAMA_CONFIGS[name].num_params / 1e9
  assert round(billions) == {'llama3-8b': 8, 'llama3-405b': 406}[name]


def test_nnx_and_linen_models_give_the_same_plan():
  mesh = AbstractMesh((2, 4), ('data', 'model'))

  def linen():
    module = models.Llama(TINY_LLAMA)
    return examples.abstract_train_state(
      examples.abstract_linen_params(module, _sds((1, 4), jnp.int32)), 'adam'
    )

  def create():
    m = models_nnx.Llama(TINY_LLAMA, rngs=nnx.Rngs(0))
    return m, nnx.Optimizer(m, examples.optimizer('adam'), wrt=nnx.Param)

  def nnx_state():
    m, opt = nnx.eval_shape(create)
    return {'params': nnx.state(m, nnx.Param), 'opt_state': nnx.state(opt.opt_state)}

  def rows(p):
    return {(e.path, e.shape, e.spec) for e in p.entries}

  a = fsm.plan(linen(), mesh, LLAMA_RULES)
  b = fsm.plan(nnx_state(), mesh, LLAMA_RULES)
  assert rows(a) == rows(b)
  assert a.entry('params/layers/wk').spec == P(None, 'data', 'model', None)
  assert a.num_elements('params/') == TINY_LLAMA.num_params


def test_problems_for_a_mesh_that_divides_nothing():
  mesh = AbstractMesh((3, 7), ('data', 'model'))
  rules = [('embed', 'data'), ('hidden', 'model'), ('layers', None)]
  p = fsm.plan(_mlp_state(optimizer='none'), mesh, rules)
  paths = sorted({pr.path for pr in p.problems})
  assert paths == [
    'params/ScanDotReluDot_0/Dense_0/kernel',
    'params/ScanDotReluDot_0/W2',
  ]
  assert len(p.problems) == 4  # both sharded dimensions of both kernels
  assert all('not divisible' in pr.reason for pr in p.problems)
  # The plan is still there, with every entry.
  assert len(p.entries) == 2
  with pytest.raises(fsm.ShardingError, match='ScanDotReluDot_0/W2'):
    p.shardings()
  assert 'problems (4):' in str(p)


def test_rank_problem_is_reported_not_raised():
  tree = {'w': fsm.LogicalPartitioned(_sds((4, 4)), ('embed', 'mlp', 'x'))}
  p = fsm.plan(tree, AbstractMesh((2,), ('model',)), [])
  assert [pr.path for pr in p.problems] == ['w']
  assert p.entries[0].spec is None and p.entries[0].shard_shape == (4, 4)


def test_replicate_indivisible_replicates_and_lists_adjustments():
  mesh = AbstractMesh((3, 7), ('data', 'model'))
  rules = [('embed', 'data'), ('hidden', 'model'), ('layers', None)]
  with pytest.warns(fsm.IndivisibleDimensionWarning, match='Dense_0/kernel'):
    p = fsm.plan(_mlp_state(optimizer='none'), mesh, rules, replicate_indivisible=True)
  assert not p.problems
  assert len(p.adjustments) == 4
  assert p.adjustments[0].startswith(
    'params/ScanDotReluDot_0/Dense_0/kernel: dimension 1'
  )
  kernel = p.entry('params/ScanDotReluDot_0/Dense_0/kernel')
  assert kernel.spec == P(None, None, None)
  assert kernel.adjustments
  assert 'replicated instead of' in str(kernel.explain[2])
  assert 'replicated by replicate_indivisible=True (4)' in str(p)


def test_replicate_indivisible_in_get_sharding_warns_once():
  mesh = AbstractMesh((3,), ('model',))
  tree = {
    'a': fsm.Partitioned(_sds((4,)), ('model',)),
    'b': fsm.Partitioned(_sds((8,)), ('model',)),
  }
  with pytest.warns(fsm.IndivisibleDimensionWarning) as record:
    out = fsm.get_sharding(tree, mesh, replicate_indivisible=True)
  assert len(record) == 1 and 'a: ' in str(record[0].message)
  assert out['a'].spec == P(None)


def test_explain_says_which_rule_gave_and_which_were_skipped():
  mesh = AbstractMesh((2, 4), ('data', 'model'))
  tree = {'w': fsm.LogicalPartitioned(_sds((8, 8, 8)), ('bar', 'foo', 'baz'))}
  p = fsm.plan(tree, mesh, [('foo', 'model'), ('bar', 'model'), ('bar', 'data')])
  bar, foo, baz = p.entries[0].explain
  assert foo.mesh_axes == 'model' and foo.steps[0].applied
  assert bar.mesh_axes == 'data'
  assert [s.applied for s in bar.steps] == [False, True]
  assert "mesh axis 'model' already used by dimension 1 ('foo')" in bar.steps[0].reason
  assert baz.mesh_axes is None and 'no rule names it' in str(baz)
  assert str(bar).startswith("dim 0 'bar' -> 'data': rule #1")


def test_explain_for_mesh_axes_and_plain_leaves():
  mesh = AbstractMesh((2, 4), ('data', 'model'))
  tree = {'m': fsm.Partitioned(_sds((8, 8)), (None, 'model')), 'x': _sds((3,))}
  p = fsm.plan(tree, mesh)
  assert [d.note for d in p.entry('m').explain] == [
    'replicated as written',
    'mesh axes as written',
  ]
  assert p.entry('x').explain[0].note == 'not annotated, so replicated'


def test_explain_for_optimizer_moments_their_parameter_cannot_shard():
  mesh = AbstractMesh((3, 5), ('data', 'model'))
  p = fsm.plan(_mlp_state(depth=64), mesh, MLP_RULES)
  # The problem is reported on the parameter; its moments replicate the
  # dimension at fault (here the only sharded one).
  assert {pr.path for pr in p.problems} == {
    'params/ScanDotReluDot_0/Dense_0/kernel',
    'params/ScanDotReluDot_0/W2',
  }
  mu = p.entry('opt_state/0/mu/ScanDotReluDot_0/W2')
  assert mu.spec == P()
  assert "optimizer state that 'model' cannot shard" in str(mu.explain[1])


def test_moments_keep_the_dimensions_that_divide():
  # 8 kv heads on a 16-way 'model' axis: replicate_indivisible replicates that
  # dimension of wk; adam's moments of wk must do the same and keep 'embed'
  # over 'data' (not fall back to whole copies, 16x the memory).
  mesh = AbstractMesh((4, 16), ('data', 'model'))
  params = examples.abstract_linen_params(
    models.Llama(TINY_LLAMA), _sds((1, 1), jnp.int32)
  )
  wk = params['layers']['wk']
  params['layers']['wk'] = fsm.LogicalPartitioned(_sds((3, 64, 8, 16)), wk.names)
  state = examples.abstract_train_state(params, 'adam')
  with pytest.warns(fsm.IndivisibleDimensionWarning, match='params/layers/wk'):
    p = fsm.plan(state, mesh, LLAMA_RULES, replicate_indivisible=True)
  assert p.entry('params/layers/wk').spec == P(None, 'data', None, None)
  for moment in ('mu', 'nu'):
    entry = p.entry(f'opt_state/0/{moment}/layers/wk')
    assert entry.spec == P(None, 'data', None, None)
    assert entry.bytes_per_device == p.entry('params/layers/wk').bytes_per_device
  assert not p.problems


def test_explain_for_factored_optimizer_state():
  mesh = AbstractMesh((2, 4), ('data', 'model'))
  p = fsm.plan(_mlp_state(depth=64, optimizer='adafactor'), mesh, MLP_RULES)
  v_row = p.entry('opt_state/0/v_row/ScanDotReluDot_0/W2')
  assert v_row.spec == P() and v_row.names is None
  assert 'optimizer state' in v_row.explain[0].note
  assert not p.problems


def test_to_dict_is_json_with_the_documented_schema():
  mesh = AbstractMesh((2, 4), ('data', 'model'))
  p = fsm.plan(_mlp_state(depth=64), mesh, MLP_RULES)
  d = json.loads(json.dumps(p.to_dict()))
  assert {'entries', 'bytes_per_device', 'total_bytes', 'problems'} <= set(d)
  entry = next(e for e in d['entries'] if e['path'] == 'params/ScanDotReluDot_0/W2')
  assert entry == {
    'path': 'params/ScanDotReluDot_0/W2',
    'shape': [4, 64, 64],
    'dtype': 'float32',
    'names': ['layers', 'hidden', 'embed'],
    'spec': [None, 'model', None],
    'shard_shape': [4, 16, 64],
    'bytes_per_device': 4 * 16 * 64 * 4,
  }
  assert d['bytes_per_device'] == p.bytes_per_device


def test_table_groups_modules_and_summarizes_unrolled_stacks():
  mesh = AbstractMesh((2, 4), ('data', 'model'))
  p = fsm.plan(
    _mlp_state(use_scan=False, num_layers=6, depth=64, optimizer='none'),
    mesh,
    MLP_RULES,
  )
  text = str(p)
  assert 'params/DotReluDot_{0..5}/  [6 identical copies]' in text
  assert text.count('  W2 ') == 1
  assert 'total: ' in text and 'per device' in text and 'problems: none' in text
  scanned = str(fsm.plan(_mlp_state(depth=64, optimizer='none'), mesh, MLP_RULES))
  assert '[scanned, 4 layers]' in scanned


def test_rich_view():
  mesh = AbstractMesh((2, 4), ('data', 'model'))
  p = fsm.plan(_mlp_state(depth=64, optimizer='none'), mesh, MLP_RULES)
  assert 'treescope' in p._repr_html_()
  import treescope

  text = treescope.render_to_text(p._treescope_view())
  assert "'W2': PlanEntry(" in text and 'spec="P(None, \'model\', None)"' in text


def test_plan_of_train_state_and_verify(mesh):
  import optax
  from flax.training import train_state

  model = MLP(num_layers=2, depth=32)
  x = jnp.ones((8, 32))

  def init(key):
    params = model.init(key, x)['params']
    return train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.adam(1e-3)
    )

  with fsm.logical_axis_rules(MLP_RULES):
    p = fsm.plan(jax.eval_shape(init, jax.random.key(0)), mesh)
    state = jax.jit(init, out_shardings=p.shardings())(jax.random.key(0))
    assert fsm.verify(state, p) == []
    assert fsm.verify(state, fsm.get_sharding(state, mesh)) == []
  assert 'step' in {e.path for e in p.entries}


def test_verify_reports_differences_by_path():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  tree = {'w': fsm.Partitioned(jnp.zeros((8, 8)), (None, 'model')), 'b': jnp.zeros(8)}
  p = fsm.plan(tree, mesh)
  arrays = {
    'w': fsm.Partitioned(
      jax.device_put(jnp.zeros((8, 8)), NamedSharding(mesh, P('data'))), (None, 'model')
    ),
    'b': jax.device_put(jnp.zeros(8), NamedSharding(mesh, P())),
  }
  [m] = fsm.verify(arrays, p)
  assert m.path == 'w'
  assert m.expected.spec == P(None, 'model') and m.actual.spec == P('data')
  assert "w: planned P(None, 'model'), found P('data'" in str(m)


def test_repr_and_show_outside_a_notebook(capsys):
  mesh = AbstractMesh((2, 4), ('data', 'model'))
  p = fsm.plan(_mlp_state(depth=64, optimizer='none'), mesh, MLP_RULES)
  assert repr(p).startswith("ShardingPlan(2 arrays, mesh={'data': 2, 'model': 4}")
  p.show()
  assert capsys.readouterr().out.startswith('Sharding plan: 2 arrays')


@pytest.mark.parametrize(
  'name', ['plan', 'ShardingPlan', 'PlanEntry', 'as_abstract', 'verify']
)
def test_plan_names_are_public_and_documented(name):
  assert name in fsm.__all__
  assert getattr(fsm, name).__doc__


# strict=, actual_shardings, the verify table
# ------------------------------------------------------------------------------


def test_plan_strict_records_unmapped_names_as_problems():
  mesh = AbstractMesh((2, 4), ('data', 'model'))
  rules = [('hidden', 'model')]  # no rule for 'embed' or 'layers'
  p = fsm.plan(_mlp_state(optimizer='none'), mesh, rules, strict=True)
  unmapped = {
    (pr.path.rsplit('/', 1)[-1], pr.reason.split("'")[1]) for pr in p.problems
  }
  assert ('kernel', 'layers') in unmapped and ('W2', 'embed') in unmapped
  assert all('strict=True' in pr.reason for pr in p.problems)
  assert not fsm.plan(
    _mlp_state(optimizer='none'), mesh, MLP_RULES, strict=True
  ).problems


def test_plan_warns_about_mesh_axis_names():
  mesh = AbstractMesh((2, 4), ('data', 'model'))
  tree = {'w': fsm.LogicalPartitioned(_sds((8, 8)), ('data', 'hidden'))}
  with pytest.warns(fsm.UnmappedMeshAxisNameWarning, match="'data'.*Concerned: w"):
    p = fsm.plan(tree, mesh, [('hidden', 'model')])
  assert p.entries[0].spec == P(None, 'model') and not p.problems


def test_actual_shardings_reads_layouts_back():
  import numpy as np

  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  model = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
  state = nnx.state(model)
  placed = jax.device_put(
    state['kernel'].get_value(), NamedSharding(mesh, P(None, 'model'))
  )
  state['kernel'].set_value(placed)
  got = fsm.actual_shardings(state)
  assert isinstance(got, nnx.State)
  assert got['kernel'].get_value().spec == P(None, 'model')
  tree = {
    'box': fsm.Partitioned(placed, (None, 'model')),
    'host': np.ones(3),
    'step': 3,
    'name': 'x',
  }
  got = fsm.actual_shardings(tree)
  assert got['box'].spec == P(None, 'model')
  assert got['host'] is None and got['step'] is None and got['name'] is None


def test_verify_prints_a_diff_table():
  mesh = jax.make_mesh((8,), ('data',))
  tree = {
    'a': jax.device_put(jnp.zeros((8, 2)), NamedSharding(mesh, P())),
    'b': jax.device_put(jnp.zeros((8,)), NamedSharding(mesh, P('data'))),
  }
  same = {'a': NamedSharding(mesh, P()), 'b': NamedSharding(mesh, P('data'))}
  ok = fsm.verify(tree, same)
  assert ok == [] and isinstance(ok, fsm.Mismatches)
  assert str(ok) == 'all 2 arrays match the plan'
  planned = {'a': NamedSharding(mesh, P('data', None)), 'b': same['b']}
  out = fsm.verify(tree, planned)
  assert [m.path for m in out] == ['a'] and out[0].shape == (8, 2)
  lines = str(out).splitlines()
  assert lines[0] == '1 of 2 arrays differ from the plan:'
  assert lines[1].split() == ['array', 'shape', 'planned', 'actual']
  assert lines[3].split() == ['a', '8x2', "P('data',", 'None)', 'P()']
  # An array the plan does not know shows '-' as its planned layout.
  missing = str(fsm.verify(tree, {'b': same['b']})).splitlines()[3].split()
  assert missing == ['a', '8x2', '-', 'P()']


# PartitionSpecs with unreduced / reduced axes
# ------------------------------------------------------------------------------


def _reduced_state(spec):
  return {'w': nnx.Param(jnp.ones((8, 4)), out_sharding=spec, eager_sharding=False)}


def test_reduced_axes_pass_through_plan_verify_and_actual_shardings():
  # Explicit axes: jax allows unreduced / reduced axes only there.
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(AxisType.Explicit,) * 2)
  spec = P('data', None, reduced={'model'})
  p = fsm.plan(_reduced_state(spec), mesh)
  assert p.entry('w').spec == spec and not p.problems
  assert "P('data', None, reduced={'model'})" in str(p)
  assert p.to_dict()['entries'][0]['reduced'] == ['model']
  arrays = {'w': jax.device_put(jnp.ones((8, 4)), jax.NamedSharding(mesh, spec))}
  assert fsm.actual_shardings(arrays)['w'].spec == spec
  assert not fsm.verify(arrays, p)
  plain = {'w': jax.device_put(jnp.ones((8, 4)), jax.NamedSharding(mesh, P('data')))}
  assert [m.path for m in fsm.verify(plain, p)] == ['w']


def test_unreduced_axes_pass_through_regex_rules_and_shardings():
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(AxisType.Explicit,) * 2)
  spec = P('data', None, unreduced={'model'})
  specs = fsm.match_partition_rules([('w$', spec)], {'w': jnp.ones((8, 4))})
  assert specs['w'] == spec  # the same object, unreduced kind included
  logical = P('batch', None, unreduced={'model'})  # sets hold mesh axes as they are
  sharding = fsm.logical_to_mesh_sharding(logical, mesh, [('batch', 'data')])
  assert sharding.spec == spec
  assert fsm.plan(_reduced_state(spec), mesh).entry('w').spec == spec


def test_reduced_axes_on_auto_axes_are_a_problem():
  mesh = AbstractMesh((2, 4), ('data', 'model'), axis_types=(AxisType.Auto,) * 2)
  p = fsm.plan(_reduced_state(P('data', None, reduced={'model'})), mesh)
  assert [problem.reason for problem in p.problems] == [
    "reduced axis 'model' is Auto; jax needs it Explicit"
  ]


def test_bytes_count_key_arrays_and_packed_int4_as_the_device_holds_them():
  # np.dtype(...).itemsize fails on key<fry> and says one byte for int4.
  mesh = jax.sharding.AbstractMesh((8,), ('data',))
  tree = {
    'rng': jax.ShapeDtypeStruct((4,), jax.random.key(0).dtype),
    'q': fsm.Partitioned(jax.ShapeDtypeStruct((16, 8), jnp.int4), ('data', None)),
  }
  p = fsm.plan(tree, mesh)
  assert p.entry('rng').nbytes == 4 * 8  # threefry keys: two uint32 each
  assert p.entry('q').nbytes == 16 * 8 // 2
  assert p.entry('q').bytes_per_device == 2 * 8 // 2
