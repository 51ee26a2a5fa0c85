"""Flax NNX adapter: annotated Variables, eager sharding, stacked layers, optimizers.

NNX keeps annotations in a Variable's metadata rather than in a box. This
module writes them (:func:`with_partitioning`, :func:`with_logical_partitioning`),
reads them for the core (registered with
:func:`flax_shardmeta.register_annotation_type` on import, so
``fsm.get_partition_spec`` / ``fsm.get_sharding`` accept ``nnx.state(...)``)
and lays modules out eagerly (:func:`shard_module`). The implementation lives
in ``flax_shardmeta._nnx``.

Metadata layout. flax_shardmeta stores the names under ``out_sharding``, the
key flax's ``nnx.vmap`` / ``nnx.scan`` update when ``transform_metadata=
{nnx.PARTITION_NAME: 'layers'}`` adds an axis, plus ``fsm_logical`` (True:
logical names resolved by flax_shardmeta's rules; False: mesh axes) and
``eager_sharding=False`` so flax does not apply its own, stricter, resolution
at construction. Logical names also get ``sharding_rules``: an
:class:`~flax_shardmeta._flax_adapter.FsmRules` through which flax's own functions
(``nnx.get_partition_spec``, ``nnx.get_named_sharding``, ``nnx.eval_shape``
under a mesh, ``nnx.get_abstract_model``) rename them exactly as
``fsm.get_sharding`` lays them out, with the per-variable rules inside it.
Variables without ``fsm_logical`` carry flax's own annotations; they are read
under every key flax has used (``out_sharding``, ``sharding_names``,
``sharding``, with ``sharding_rules`` and ``mesh``) with flax's renaming
semantics: a name no rule maps stays itself when it is a mesh axis and is
replicated otherwise.

Optimizer state. ``nnx.Optimizer`` copies each parameter's metadata onto its
moments (``nnx.OptState`` Variables), so full-rank moments follow their
parameter, and leaves whose rank differs (adafactor's factored ``v_row`` /
``v_col``) are replicated, as for optax states in Linen. A parameter's
``optimizer_sharding`` metadata (see ``optimizer_names=``) replaces its
layout for its moments, as flax does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from flax import nnx

from flax_shardmeta import _annotation as ann_lib
from flax_shardmeta._nnx import (
  construct,
  reading as _reading,  # noqa: F401 - registers the readers of NNX leaves
  writing,
)
from flax_shardmeta._nnx.metadata import (
  FSM_LOGICAL as FSM_LOGICAL,
  NAME_KEYS as NAME_KEYS,
  OPTIMIZER_NAMES as OPTIMIZER_NAMES,
  annotation_of,
)
from flax_shardmeta._typing import AnyMesh, LogicalNames, LogicalRules

N = TypeVar('N')


# Writing annotations
# ------------------------------------------------------------------------------


def with_partitioning(
  init: Callable[..., Any],
  names: LogicalNames,
  *,
  mesh: AnyMesh | None = None,
  optimizer_names: LogicalNames | None = None,
) -> Callable[..., nnx.VariableMetadata[Any]]:
  """Wraps an initializer so the Variable it fills is annotated with mesh axes.

  Under ``jax.set_mesh(mesh)`` (or with ``mesh=``) the value is created
  already laid out; with no mesh, or with flax's eager sharding turned off
  (``nnx.use_eager_sharding(False)``), it stays as is and keeps the
  annotation (``shard_module`` lays it out later); in ``nnx.eval_shape`` only
  the annotation exists.

  Args:
    init: any initializer, e.g. ``nnx.initializers.lecun_normal()``.
    names: one mesh-axis name (or None) per dimension.
    mesh: a mesh to lay the value out on instead of the context mesh.
    optimizer_names: names for this parameter's optimizer moments, if they
      should differ from ``names``.

  Returns:
    An initializer returning ``nnx.VariableMetadata``; pass it as
    ``kernel_init=`` or call it inside ``nnx.Param(...)``.

  Example:
    >>> import jax.numpy as jnp, flax_shardmeta as fsm
    >>> from flax import nnx
    >>> p = nnx.Param(fsm.nnx.with_partitioning(
    ...     lambda: jnp.ones((8, 4)), ('model', None))())
    >>> fsm.get_partition_spec(p).get_value()
    P('model', None)
  """
  return writing.annotating(init, names, False, None, mesh, optimizer_names)


def with_logical_partitioning(
  init: Callable[..., Any],
  names: LogicalNames,
  *,
  mesh: AnyMesh | None = None,
  rules: LogicalRules | None = None,
  optimizer_names: LogicalNames | None = None,
) -> Callable[..., nnx.VariableMetadata[Any]]:
  """Wraps an initializer so the Variable it fills is annotated with logical names.

  Names resolve through ``composite_rules(context rules, rules)`` like Linen's
  ``LogicalPartitioned``: a name no rule maps is replicated.

  Args:
    init: any initializer.
    names: one logical name (or None) per dimension.
    rules: per-variable rules, composed with the context rules.
    mesh: a mesh to lay the value out on instead of the context mesh.
    optimizer_names: logical names for this parameter's optimizer moments.

  Returns:
    An initializer returning ``nnx.VariableMetadata``.

  Example:
    >>> import jax, flax_shardmeta as fsm
    >>> from flax import nnx
    >>> layer = nnx.Linear(4, 8, rngs=nnx.Rngs(0),
    ...     kernel_init=fsm.nnx.with_logical_partitioning(
    ...         nnx.initializers.lecun_normal(), ('embed', 'mlp')))
    >>> mesh = jax.sharding.AbstractMesh((2,), ('model',))
    >>> fsm.get_sharding(layer.kernel, mesh, [('mlp', 'model')]).get_value().spec
    P(None, 'model')
  """
  return writing.annotating(init, names, True, rules, mesh, optimizer_names)


# Reading annotations
# ------------------------------------------------------------------------------


def variable_annotation(variable: nnx.Variable[Any]) -> ann_lib.Annotation | None:
  """The annotation a Variable's metadata carries, or None.

  Example:
    >>> import jax.numpy as jnp, flax_shardmeta as fsm
    >>> from flax import nnx
    >>> v = nnx.Param(jnp.ones((2, 2)), out_sharding=('a', None),
    ...               eager_sharding=False)
    >>> fsm.nnx.variable_annotation(v).keep_mesh_names  # flax's own names
    True
  """
  return annotation_of(type(variable), variable.get_metadata())


# Laying modules out
# ------------------------------------------------------------------------------


def shard_module(
  node: N, mesh: AnyMesh | None = None, rules: LogicalRules | None = None
) -> N:
  """Lays every annotated Variable of ``node`` out as its annotation says.

  Use it right after constructing a stack of layers with ``nnx.vmap`` /
  ``nnx.scan``. Inside the transform each layer's initializer only sees one
  layer and jax leaves the stacked dimension's layout open; flax adds the
  layer name (``transform_metadata={nnx.PARTITION_NAME: 'layers'}``) after
  the initializer has run, still inside the trace. So the stacked axis can
  only be laid out once the transform has returned: this function does that,
  resolving ``'layers'`` through the rules like any other name. It works
  eagerly (``jax.device_put``) and inside ``jit`` (sharding constraints).
  (``nnx.vmap(spmd_axis_name=...)`` can also shard the stacked axis, but by a
  mesh axis fixed at the call site, bypassing the rules; Variable hooks such
  as ``on_add_axis`` are deprecated and run inside the trace too.)

  Args:
    node: an ``nnx.Module`` (updated in place and returned), an
      ``nnx.State`` or any tree of Variables (a new tree is returned).
    mesh: the mesh; None uses the one set by ``jax.set_mesh``.
    rules: logical axis rules; None uses the context rules.

  Returns:
    ``node`` with every array laid out.

  Raises:
    NoMeshError: no mesh was given or set.
    ShardingError: naming the path of every Variable that cannot be laid out.

  Example:
    >>> import jax, flax_shardmeta as fsm
    >>> from flax import nnx
    >>> @nnx.vmap(in_axes=0, transform_metadata={nnx.PARTITION_NAME: 'layers'})
    ... def stack(key):
    ...   return nnx.Linear(2, 2, rngs=nnx.Rngs(key),
    ...       kernel_init=fsm.nnx.with_logical_partitioning(
    ...           nnx.initializers.lecun_normal(), ('embed', 'mlp')))
    >>> mesh = jax.make_mesh((1,), ('data',))
    >>> with jax.set_mesh(mesh), fsm.logical_axis_rules([('layers', 'data')]):
    ...   layers = fsm.nnx.shard_module(stack(jax.random.split(jax.random.key(0), 2)))
    >>> layers.kernel.get_value().sharding.spec
    P('data', None, None)
  """
  return construct.shard_module(node, mesh, rules)


def eval_shape(
  create: Callable[[], N],
  *,
  mesh: AnyMesh | None = None,
  rules: LogicalRules | None = None,
) -> N:
  """``nnx.eval_shape(create)`` whose abstract arrays carry fsm's shardings.

  Plain ``nnx.eval_shape`` under ``jax.set_mesh`` gives fsm-annotated
  modules the same layout (their ``sharding_rules`` metadata hands flax fsm's
  resolution). This one also takes ``mesh=`` and ``rules=`` explicitly and
  validates the layout: it runs ``create`` abstractly with no mesh set and
  attaches the shardings of :func:`flax_shardmeta.get_sharding` (if a mesh is
  given or set), which names every Variable that cannot be sharded.

  Args:
    create: builds the module (or any graph node), e.g.
      ``lambda: Model(rngs=nnx.Rngs(0))``.
    mesh: the mesh; None uses the one set by ``jax.set_mesh`` (none set: the
      abstract arrays carry no sharding).
    rules: logical axis rules; None uses the context rules.

  Returns:
    The abstract module, every array a ``jax.ShapeDtypeStruct``.

  Raises:
    ShardingError: naming the path of every Variable that cannot be sharded.

  Example:
    >>> import jax, flax_shardmeta as fsm
    >>> from flax import nnx
    >>> mesh = jax.sharding.AbstractMesh((2,), ('model',))
    >>> layer = fsm.nnx.eval_shape(lambda: nnx.Linear(4, 8, rngs=nnx.Rngs(0),
    ...     kernel_init=fsm.nnx.with_logical_partitioning(
    ...         nnx.initializers.lecun_normal(), ('embed', 'mlp'))),
    ...     mesh=mesh, rules=[('mlp', 'model')])
    >>> layer.kernel.get_value().sharding.spec
    P(None, 'model')
  """
  return construct.eval_shape(create, mesh, rules)


def as_abstract(
  tree: N, mesh: AnyMesh | None = None, rules: LogicalRules | None = None
) -> N:
  """``tree`` with every array a ``ShapeDtypeStruct`` carrying its sharding.

  flax_shardmeta's ``nnx.as_abstract``: the sharding comes from the
  annotation, resolved by fsm's rules and validated like ``fsm.get_sharding``
  (flax's own renames ``out_sharding`` alone and fails on a logical name that
  is not a mesh axis). The result can be given to checkpoint restoring or
  ``jax.jit(...).lower``. It is :func:`flax_shardmeta.as_abstract`, which
  takes NNX state too, with the mesh taken from the context if not given and
  modules accepted.

  Args:
    tree: an ``nnx.Module`` (a new abstract module is returned, the module
      itself is not changed), an ``nnx.State`` or any tree of Variables.
    mesh: the mesh; None uses the one set by ``jax.set_mesh``.
    rules: logical axis rules; None uses the context rules.

  Raises:
    NoMeshError: no mesh was given or set.
    ShardingError: naming the path of every Variable that cannot be sharded.
    InvalidNamesError: naming every Variable whose names are malformed.

  Example:
    >>> import jax, flax_shardmeta as fsm
    >>> from flax import nnx
    >>> model = nnx.eval_shape(lambda: nnx.Linear(4, 8, rngs=nnx.Rngs(0),
    ...     kernel_init=fsm.nnx.with_partitioning(
    ...         nnx.initializers.lecun_normal(), (None, 'model'))))
    >>> mesh = jax.sharding.AbstractMesh((2,), ('model',))
    >>> fsm.nnx.as_abstract(model, mesh).kernel.get_value().sharding.spec
    P(None, 'model')
  """
  return construct.as_abstract(tree, mesh, rules)


__all__ = [
  'FSM_LOGICAL',
  'NAME_KEYS',
  'OPTIMIZER_NAMES',
  'as_abstract',
  'eval_shape',
  'shard_module',
  'variable_annotation',
  'with_logical_partitioning',
  'with_partitioning',
]
