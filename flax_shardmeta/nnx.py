"""Flax NNX adapter: annotated Variables, eager sharding, stacked layers, optimizers.

NNX keeps annotations in a Variable's metadata rather than in a box. This
module writes them (:func:`with_partitioning`, :func:`with_logical_partitioning`),
reads them for the core (registered with
:func:`flax_shardmeta.register_annotation_type` on import, so
``fsm.get_partition_spec`` / ``fsm.get_sharding`` accept ``nnx.state(...)``)
and lays modules out eagerly (:func:`shard_module`).

Metadata layout. flax_shardmeta stores the names under ``out_sharding``, the
key flax's ``nnx.vmap`` / ``nnx.scan`` update when ``transform_metadata=
{nnx.PARTITION_NAME: 'layers'}`` adds an axis, plus ``fsm_logical`` (True:
logical names resolved by flax_shardmeta's rules; False: mesh axes) and
``eager_sharding=False`` so flax does not apply its own, stricter, resolution
at construction. Logical names also get ``sharding_rules``: an
:class:`~flax_shardmeta._boxes.FsmRules` through which flax's own functions
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

import contextlib
import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar, cast

import jax
import jax.core
import numpy as np
from flax import nnx
from flax.nnx import tracers as nnx_tracers
from flax.nnx import variablelib
from flax.nnx.bridge import variables as bridge_variables
from jax.experimental.layout import Format
from jax.sharding import NamedSharding, PartitionSpec

from flax_shardmeta import _annotation as ann_lib
from flax_shardmeta import _sharding as sharding_lib
from flax_shardmeta._boxes import FsmRules, as_names, local_rules_of
from flax_shardmeta._errors import (
  NoMeshError,
  ShardingError,
  ShardingProblem,
  UnmappedNameWarning,
)
from flax_shardmeta._frames import warn_at_user_code
from flax_shardmeta._generate import generate
from flax_shardmeta._placement import apply_spec, context_mesh
from flax_shardmeta._rules import (
  get_logical_axis_rules,
  logical_axis_rules,
  normalize_rules,
)
from flax_shardmeta._specs import format_spec, reductions_of, spec_entries
from flax_shardmeta._typing import AnyMesh, LogicalNames, LogicalRules, PyTree

N = TypeVar('N')

FSM_LOGICAL = 'fsm_logical'
"""Metadata key marking a flax_shardmeta annotation: True for logical names,
False for mesh-axis names. Its absence means the names are flax's own."""

NAME_KEYS = ('out_sharding', 'sharding_names', 'sharding')
"""Metadata keys flax has stored per-dimension names under, newest first."""

OPTIMIZER_NAMES = 'optimizer_sharding'
"""Metadata key whose names ``nnx.Optimizer`` gives a parameter's moments."""


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
  return _annotating(init, names, False, None, mesh, optimizer_names)


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
  return _annotating(init, names, True, rules, mesh, optimizer_names)


def _annotating(init, names, logical, rules, mesh, optimizer_names):
  names_t = as_names(names)
  rules_t = normalize_rules(rules) if rules is not None else None
  metadata: dict[str, Any] = {
    'out_sharding': names_t,
    FSM_LOGICAL: logical,
    # flax's own eager sharding errors on unmapped logical names and with no
    # mesh; the value is laid out below by flax_shardmeta's resolution.
    'eager_sharding': False,
  }
  # Only set keys flax reads when they carry something: flax's helpers
  # (nnx.as_abstract) take a present 'mesh' key at its word, even if None.
  if logical:
    opt_names = as_names(optimizer_names) if optimizer_names is not None else None
    metadata['sharding_rules'] = FsmRules(names_t, opt_names, rules_t)
  if mesh is not None:
    metadata['mesh'] = mesh
  if optimizer_names is not None:
    metadata[OPTIMIZER_NAMES] = as_names(optimizer_names)
  annotation = ann_lib.Annotation(names_t, logical, rules_t, mesh)

  @functools.wraps(init)
  def wrapper(*args: Any, **kwargs: Any) -> nnx.VariableMetadata[Any]:
    eager = nnx.using_eager_sharding()  # flax's switch, nnx.use_eager_sharding
    if logical and eager and rules is None:
      _warn_if_no_rules(names_t, mesh)
    if eager:
      # Generated directly on its shards when a mesh is set (see
      # _generate.generate): never the whole parameter on one device.
      value = generate(
        init, args, kwargs, names_t, mesh, logical=logical, rules=rules_t
      )
    else:
      value = init(*args, **kwargs)
    extra: dict[str, Any] = {}
    if isinstance(value, nnx.VariableMetadata):  # another metadata wrapper
      extra, value = dict(value.metadata), value.raw_value
    merged = {**extra, **metadata}
    shape = sharding_lib.leaf_shape(value)
    if eager and shape is not None and len(shape) != len(names_t):
      # A layer that reshapes its kernel asked for another shape: laid out
      # once the value has the rank the names describe.
      return _ReshapedMetadata(value, annotation, merged)
    if eager:
      value = _place(value, annotation)
    return nnx.VariableMetadata(value, metadata=merged)

  return wrapper


