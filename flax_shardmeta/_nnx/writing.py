"""Writing annotations: initializers whose Variables carry fsm's metadata.

The wrapped initializer lays its value out as it is made (under a mesh, with
flax's eager sharding on), generated on its shards; a layer that reshapes its
kernel gets it laid out once the value has the rank its names describe.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

from flax import nnx
from jax.sharding import PartitionSpec

from flax_shardmeta import _annotation as ann_lib, _sharding as sharding_lib
from flax_shardmeta._errors import ShardingError, ShardingProblem, UnmappedNameWarning
from flax_shardmeta._flax_adapter import FsmRules
from flax_shardmeta._frames import warn_at_user_code
from flax_shardmeta._generate.generate import generate
from flax_shardmeta._names import annotation_names as as_names
from flax_shardmeta._nnx.metadata import FSM_LOGICAL, OPTIMIZER_NAMES
from flax_shardmeta._placement import apply_spec, context_mesh
from flax_shardmeta._rules import get_logical_axis_rules, normalize_rules
from flax_shardmeta._specs import format_spec
from flax_shardmeta._typing import AnyMesh, LogicalNames, LogicalRules


def annotating(
  init: Callable[..., Any],
  names: LogicalNames,
  logical: bool,
  rules: LogicalRules | None,
  mesh: AnyMesh | None,
  optimizer_names: LogicalNames | None,
) -> Callable[..., nnx.VariableMetadata[Any]]:
  """``init`` wrapped to annotate the Variable it fills (see
  ``fsm.nnx.with_partitioning`` / ``with_logical_partitioning``)."""
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
