"""The logical-rule engine: resolution, composition, context, standard rules."""

import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import PartitionSpec as P

import flax_shardmeta as fsm

U = P.UNCONSTRAINED

RESOLUTION_TABLE = [
  # Priority follows the rules, not the dimensions.
  ((('foo', 'model'), ('bar', 'model')), ('bar', 'foo'), P(None, 'model')),
  ((('bar', 'model'), ('foo', 'model')), ('bar', 'foo'), P('model', None)),
  # One name, several candidates: the first usable one wins.
  ((('embed', 'model'), ('embed', 'data')), ('embed',), P('model')),
  (
    (('mlp', 'model'), ('embed', 'model'), ('embed', 'data')),
    ('embed', 'mlp'),
    P('data', 'model'),
  ),
  # A name with no rule is replicated.
  ((('batch', 'data'),), ('batch', 'length'), P('data', None)),
  ((), ('batch', 'embed'), P(None, None)),
  # None and UNCONSTRAINED pass through untouched.
  ((('batch', 'data'),), (None, 'batch'), P(None, 'data')),
  ((('batch', 'data'),), (U, 'batch'), P(U, 'data')),
  # A pass-through mesh-axis tuple blocks its axes for later rules.
  ((('embed', 'data'),), (('data', 'model'), 'embed'), P(('data', 'model'), None)),
  # Rule targets: tuples, None, UNCONSTRAINED.
  ((('batch', ('data', 'model')),), ('batch', None), P(('data', 'model'), None)),
  ((('kv', None), ('kv', 'model')), ('kv',), P(None)),
  ((('length', U),), ('length', 'embed'), P(U, None)),
  # A tuple target clashing on any of its axes is skipped.
  (
    (('mlp', 'model'), ('batch', ('data', 'model')), ('batch', 'data')),
    ('batch', 'mlp'),
    P('data', 'model'),
  ),
  # Empty names.
  ((('batch', 'data'),), (), P()),
]


@pytest.mark.parametrize('rules, names, expected', RESOLUTION_TABLE)
def test_logical_to_mesh_axes(rules, names, expected):
  assert fsm.logical_to_mesh_axes(names, rules) == expected


@pytest.mark.parametrize('rules, names, expected', RESOLUTION_TABLE)
def test_rules_none_uses_the_context(rules, names, expected):
  with fsm.logical_axis_rules(rules):
    assert fsm.logical_to_mesh_axes(names) == expected
    assert fsm.logical_to_mesh_axes(names, rules=None) == expected


def test_explicit_rules_override_the_context():
  with fsm.logical_axis_rules([('mlp', 'model')]):
    assert fsm.logical_to_mesh_axes(('mlp',), [('mlp', 'data')]) == P('data')
    # Explicit empty rules mean "no rules", not "the context's".
    assert fsm.logical_to_mesh_axes(('mlp',), ()) == P(None)


def test_names_none_gives_none():
  assert fsm.logical_to_mesh_axes(None, [('a', 'b')]) is None


def test_duplicate_logical_name_raises():
  with pytest.raises(ValueError, match="'embed' appears more than once"):
    fsm.logical_to_mesh_axes(('embed', 'embed'), [('embed', 'model')])


def test_duplicate_none_is_fine():
  assert fsm.logical_to_mesh_axes((None, None), ()) == P(None, None)


@pytest.mark.parametrize(
  'rules, match',
  [
    ('batch', 'sequence of'),
    ([('batch',)], 'rule #0'),
    ([(1, 'data')], 'rule #0'),
    ([('batch', P('data'))], 'not a PartitionSpec'),
    ([('batch', ('data', 1))], 'mesh-axis names'),
    ([('batch', 3)], 'unsupported target'),
  ],
)
def test_malformed_rules_raise(rules, match):
  with pytest.raises(ValueError, match=match):
    fsm.logical_to_mesh_axes(('batch',), rules)


def test_list_targets_become_tuples():
  rules = [['batch', ['data', 'model']]]
  assert fsm.logical_to_mesh_axes(('batch',), rules) == P(('data', 'model'))


# composite_rules
# ------------------------------------------------------------------------------

T5X_2D = (('batch', 'data'), ('mlp', 'model'), ('embed', 'model'), ('embed', 'data'))


def test_composite_keeps_the_2d_fallback():
  merged = fsm.composite_rules(T5X_2D, [('kv', None), ('mlp', 'model')])
  assert merged == T5X_2D + (('kv', None),)
  # 'mlp' takes 'model', so 'embed' falls back to 'data'.
  assert fsm.logical_to_mesh_axes(('embed', 'mlp'), merged) == P('data', 'model')
  assert fsm.logical_to_mesh_axes(('embed', 'kv'), merged) == P('model', None)