def _warn_if_no_rules(names: tuple[Any, ...], mesh: AnyMesh | None) -> None:
  """Logical names laid out on a mesh with no rules at all are replicated:
  that is worth a word (once per line of the user's code and names)."""
  if get_logical_axis_rules() or not any(isinstance(n, str) for n in names):
    return
  if (mesh if mesh is not None else context_mesh()) is None:
    return  # nothing is laid out yet
  warn_at_user_code(
    f'An NNX Variable annotated with logical names {format_spec(names)} was '
    'made on a mesh with no logical axis rules given or set (neither '
    "fsm.logical_axis_rules nor flax's nn.logical_axis_rules is active), so it "
    'was replicated. Build the module inside fsm.logical_axis_rules([...]), or '
    'pass rules=... to the initializer; rules=() replicates on purpose.',
    UnmappedNameWarning,
  )


class _ReshapedMetadata(nnx.VariableMetadata):
  """Metadata whose value is laid out once it has the annotated rank.

  flax's layers that reshape kernels (``nnx.LinearGeneral``,
  ``nnx.MultiHeadAttention``) call the initializer with a flattened shape,
  then assign the reshaped value to ``raw_value`` before making the Variable.
  That assignment lays it out. If the Variable is made while the value still
  has another rank than its names, that is the annotation's error, raised
  then (when the Variable reads ``metadata``).
  """

  def __init__(self, value: Any, annotation: ann_lib.Annotation, metadata: dict):
    self.__dict__['_annotation'] = annotation
    super().__init__(value, metadata=metadata)

  @property
  def raw_value(self) -> Any:  # type: ignore[override]
    return self.__dict__['_raw_value']

  @raw_value.setter
  def raw_value(self, value: Any) -> None:
    annotation = self.__dict__.get('_annotation')
    shape = sharding_lib.leaf_shape(value)
    if annotation is not None and _rank_fits(shape, annotation):
      value = _place(value, annotation)
    self.__dict__['_raw_value'] = value

  @property
  def metadata(self) -> Any:  # type: ignore[override]
    annotation = self.__dict__.get('_annotation')
    if annotation is not None and not _rank_fits(
      sharding_lib.leaf_shape(self.raw_value), annotation
    ):
      _place(self.raw_value, annotation)  # raises, naming the rank problem
    return self.__dict__['_metadata']

  @metadata.setter
  def metadata(self, metadata: Any) -> None:
    self.__dict__['_metadata'] = metadata


def _rank_fits(shape: tuple[int, ...] | None, annotation: ann_lib.Annotation) -> bool:
  return shape is None or len(shape) == len(annotation.names)


def _place(value: Any, annotation: ann_lib.Annotation) -> Any:
  """Lays a freshly initialized value out on the known mesh, if any."""
  mesh = annotation.mesh if annotation.mesh is not None else context_mesh()
  shape = sharding_lib.leaf_shape(value)
  if mesh is None or shape is None:
    return value
  layout = sharding_lib.layout_of(
    shape,
    annotation,
    mesh,
    sharding_lib.effective_rules(None),
    for_constraint=True,
  )
  if layout.issues:
    raise ShardingError(
      [
        ShardingProblem(
          '<initializer>', shape, annotation.names, layout.spec, reason, hint, dims
        )
        for reason, hint, dims in layout.issues
      ],
      context=(
        ' (the path is not known while a Variable is being created; '
        'fsm.get_sharding(nnx.state(nnx.eval_shape(create)), mesh) names it)'
      ),
    )
  spec = cast(PartitionSpec, layout.spec)  # a layout without issues has one
  return apply_spec(value, tuple(spec), mesh, names=annotation.names)


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
  return _annotation_of(type(variable), variable.get_metadata())


