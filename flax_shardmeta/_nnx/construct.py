"""Laying NNX modules out: eagerly, abstractly, and as abstract twins.

The implementations behind ``fsm.nnx.shard_module``, ``fsm.nnx.eval_shape``
and ``fsm.nnx.as_abstract``; the last is the core's ``as_abstract`` with a
mesh taken from the context and modules split and merged around it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.core
from flax import nnx

from flax_shardmeta import _abstract, _sharding as sharding_lib
from flax_shardmeta._errors import NoMeshError
from flax_shardmeta._nnx.metadata import FSM_LOGICAL
from flax_shardmeta._placement import apply_spec, context_mesh
from flax_shardmeta._rules import logical_axis_rules
from flax_shardmeta._typing import AnyMesh, LogicalRules

N = TypeVar('N')


def _mesh_or_context(mesh: AnyMesh | None, what: str) -> AnyMesh:
  mesh = mesh if mesh is not None else context_mesh()
  if mesh is None:
    raise NoMeshError(
      f'{what} needs a mesh: pass mesh=... or call it inside '
      '`with jax.set_mesh(mesh):`.'
    )
  return mesh


def shard_module(node: N, mesh: AnyMesh | None, rules: LogicalRules | None) -> N:
  """Lays every annotated Variable of ``node`` out (``fsm.nnx.shard_module``)."""
  mesh = _mesh_or_context(mesh, 'shard_module')
  is_graph = isinstance(node, nnx.Module)
  state = nnx.state(node) if is_graph else node
  shardings = sharding_lib.get_sharding(state, mesh, rules)

  def lay_out(value: Any, sharding: Any) -> Any:
    if sharding is None or not hasattr(value, 'shape'):
      return value
    if isinstance(value, jax.core.Tracer):
      return apply_spec(value, tuple(sharding.spec), mesh)
    return jax.device_put(value, sharding)

  placed = jax.tree.map(lay_out, state, shardings, is_leaf=lambda x: x is None)
  if is_graph:
    nnx.update(node, placed)
    return node
  return placed


def eval_shape(
  create: Callable[[], N], mesh: AnyMesh | None, rules: LogicalRules | None
) -> N:
  """The abstract module with fsm's shardings (``fsm.nnx.eval_shape``)."""
  mesh = mesh if mesh is not None else context_mesh()
  with _rule_context(rules):
    abstract = _create_abstractly(create, mesh)
  if mesh is None:
    return abstract
  nnx.update(abstract, _abstract.as_abstract(nnx.state(abstract), mesh, rules))
  return abstract


def _create_abstractly(create: Callable[[], N], mesh: AnyMesh | None) -> N:
  """``nnx.eval_shape(create)`` under ``mesh``, as flax's own would run it.

  flax lays its own annotations out while a Variable is made, and refuses
  names that are not mesh axes (or any annotation with no mesh). fsm reads
  those names more leniently (a name no rule maps is replicated) and lays
  everything out afterwards, so if flax refuses, the module is made again with
  flax's eager sharding off and each Variable's ``eager_sharding`` metadata
  put back as flax would have set it.
  """
  context = _mesh_context(mesh) if mesh is not None else contextlib.nullcontext()
  try:
    with context:
      return nnx.eval_shape(create)
  except ValueError:
    # flax also lays annotations out on the way out of nnx.eval_shape, under
    # the context mesh: made again with neither.
    eager = nnx.using_eager_sharding()
    with jax.set_mesh(None), nnx.use_eager_sharding(False):
      abstract = nnx.eval_shape(create)
  for _, variable in nnx.iter_graph(abstract):
    if isinstance(variable, nnx.Variable) and FSM_LOGICAL not in (
      metadata := variable.get_metadata()
    ):
      if metadata.get('eager_sharding') is False and eager:
        variable.set_metadata('eager_sharding', True)
  return abstract


def _mesh_context(mesh: AnyMesh) -> contextlib.AbstractContextManager[Any]:
  if isinstance(mesh, jax.sharding.AbstractMesh):
    return jax.sharding.use_abstract_mesh(mesh)
  return jax.set_mesh(mesh)


def _rule_context(rules: LogicalRules | None) -> contextlib.AbstractContextManager[Any]:
  if rules is None:
    return contextlib.nullcontext()
  return logical_axis_rules(rules)


def as_abstract(tree: N, mesh: AnyMesh | None, rules: LogicalRules | None) -> N:
  """The core's ``as_abstract`` on a module, a State or a tree of Variables,
  on the mesh given or set (``fsm.nnx.as_abstract``)."""
  mesh = _mesh_or_context(mesh, 'as_abstract')
  if isinstance(tree, nnx.Module):
    graphdef, state = nnx.split(tree)
    return nnx.merge(graphdef, _abstract.as_abstract(state, mesh, rules))
  return _abstract.as_abstract(tree, mesh, rules)