def test_composite_conflicting_first_choice_names_both():
  with pytest.raises(fsm.RuleConflictError, match='conflicting first choices') as info:
    fsm.composite_rules([('embed', 'model')], [('embed', 'data')])
  message = str(info.value)
  assert "('embed', 'model')" in message
  assert "('embed', 'data')" in message
  assert isinstance(info.value, ValueError)


def test_composite_later_candidates_may_differ():
  # Only first choices must agree; a per-variable fallback is appended.
  merged = fsm.composite_rules(
    [('embed', 'model')], [('embed', 'model'), ('embed', 'data')]
  )
  assert merged == (('embed', 'model'), ('embed', 'data'))


@pytest.mark.parametrize(
  'g, loc, expected',
  [
    (None, None, ()),
    ([('a', 'x')], None, (('a', 'x'),)),
    (None, [('a', 'x')], (('a', 'x'),)),
    ([('a', 'x')], [], (('a', 'x'),)),
    ([('a', 'x')], [('b', 'y'), ('a', 'x')], (('a', 'x'), ('b', 'y'))),
  ],
)
def test_composite_edge_cases(g, loc, expected):
  assert fsm.composite_rules(g, loc) == expected


# Context
# ------------------------------------------------------------------------------


def test_context_nests_and_restores():
  assert fsm.get_logical_axis_rules() == ()
  with fsm.logical_axis_rules([('a', 'data')]):
    assert fsm.get_logical_axis_rules() == (('a', 'data'),)
    with fsm.logical_axis_rules([('b', 'model')]):
      assert fsm.get_logical_axis_rules() == (('b', 'model'),)
    assert fsm.get_logical_axis_rules() == (('a', 'data'),)
  assert fsm.get_logical_axis_rules() == ()


def test_context_restores_on_exception():
  fsm.set_logical_axis_rules([('outer', 'data')])
  with pytest.raises(RuntimeError, match='boom'):
    with fsm.logical_axis_rules([('inner', 'model')]):
      with fsm.logical_axis_rules([('innermost', 'model')]):
        raise RuntimeError('boom')
  assert fsm.get_logical_axis_rules() == (('outer', 'data'),)


def test_context_rejects_malformed_rules_without_changing_state():
  fsm.set_logical_axis_rules([('a', 'data')])
  with pytest.raises(fsm.InvalidRulesError, match=r"rule #0 is \('a',\)"):
    with fsm.logical_axis_rules([('a',)]):
      pass
  assert fsm.get_logical_axis_rules() == (('a', 'data'),)


def test_set_and_get():
  fsm.set_logical_axis_rules([('batch', ['data', 'model'])])
  assert fsm.get_logical_axis_rules() == (('batch', ('data', 'model')),)


# standard_logical_axis_rules
# ------------------------------------------------------------------------------


@pytest.mark.parametrize(
  'act, param, embed_spec, activation_spec',
  [
    (1, 1, P(None, 'model'), P('data', None)),
    (1, 2, P('data', 'model'), P('data', None)),
    # 'mlp' outranks 'embed' for 'model', so embed stays replicated here.
    (2, 1, P(None, 'model'), P('data', 'model')),
    (2, 2, P('data', 'model'), P('data', 'model')),
  ],
)
def test_standard_rules(act, param, embed_spec, activation_spec):
  rules = fsm.standard_logical_axis_rules(act, param)
  assert fsm.logical_to_mesh_axes(('embed', 'mlp'), rules) == embed_spec
  assert fsm.logical_to_mesh_axes(('batch', 'embed'), rules) == activation_spec
  assert fsm.logical_to_mesh_axes(('vocab', 'kv', 'layers'), rules) == P(
    'model', None, None
  )


def test_standard_rules_2d_keeps_both_embed_candidates():
  rules = fsm.standard_logical_axis_rules(2, 2)
  embed = [target for name, target in rules if name == 'embed']
  assert embed == ['model', 'data']


def test_standard_rules_additional_rules_come_last():
  rules = fsm.standard_logical_axis_rules(
    additional_rules=[('expert', 'data'), ('batch', 'model')]
  )
  assert rules[-2:] == (('expert', 'data'), ('batch', 'model'))
  assert fsm.logical_to_mesh_axes(('batch',), rules) == P('data')


@pytest.mark.parametrize('act, param', [(0, 1), (1, 3), (3, 3)])
def test_standard_rules_unsupported(act, param):
  with pytest.raises(ValueError, match='must be 1 or 2'):
    fsm.standard_logical_axis_rules(act, param)


# explain_resolution
# ------------------------------------------------------------------------------


def test_explain_priority_example():
  explained = fsm.explain_resolution(
    ('bar', 'foo'), [('foo', 'model'), ('bar', 'model')]
  )
  bar, foo = explained
  assert bar.mesh_axes is None
  assert foo.mesh_axes == 'model'
  assert [s.applied for s in bar.steps] == [False]
  assert "already used by dimension 1 ('foo')" in str(bar)
  assert "rule #0 ('foo', 'model') gave" in str(foo)