_ABSENT = object()
"""Stands for a metadata key a Variable does not have."""


def _annotation_of(kind: type, metadata: dict[str, Any]) -> ann_lib.Annotation | None:
  """The annotation of a Variable of class ``kind`` with this metadata.

  Models repeat a few annotations thousands of times: one Annotation is made
  per distinct (class, names, mesh, rules, marker), its names and rules
  normalised once. Metadata that cannot be hashed is read every time.
  """
  get = metadata.get
  raw = get('out_sharding') or get('sharding_names') or get('sharding') or None
  if raw is None:
    return None
  # type(raw): a PartitionSpec may equal a tuple yet carry reductions. Of an
  # FsmRules only its rules count, and comparing those is cheaper than it.
  stored = get('sharding_rules')
  stored_key = stored.rules if type(stored) is FsmRules else stored
  key = (kind, type(raw), raw, get('mesh'), type(stored), stored_key)
  marker = get(FSM_LOGICAL, _ABSENT)
  try:
    return _annotation_cached(*key, marker)
  except TypeError:  # an unhashable entry (e.g. names or rules as lists)
    return _make_annotation(*key, marker)


@functools.lru_cache(maxsize=65536)
def _annotation_cached(
  kind: type,
  raw_type: type,
  raw: Any,
  mesh: Any,
  stored_type: type,
  stored_key: Any,
  marker: Any,
) -> ann_lib.Annotation:
  return _make_annotation(kind, raw_type, raw, mesh, stored_type, stored_key, marker)


def _make_annotation(
  kind: type,
  raw_type: type,
  raw: Any,
  mesh: Any,
  stored_type: type,
  stored_key: Any,
  marker: Any,
) -> ann_lib.Annotation:
  del raw_type  # part of the cache key only
  if isinstance(raw, Format):  # a layout with its sharding: the sharding counts
    raw = raw.sharding
  if isinstance(raw, NamedSharding):  # flax also accepts full shardings
    mesh = mesh if mesh is not None else raw.mesh
    raw = raw.spec
  reductions = reductions_of(raw)
  names = as_names(spec_entries(raw) if isinstance(raw, PartitionSpec) else raw)
  rules = stored_key if stored_type is FsmRules else local_rules_of(stored_key)
  is_optimizer = issubclass(kind, nnx.OptState)
  if marker is not _ABSENT:
    return ann_lib.Annotation(
      names,
      bool(marker),
      rules,
      mesh,
      optimizer_state=is_optimizer,
      reductions=reductions,
    )
  # flax's own annotation: renamed through rules, unmapped mesh axes kept.
  return ann_lib.Annotation(
    names,
    True,
    rules,
    mesh,
    keep_mesh_names=True,
    optimizer_state=is_optimizer,
    reductions=reductions,
  )


# Reading and rebuilding Variables is most of the work of fsm.get_sharding on
# NNX state, so the common case skips flax's public accessors, which copy the
# metadata and map the value each time: a Variable of a class that reads and
# copies as nnx.Variable does, holding a plain array (no Ref, no tracer) and no
# get-value hooks, is read from its fields; its result Variable gets the
# fields ``variable.replace`` gives it (as ``nnx.Variable._new`` sets them: the
# result, one copy of the metadata, a TraceState of the current trace, here
# shared by the Variables made under that trace). Everything else goes through
# flax's methods.

_VARIABLE_METHODS = ('get_value', 'copy', 'replace', 'from_metadata', '_new')
_VARIABLE_SLOTS = ('_raw_value', '_trace_state', '_var_metadata')
"""The fields ``nnx.Variable._new`` sets (flax 0.12.8 to 0.12.12)."""


