"""One layout pipeline: get_sharding, as_abstract, plan and a restore's
targets lay a tree out through ``_sharding.lay_out`` and agree on its
problems, their hints and its unmapped names.

Meshes: ``jax.sharding.AbstractMesh`` with default (Auto) axis types; nothing
here runs on devices.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta._restore.targets import target_leaves


def boxed(shape, names):
  return fsm.LogicalPartitioned(jax.ShapeDtypeStruct(shape, jnp.float32), names)


def four_views(tree, mesh, rules):
  """What each view says of ``tree``: its problems (as (path, reason, hint))."""
  said = {}
  for name, call in (
    ('get_sharding', lambda: fsm.get_sharding(tree, mesh, rules)),
    ('as_abstract', lambda: fsm.as_abstract(tree, mesh, rules)),
  ):
    with pytest.raises(fsm.ShardingError) as raised:
      call()
    said[name] = [(p.path, p.reason, p.hint) for p in raised.value.problems]
  said['plan'] = [
    (p.path, p.reason, p.hint) for p in fsm.plan(tree, mesh, rules).problems
  ]
  found = []
  target_leaves(tree, mesh, rules, found)
  said['restore'] = [(p.path, p.hint) for p in found]
  return said


def test_a_misspelt_mesh_axis_gets_one_did_you_mean_in_every_view():
  mesh = AbstractMesh((2, 4), ('data', 'modle'))
  tree = {'w': boxed((8, 16), ('embed', 'mlp')), 'b': jnp.zeros(3)}
  said = four_views(tree, mesh, [('mlp', 'model')])
  for name, problems in said.items():
    (problem,) = problems
    assert problem[0] == 'w', name
    assert "'modle'" in problem[-1] and 'did you mean' in problem[-1], (name, problem)
  assert said['get_sharding'] == said['as_abstract'] == said['plan']


def test_an_indivisible_dimension_is_the_same_problem_in_every_view():
  mesh = AbstractMesh((2, 4), ('data', 'model'))
  tree = {'w': boxed((8, 6), ('embed', 'mlp')), 'plain': jnp.zeros((5,))}
  said = four_views(tree, mesh, [('mlp', 'model')])
  assert said['get_sharding'] == said['as_abstract'] == said['plan']
  ((path, reason, _),) = said['plan']
  assert path == 'w' and '6' in reason
  assert [p for p, _ in said['restore']] == ['w']


def test_unmapped_names_are_reported_alike_and_never_for_plain_arrays():
  # 'model' is a mesh axis no rule maps: each view warns once, naming 'w'.
  mesh = AbstractMesh((2, 4), ('data', 'model'))
  tree = {
    'w': boxed((8, 16), ('embed', 'model')),
    'plain': jnp.zeros((4, 4)),
    'spec': P('data'),
  }
  rules = [('embed', 'data')]
  messages = {}
  for name, call in (
    ('get_sharding', lambda: fsm.get_sharding(tree, mesh, rules)),
    ('as_abstract', lambda: fsm.as_abstract(tree, mesh, rules)),
    ('plan', lambda: fsm.plan(tree, mesh, rules)),
    ('restore', lambda: target_leaves(tree, mesh, rules, [])),
  ):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter('always')
      call()
    (w,) = [
      w for w in caught if issubclass(w.category, fsm.UnmappedMeshAxisNameWarning)
    ]
    messages[name] = str(w.message)
    assert w.filename == __file__, (name, w.filename)  # the user's call
  assert len(set(messages.values())) == 1, messages
  # The leaves named: 'w', never the plain array (its path is 'plain').
  concerned = re.search(r'Concerned: (.*)', messages['plan'])
  assert concerned is not None and concerned.group(1) == 'w.'


def test_a_restore_target_keeps_its_own_sharding():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  own = NamedSharding(mesh, P(None, 'model'))
  tree = {
    'own': fsm.LogicalPartitioned(
      jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=own), ('embed', 'mlp')
    ),
    'laid': boxed((8, 16), ('embed', 'mlp')),
  }
  problems = []
  targets = {
    t.path: t for t in target_leaves(tree, mesh, [('embed', 'data')], problems)
  }
  assert problems == []
  assert targets['own'].sharding == own
  assert targets['laid'].sharding.spec == P('data', None)
  assert not any(t.faulty for t in targets.values())