def test_explain_matches_resolution():
  rules = fsm.standard_logical_axis_rules(2, 2)
  names = ('batch', 'embed', 'mlp', None, 'unknown')
  explained = fsm.explain_resolution(names, rules)
  assert P(*(d.mesh_axes for d in explained)) == fsm.logical_to_mesh_axes(names, rules)
  assert 'passed through' in str(explained[3])
  assert 'no rule names it' in str(explained[4])
  embed = explained[1]
  # 'batch' took 'data' and 'mlp' took 'model' (earlier rules): both embed
  # candidates are skipped and the dimension is replicated.
  assert [s.applied for s in embed.steps] == [False, False]
  assert embed.mesh_axes is None
  assert "'data' already used by dimension 0" in str(embed)


def test_explain_reports_an_already_assigned_dimension():
  (d,) = fsm.explain_resolution(('embed',), [('embed', 'model'), ('embed', 'data')])
  assert [s.applied for s in d.steps] == [True, False]
  assert 'already assigned by rule #0' in str(d)


def test_names_with_unreduced_or_reduced_axes_are_refused_the_same_everywhere():
  # One as_names for every way in: boxes, NNX metadata, resolution, shard_value.
  spec = P('embed', reduced={'model'})
  rules = [('embed', 'data')]
  calls = (
    lambda: fsm.logical_to_mesh_axes(spec, rules),
    lambda: fsm.explain_resolution(spec, rules),
    lambda: fsm.LogicalPartitioned(None, spec),
  )
  for call in calls:
    with pytest.raises(fsm.InvalidNamesError, match='have unreduced / reduced axes'):
      call()


def test_rule_target_repeating_a_mesh_axis_raises():
  with pytest.raises(ValueError, match='names a mesh axis more than once'):
    fsm.logical_to_mesh_axes(('batch',), [('batch', ('data', 'data'))])


_LOGICAL = ('batch', 'embed', 'mlp', 'heads', 'kv')
_AXES = ('data', 'model', 'fsdp')
_targets = st.one_of(
  st.none(),
  st.sampled_from(_AXES),
  st.lists(st.sampled_from(_AXES), min_size=1, max_size=2, unique=True).map(tuple),
)


@settings(max_examples=200, deadline=None)
@given(
  names=st.lists(
    st.one_of(
      st.sampled_from(_LOGICAL), st.none(), st.sampled_from(_AXES).map(lambda a: (a,))
    ),
    max_size=4,
    unique_by=lambda n: n if isinstance(n, str) else object(),
  ),
  rules=st.lists(st.tuples(st.sampled_from(_LOGICAL), _targets), max_size=8),
)
def test_explain_is_resolve(names, rules):
  """explain walks the same loop as resolve: same axes, and each step's verdict
  agrees with the outcome (exactly one applied step for an assigned name)."""
  names = tuple(names)
  explained = fsm.explain_resolution(names, rules)
  assert P(*(d.mesh_axes for d in explained)) == fsm.logical_to_mesh_axes(names, rules)
  for d in explained:
    applied = [s for s in d.steps if s.applied]
    assert len(applied) <= 1
    if applied:
      assert d.mesh_axes == applied[0].rule[1]


def test_logical_to_mesh_axes_strict_names_the_unmapped_name():
  assert fsm.logical_to_mesh_axes(
    ('batch', None), [('batch', 'data')], strict=True
  ) == P('data', None)
  with pytest.raises(
    fsm.ShardingError, match="no usable rule maps logical name 'length'"
  ):
    fsm.logical_to_mesh_axes(('batch', 'length'), [('batch', 'data')], strict=True)
  # Every rule of 'bar' skipped (its axis is taken) counts as unmapped too.
  with pytest.raises(fsm.ShardingError, match="'bar'"):
    fsm.logical_to_mesh_axes(
      ('bar', 'foo'), [('foo', 'model'), ('bar', 'model')], strict=True
    )


def test_logical_to_mesh_axes_warns_for_a_context_mesh_axis_name():
  import jax

  mesh = jax.make_mesh((2,), ('data',))
  with jax.set_mesh(mesh):
    with pytest.warns(
      fsm.UnmappedMeshAxisNameWarning, match=r"rule \('data', 'data'\)"
    ):
      assert fsm.logical_to_mesh_axes(('data', None), []) == P(None, None)


def test_a_skipped_rule_says_which_axis_clashed_as_a_field():
  # Code that acts on a clash (the Explicit audit's note) reads the field,
  # never the sentence.
  dims = fsm.explain_resolution(
    ('embed', 'mlp'), [('embed', 'model'), ('mlp', 'model')]
  )
  (skipped,) = [s for s in dims[1].steps if not s.applied]
  assert skipped.clash == ('model', 0)
  assert "already used by dimension 0 ('embed')" in skipped.reason
  (applied,) = dims[0].steps
  assert applied.applied and applied.clash is None
