"""Reading annotations off leaves: the reader registry."""

import jax
import jax.numpy as jnp
from flax.core import meta
from jax.sharding import AbstractMesh, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta import _annotation

MESH = AbstractMesh((2, 4), ('data', 'model'))


class UserBox(meta.AxisMetadata):
  """A user's own AxisMetadata subclass, with names of its own."""

  def __init__(self, value, axes):
    self.value, self.axes = value, axes

  def unbox(self):
    return self.value

  def replace_boxed(self, val):
    return UserBox(val, self.axes)

  def add_axis(self, index, params):
    return self

  def remove_axis(self, index, params):
    return self


jax.tree_util.register_pytree_node(
  UserBox, lambda b: ((b.value,), b.axes), lambda axes, c: UserBox(c[0], axes)
)


def test_subclass_reader_wins_over_the_axis_metadata_catch_all():
  box = UserBox(jax.ShapeDtypeStruct((8, 4), jnp.float32), ('model', None))
  # Before registration, flax's AxisMetadata catch-all unwraps it: replicated.
  assert fsm.get_sharding({'w': box}, MESH)['w'].spec == P()
  fsm.register_annotation_type(
    UserBox, lambda b: (b.value, fsm.Annotation(tuple(b.axes)))
  )
  try:
    assert fsm.get_sharding({'w': box}, MESH)['w'].spec == P('model', None)
  finally:
    _annotation._registry.pop()
    _annotation._by_type.clear()


def test_registering_a_class_again_replaces_its_reader():
  class Leaf:
    def __init__(self, value):
      self.value = value

  leaf = Leaf(jax.ShapeDtypeStruct((8,), jnp.float32))
  fsm.register_annotation_type(Leaf, lambda x: (x.value, fsm.Annotation(('data',))))
  fsm.register_annotation_type(Leaf, lambda x: (x.value, fsm.Annotation(('model',))))
  try:
    assert fsm.get_sharding([leaf], MESH)[0].spec == P('model')
  finally:
    del _annotation._registry[-2:]
    _annotation._by_type.clear()
