"""Checkpoints saved on one mesh restore onto others through ``as_abstract``."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta.examples.linen import MLP, MLP_RULES


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  """An MLP's variables, initialized sharded on (2, 4) and saved."""
  model = MLP(num_layers=2, depth=64)
  x = jnp.ones((8, 64))

  def init(key):
    return model.init(key, x)

  path = tmp_path_factory.mktemp('ckpt') / 'state'
  with fsm.logical_axis_rules(MLP_RULES):
    abstract = jax.eval_shape(init, jax.random.key(0))
    mesh = jax.make_mesh((2, 4), ('data', 'model'))
    variables = jax.jit(init, out_shardings=fsm.plan(abstract, mesh).shardings())(
      jax.random.key(0)
    )
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, variables)
  return path, abstract, variables


@pytest.mark.parametrize('shape', [(4, 2), (8, 1)])
def test_restore_onto_another_mesh(saved, shape):
  path, abstract, variables = saved
  mesh = jax.make_mesh(shape, ('data', 'model'))
  with fsm.logical_axis_rules(MLP_RULES):
    target = fsm.as_abstract(abstract, mesh)
    planned = fsm.plan(abstract, mesh)
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(path, target)
  assert fsm.verify(restored, planned) == []
  kernel = restored['params']['ScanDotReluDot_0']['Dense_0']['kernel']
  assert kernel.value.sharding.mesh.shape == dict(zip(('data', 'model'), shape))
  for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(restored)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.dtype == b.dtype


def test_as_abstract_keeps_boxes_and_plain_leaves():
  mesh = AbstractMesh((2, 4), ('data', 'model'))
  tree = {
    'w': fsm.LogicalPartitioned(
      jax.ShapeDtypeStruct((8, 16), jnp.bfloat16), ('embed', 'mlp')
    ),
    'b': jax.ShapeDtypeStruct((16,), jnp.float32),
    'name': None,
  }
  out = fsm.as_abstract(tree, mesh, [('mlp', 'model')])
  assert isinstance(out['w'], fsm.LogicalPartitioned)
  assert out['w'].value.sharding.spec == P(None, 'model')
  assert out['w'].value.dtype == jnp.bfloat16
  assert out['b'].sharding.spec == P()
  assert out['name'] is None


def test_as_abstract_raises_for_a_mesh_that_cannot_hold_the_tree():
  tree = {'w': fsm.Partitioned(jax.ShapeDtypeStruct((6,), jnp.float32), ('model',))}
  with pytest.raises(fsm.ShardingError, match=r'w: .*not divisible'):
    fsm.as_abstract(tree, AbstractMesh((4,), ('model',)))