@functools.cache
def _direct_class(kind: type) -> bool:
  """Whether ``kind`` reads and copies exactly as ``nnx.Variable`` does."""
  return tuple(getattr(nnx.Variable, '__slots__', ())) == _VARIABLE_SLOTS and all(
    next((k for k in kind.__mro__ if name in vars(k)), None) is nnx.Variable
    for name in _VARIABLE_METHODS
  )


_plain_values: dict[type, bool] = {}
"""Per value class: ``get_value`` returns such a value itself (a pytree leaf
that is never a Ref: ShapeDtypeStruct, numpy and concrete jax arrays)."""


def _plain_value(kind: type) -> bool:
  plain = _plain_values.get(kind)
  if plain is None:
    plain = _plain_values[kind] = (
      kind is jax.ShapeDtypeStruct
      or issubclass(kind, np.ndarray)
      # jax's concrete array class (jaxlib's, or jax's own Python one)
      or (kind.__name__ == 'ArrayImpl' and issubclass(kind, jax.Array))
    )
  return plain


_last_trace_state: list[Any] = [None]


def _trace_state() -> Any:
  """A TraceState of the current jax trace, shared by the Variables made under
  it: one never changes once made, and flax compares them by their trace.
  (Three objects fewer per Variable for the garbage collector to walk.)"""
  current = nnx_tracers.current_jax_trace()
  state = _last_trace_state[0]
  if state is None or state.jax_trace != current:
    state = _last_trace_state[0] = nnx_tracers.TraceState()
  return state


def _read_variable(
  variable: nnx.Variable[Any],
) -> tuple[Any, ann_lib.Annotation | None]:
  kind = type(variable)
  if _direct_class(kind):
    metadata = variable._var_metadata
    value = variable._raw_value
    if 'on_get_value' in metadata or not _plain_value(type(value)):
      value = variable.get_value()
    return value, _annotation_of(kind, metadata)
  return variable.get_value(), variable_annotation(variable)


def _rebuild_variable(variable: nnx.Variable[Any], result: Any) -> Any:
  # Results stay inside a Variable of the same type and metadata, so the output
  # has exactly the structure of nnx.state(...) (jit's out_shardings needs it).
  kind = type(variable)
  if _direct_class(kind) and type(result) in _LEAF_RESULTS:
    metadata = variable._var_metadata
    # replace() wraps the result of a ref=True Variable in a Ref and makes
    # hijax Variables: those are left to it.
    if not (metadata.get('hijax', True) or metadata.get('ref', True)):
      out = object.__new__(kind)
      object.__setattr__(out, '_trace_state', _trace_state())
      object.__setattr__(out, '_var_metadata', dict(metadata))
      object.__setattr__(out, '_raw_value', result)
      return out
  return variable.replace(result)


_LEAF_RESULTS = frozenset({NamedSharding, PartitionSpec, type(None)})
"""Results ``variable.replace`` keeps as they are (pytree leaves, not Refs)."""


ann_lib.register_annotation_type(nnx.Variable, _read_variable, _rebuild_variable)


def _read_bridged(
  box: bridge_variables.NNXMeta,
) -> tuple[Any, ann_lib.Annotation | None]:
  # `nnx.bridge.to_linen` hands Linen an NNX Variable as this box: its value
  # and the Variable's metadata (fsm's or flax's own annotation) as they were.
  return box.value, _annotation_of(box.var_type, box.metadata)


ann_lib.register_annotation_type(bridge_variables.NNXMeta, _read_bridged)


def _read_hijax(variable: Any) -> tuple[Any, ann_lib.Annotation | None]:
  # A Variable made with hijax=True is a HijaxVariable: not a subclass of
  # nnx.Variable (only isinstance says so) and a pytree leaf of its own, so
  # the result takes its place in the output tree.
  return variable.get_value(), _annotation_of(
    variable.var_type, variable.get_metadata()
  )


