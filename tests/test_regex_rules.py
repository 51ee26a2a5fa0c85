"""match_partition_rules: specs for unannotated models by regex over paths."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import flax_shardmeta as fsm

PARAMS = {
  'encoder': {
    'attn': {'query': {'kernel': jnp.zeros((8, 16)), 'bias': jnp.zeros(16)}},
    'mlp': {'wi': {'kernel': jnp.zeros((8, 32))}},
  },
  'embed': {'embedding': jnp.zeros((100, 8))},
  'scale': jnp.float32(1.0),
}


def test_first_match_wins():
  rules = [
    ('attn/.*/kernel', P(None, 'model')),
    ('kernel', P('model', None)),
    ('embedding', P('model', 'data')),
    ('.*', P()),
  ]
  specs = fsm.match_partition_rules(rules, PARAMS)
  assert specs['encoder']['attn']['query']['kernel'] == P(None, 'model')
  assert specs['encoder']['mlp']['wi']['kernel'] == P('model', None)
  assert specs['embed']['embedding'] == P('model', 'data')
  assert specs['encoder']['attn']['query']['bias'] == P()


def test_search_not_fullmatch():
  specs = fsm.match_partition_rules([('wi', P('data')), ('.*', P())], PARAMS)
  assert specs['encoder']['mlp']['wi']['kernel'] == P('data')


def test_scalars_get_empty_spec_without_a_rule():
  specs = fsm.match_partition_rules([('kernel|bias|embedding', P('data'))], PARAMS)
  assert specs['scale'] == P()


def test_min_size_replicates_small_leaves():
  rules = [('.*', P('model'))]
  specs = fsm.match_partition_rules(rules, PARAMS, min_size=200)
  assert specs['encoder']['attn']['query']['bias'] == P()  # 16 elements
  assert specs['encoder']['attn']['query']['kernel'] == P()  # 128 elements
  assert specs['encoder']['mlp']['wi']['kernel'] == P('model')  # 256
  assert specs['embed']['embedding'] == P('model')  # 800


def test_long_specs_are_trimmed_to_rank():
  specs = fsm.match_partition_rules([('.*', P('data', 'model', None))], PARAMS)
  assert specs['encoder']['attn']['query']['bias'] == P('data')
  assert specs['embed']['embedding'] == P('data', 'model')


def test_unmatched_leaves_raise_naming_paths():
  with pytest.raises(ValueError, match='No partition rule matches 2 leaf') as info:
    fsm.match_partition_rules([('kernel', P())], PARAMS)
  message = str(info.value)
  assert 'encoder/attn/query/bias (16,)' in message
  assert 'embed/embedding (100, 8)' in message
  assert "('.*', P())" in message
  assert 'scale' not in message


def test_non_array_leaves_map_to_none():
  specs = fsm.match_partition_rules([('.*', P())], {'a': jnp.zeros(2), 'b': 'x'})
  assert specs == {'a': P(), 'b': None}


def test_on_model_variables_and_get_sharding(mesh):
  model = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(8)])
  variables = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((4, 8)))
  specs = fsm.match_partition_rules(
    [
      ('layers_0/kernel', P(None, 'model')),
      ('layers_2/kernel', P('model')),
      ('bias', P()),
    ],
    variables,
  )
  assert specs['params']['layers_0']['kernel'] == P(None, 'model')
  assert specs['params']['layers_2']['kernel'] == P('model')
  shardings = jax.tree_util.tree_map(
    lambda s: jax.sharding.NamedSharding(mesh, s),
    specs,
    is_leaf=lambda x: isinstance(x, P),
  )
  params = jax.jit(model.init, out_shardings=shardings)(
    jax.random.key(0), jnp.ones((4, 8))
  )
  kernel = params['params']['layers_0']['kernel']
  assert kernel.sharding.is_equivalent_to(shardings['params']['layers_0']['kernel'], 2)


# Paths are the parameter's own, whatever holds it
# ------------------------------------------------------------------------------

PARAM_RULES = [('kernel$', P(None, 'model')), ('bias$', P())]


def test_nnx_state_paths_stop_at_variables():
  from flax import nnx

  state = nnx.state(nnx.Linear(16, 32, rngs=nnx.Rngs(0)))
  specs = fsm.match_partition_rules(PARAM_RULES, state)
  # Same structure as the input: a State of Variables holding the specs.
  assert isinstance(specs, nnx.State)
  assert isinstance(specs['kernel'], nnx.Param)
  assert specs['kernel'].get_value() == P(None, 'model')
  assert specs['bias'].get_value() == P()


@pytest.mark.parametrize(
  'wrap',
  [
    lambda init: nn.with_partitioning(init, (None, 'model')),
    lambda init: fsm.with_partitioning(init, (None, 'model')),
    lambda init: fsm.with_logical_partitioning(init, ('embed', 'mlp')),
  ],
  ids=['flax-box', 'fsm-box', 'fsm-logical-box'],
)
def test_boxed_linen_paths_stop_at_boxes(wrap):
  model = nn.Dense(32, kernel_init=wrap(nn.initializers.lecun_normal()))
  variables = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((2, 16)))
  specs = fsm.match_partition_rules(PARAM_RULES, variables)
  # The box is replaced by its spec, as fsm.get_sharding does.
  assert specs == {'params': {'kernel': P(None, 'model'), 'bias': P()}}


def test_unmatched_box_is_reported_by_its_parameter_path():
  tree = {'Dense_0': {'kernel': fsm.Partitioned(jnp.zeros((4, 8)), (None, 'm'))}}
  with pytest.raises(fsm.InvalidRulesError, match=r'Dense_0/kernel \(4, 8\)') as info:
    fsm.match_partition_rules([('bias$', P())], tree)
  assert 'value' not in str(info.value)


def test_min_size_none_means_no_threshold():
  rules = [('.*', P('model'))]
  specs = fsm.match_partition_rules(rules, PARAMS, min_size=None)
  assert specs == fsm.match_partition_rules(rules, PARAMS)
  assert specs['encoder']['attn']['query']['bias'] == P('model')  # 16 elements


def test_a_spec_may_be_written_short_and_bad_rules_are_named():
  # Item 6: ('bias$', 'model') gave P('m') (the string split into letters),
  # ('bias$', None) a TypeError, a dict a raw unpacking error.
  params = {'dense': {'kernel': jnp.zeros((4, 8)), 'bias': jnp.zeros(8)}}
  specs = fsm.match_partition_rules(
    [('bias$', 'model'), ('kernel$', ['data', None]), ('.*', None)], params
  )
  assert specs == {'dense': {'bias': P('model'), 'kernel': P('data', None)}}
  assert fsm.match_partition_rules([('.*', None)], params)['dense']['bias'] == P()
  with pytest.raises(fsm.InvalidRulesError, match='got a dict.*a list keeps the order'):
    fsm.match_partition_rules({'bias$': P()}, params)
  with pytest.raises(
    fsm.InvalidRulesError, match=r"partition rule #0 is \('bias\$',\); expected a pair"
  ):
    fsm.match_partition_rules([('bias$',)], params)
  with pytest.raises(
    fsm.InvalidRulesError, match=r'partition rule #0 .*: dimension 0 .*int 3 is no name'
  ):
    fsm.match_partition_rules([('bias$', (3,))], params)


def test_get_sharding_takes_match_partition_rules_output():
  # Item 6: a tree of PartitionSpecs used to give a tree of None, silently.
  mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
  params = {'dense': {'kernel': jnp.zeros((4, 8)), 'bias': jnp.zeros(8)}}
  specs = fsm.match_partition_rules(
    [('kernel$', P(None, 'model')), ('.*', P())], params
  )
  shardings = fsm.get_sharding(specs, mesh)
  assert shardings['dense']['kernel'] == jax.sharding.NamedSharding(
    mesh, P(None, 'model')
  )
  assert shardings['dense']['bias'].spec == P()
  bad = fsm.match_partition_rules([('.*', P('expert'))], params)
  with pytest.raises(
    fsm.ShardingError, match=r"dense/bias: .*mesh axis 'expert' \(dimension 0\) is not"
  ):
    fsm.get_sharding(bad, mesh)
