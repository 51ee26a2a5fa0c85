"""``as_abstract``: one walk, the same result for Linen and NNX trees."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta import _annotation as ann_lib

MESH = AbstractMesh((2, 4), ('data', 'model'))
RULES = [('embed', 'data'), ('mlp', 'model')]

each_reading = pytest.mark.usefixtures('nnx_reading')


def sds(*shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


def specs(tree):
  return [x.sharding.spec for x in jax.tree.leaves(tree) if hasattr(x, 'sharding')]


def test_every_kind_of_box_is_kept_holding_its_struct():
  tree = {
    'fsm': fsm.LogicalPartitioned(sds(8, 16, dtype=jnp.bfloat16), ('embed', 'mlp')),
    'fsm_mesh': fsm.Partitioned(sds(8, 16), (None, 'model')),
    'flax': nn.Partitioned(sds(8, 16), ('data', None)),
    'flax_logical': nn.LogicallyPartitioned(sds(8, 16), ('mlp', 'embed')),
    'plain': sds(4),
    'name': 'not an array',
    'none': None,
  }
  out = fsm.as_abstract(tree, MESH, RULES)
  for key in ('fsm', 'fsm_mesh', 'flax', 'flax_logical'):
    assert type(out[key]) is type(tree[key]), key
    assert out[key].names == tree[key].names
  assert out['fsm'].value.sharding.spec == P('data', 'model')
  assert out['fsm'].value.dtype == jnp.bfloat16
  assert out['fsm_mesh'].value.sharding.spec == P(None, 'model')
  assert out['flax'].value.sharding.spec == P('data', None)
  assert out['flax_logical'].value.sharding.spec == P('model', 'data')
  assert out['plain'].sharding.spec == P()
  assert out['name'] == 'not an array' and out['none'] is None


def test_leaves_whose_paths_read_alike_keep_their_own_layouts():
  # 'a/b' the key and a/b the path are the same text: each leaf is laid out
  # as its own annotation says, not by its path's text.
  tree = {
    'a/b': fsm.Partitioned(sds(8, 8), ('data', None)),
    'a': {'b': fsm.Partitioned(sds(8, 8), (None, 'model'))},
  }
  out = fsm.as_abstract(tree, MESH)
  assert out['a/b'].value.sharding.spec == P('data', None)
  assert out['a']['b'].value.sharding.spec == P(None, 'model')


def test_the_tree_is_walked_once(monkeypatch):
  walks = []
  real = ann_lib.walk
  monkeypatch.setattr(ann_lib, 'walk', lambda *a, **k: walks.append(1) or real(*a, **k))
  fsm.as_abstract({'w': fsm.Partitioned(sds(8, 8), ('data', None))}, MESH)
  assert len(walks) == 1


def test_optimizer_state_keeps_its_structure_and_follows_its_parameters():
  params = {'w': fsm.LogicalPartitioned(sds(8, 16), ('embed', 'mlp'))}
  state = jax.eval_shape(optax.adam(1e-3).init, params)
  out = fsm.as_abstract({'params': params, 'opt_state': state}, MESH, RULES)
  assert jax.tree.structure(out) == jax.tree.structure(
    {'params': params, 'opt_state': state}
  )
  assert out['opt_state'][0].mu['w'].value.sharding.spec == P('data', 'model')
  assert out['opt_state'][0].count.sharding.spec == P()


def test_problems_are_named_by_path_with_the_mesh():
  tree = {
    'layer': {
      'w': fsm.Partitioned(
        sds(
          6,
        ),
        ('model',),
      )
    }
  }
  with pytest.raises(fsm.ShardingError, match=r'layer/w: .*not divisible') as info:
    fsm.as_abstract(tree, AbstractMesh((4,), ('model',)))
  assert "on mesh {'model': 4}" in str(info.value)


def test_malformed_names_are_an_invalid_names_error():
  tree = {'w': fsm.LogicalPartitioned(sds(8, 8), ('embed', 'embed'))}
  with pytest.raises(fsm.InvalidNamesError, match="w: .*'embed' appears more"):
    fsm.as_abstract(tree, MESH, RULES)


def test_a_mesh_is_required():
  with pytest.raises(fsm.NoMeshError, match='as_abstract needs a'):
    fsm.as_abstract({'w': sds(2)}, None)  # type: ignore[arg-type]


# NNX: the same implementation, with each reading of Variables
# ------------------------------------------------------------------------------


def linear():
  return nnx.Linear(
    8,
    16,
    rngs=nnx.Rngs(0),
    kernel_init=fsm.nnx.with_logical_partitioning(
      nnx.initializers.lecun_normal(), ('embed', 'mlp')
    ),
  )


@each_reading
def test_nnx_state_gives_the_same_tree_through_either_name():
  state = nnx.state(nnx.eval_shape(linear))
  ours = fsm.nnx.as_abstract(state, MESH, RULES)
  core = fsm.as_abstract(state, MESH, RULES)
  assert jax.tree.structure(ours) == jax.tree.structure(core)
  assert jax.tree.structure(ours) == jax.tree.structure(state)
  assert specs(ours) == specs(core)
  assert ours['kernel'].get_value().sharding.spec == P('data', 'model')
  module = fsm.nnx.as_abstract(nnx.eval_shape(linear), MESH, RULES)
  assert module.kernel.get_value().sharding.spec == P('data', 'model')


@each_reading
def test_variables_holding_trees_variables_and_hijax_variables():
  holding_tree = nnx.Param(
    {'x': jnp.ones((4, 8)), 'y': sds(4, 8)},
    out_sharding=('data', None),
    eager_sharding=False,
  )
  inner = nnx.Param(
    jnp.ones((4, 8)), out_sharding=('data', 'model'), eager_sharding=False
  )
  hijax = nnx.Param(
    jnp.ones((4, 8)), out_sharding=(None, 'model'), eager_sharding=False, hijax=True
  )
  tree = {'tree': holding_tree, 'nested': nnx.Variable(inner), 'hijax': hijax}
  out = fsm.as_abstract(tree, MESH)
  value = out['tree'].get_value()
  assert {k: v.sharding.spec for k, v in value.items()} == {
    'x': P('data', None),
    'y': P('data', None),
  }
  nested = out['nested'].get_value().get_value()
  assert nested.sharding.spec == P('data', 'model') and nested.shape == (4, 8)
  assert out['hijax'].get_metadata()['hijax'] is True
  assert out['hijax'].get_value().sharding.spec == P(None, 'model')
  bad = nnx.Param({'x': sds(4, 8)}, out_sharding=('data',), eager_sharding=False)
  with pytest.raises(fsm.ShardingError, match=r'bad/x: shape \(4, 8\)'):
    fsm.nnx.as_abstract({'bad': bad}, MESH)


@each_reading
def test_linen_boxes_bridged_from_nnx_are_kept():
  box = nnx.bridge.variables.to_linen_var(
    nnx.Param(sds(8, 16), out_sharding=('data', None), eager_sharding=False)
  )
  out = fsm.as_abstract({'w': box}, MESH)
  assert type(out['w']) is type(box)
  assert out['w'].value.sharding.spec == P('data', None)