_HIJAX_VARIABLE = getattr(variablelib, 'HijaxVariable', None)
if _HIJAX_VARIABLE is not None:  # flax 0.12.8 and later
  ann_lib.register_annotation_type(_HIJAX_VARIABLE, _read_hijax)


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
  mesh = mesh if mesh is not None else context_mesh()
  if mesh is None:
    raise NoMeshError(
      'shard_module needs a mesh: pass mesh=... or call it inside '
      '`with jax.set_mesh(mesh):`.'
    )
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
  mesh = mesh if mesh is not None else context_mesh()
  with _rule_context(rules):
    abstract = _create_abstractly(create, mesh)
  if mesh is None:
    return abstract
  nnx.update(abstract, as_abstract(nnx.state(abstract), mesh, rules))
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


def as_abstract(
  tree: N, mesh: AnyMesh | None = None, rules: LogicalRules | None = None
) -> N:
  """``tree`` with every array a ``ShapeDtypeStruct`` carrying its sharding.

  flax_shardmeta's ``nnx.as_abstract``: the sharding comes from the
  annotation, resolved by fsm's rules and validated like ``fsm.get_sharding``
  (flax's own renames ``out_sharding`` alone and fails on a logical name that
  is not a mesh axis). The result can be given to checkpoint restoring or
  ``jax.jit(...).lower``.

  Args:
    tree: an ``nnx.Module`` (a new abstract module is returned, the module
      itself is not changed), an ``nnx.State`` or any tree of Variables.
    mesh: the mesh; None uses the one set by ``jax.set_mesh``.
    rules: logical axis rules; None uses the context rules.

  Raises:
    NoMeshError: no mesh was given or set.
    ShardingError: naming the path of every Variable that cannot be sharded.

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
  mesh = mesh if mesh is not None else context_mesh()
  if mesh is None:
    raise NoMeshError(
      'as_abstract needs a mesh: pass mesh=... or call it inside '
      '`with jax.set_mesh(mesh):`.'
    )
  if isinstance(tree, nnx.Module):
    graphdef, state = nnx.split(tree)
    return nnx.merge(graphdef, as_abstract(state, mesh, rules))
  shardings = sharding_lib.get_sharding(tree, mesh, rules)  # raises, by path
  # Both trees walk to the same leaves, Variables holding trees included.
  leaves, build = ann_lib.walk(tree)
  placed, _ = ann_lib.walk(shardings)
  return build([_abstract(lf, sh.value) for lf, sh in zip(leaves, placed)])


def _abstract(leaf: ann_lib.Leaf, sharding: Any) -> Any:
  """What the abstract tree holds in place of one walked leaf."""
  value = leaf.value
  if not isinstance(sharding, NamedSharding) or sharding_lib.leaf_shape(value) is None:
    struct = value
  else:
    struct = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
  if _HIJAX_VARIABLE is not None and isinstance(leaf.leaf, _HIJAX_VARIABLE):
    return leaf.leaf.replace(struct)  # a pytree leaf: replaced whole
  return struct


def abstract_with_sharding(
  state: PyTree, mesh: AnyMesh, rules: LogicalRules | None = None
) -> PyTree:
  """Deprecated: use :func:`as_abstract` (flax 0.12.7 renamed
  ``nnx.abstract_with_sharding`` to ``nnx.as_abstract``; so does fsm.nnx).

  Example:
    >>> import warnings, jax, flax_shardmeta as fsm
    >>> from flax import nnx
    >>> model = nnx.eval_shape(lambda: nnx.Linear(4, 8, rngs=nnx.Rngs(0)))
    >>> mesh = jax.sharding.AbstractMesh((2,), ('model',))
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter('always')
    ...   _ = fsm.nnx.abstract_with_sharding(nnx.state(model), mesh)
    >>> caught[0].category.__name__
    'DeprecationWarning'
  """
  warnings.warn(
    'fsm.nnx.abstract_with_sharding is deprecated: use fsm.nnx.as_abstract, '
    "the name flax's nnx.as_abstract took over from nnx.abstract_with_sharding.",
    DeprecationWarning,
    stacklevel=2,
  )
  return as_abstract(state, mesh, rules)


__all__ = [
  'FSM_LOGICAL',
  'NAME_KEYS',
  'OPTIMIZER_NAMES',
  'abstract_with_sharding',
  'as_abstract',
  'eval_shape',
  'shard_module',
  'variable_annotation',
  'with_logical_partitioning',
  'with_partitioning',
]
