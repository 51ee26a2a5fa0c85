"""The metadata keys of an annotated NNX Variable, and the Annotation they make.

flax_shardmeta stores a Variable's names under ``out_sharding`` with
:data:`FSM_LOGICAL`; flax's own annotations have used every key of
:data:`NAME_KEYS`. :func:`annotation_from_metadata` is the plain reading of
all of them; :func:`annotation_of` gives the same Annotation, made once per
distinct metadata.
"""

from __future__ import annotations

import functools
from typing import Any

from flax import nnx
from jax.experimental.layout import Format
from jax.sharding import NamedSharding, PartitionSpec

from flax_shardmeta import _annotation as ann_lib
from flax_shardmeta._flax_adapter import FsmRules, local_rules_of
from flax_shardmeta._names import annotation_names as as_names
from flax_shardmeta._specs import reductions_of, spec_entries

FSM_LOGICAL = 'fsm_logical'
"""Metadata key marking a flax_shardmeta annotation: True for logical names,
False for mesh-axis names. Its absence means the names are flax's own."""

NAME_KEYS = ('out_sharding', 'sharding_names', 'sharding')
"""Metadata keys flax has stored per-dimension names under, newest first."""

OPTIMIZER_NAMES = 'optimizer_sharding'
"""Metadata key whose names ``nnx.Optimizer`` gives a parameter's moments."""


def annotation_from_metadata(
  kind: type, metadata: dict[str, Any]
) -> ann_lib.Annotation | None:
  """The annotation of a Variable of class ``kind`` with this metadata, or None.

  Names come from the first non-empty key of :data:`NAME_KEYS` (a
  ``PartitionSpec``, ``NamedSharding`` or ``Format`` gives its spec, and its
  unreduced / reduced axes); with :data:`FSM_LOGICAL` they are fsm's own,
  without it flax's (a name no rule maps stays itself when it is a mesh axis).

  Example:
    >>> from flax import nnx
    >>> annotation_from_metadata(nnx.Param, {'out_sharding': ('a', None)}).names
    ('a', None)
  """
  raw = next((metadata[k] for k in NAME_KEYS if metadata.get(k)), None)
  if raw is None:
    return None
  mesh = metadata.get('mesh')
  if isinstance(raw, Format):  # a layout with its sharding: the sharding counts
    raw = raw.sharding
  if isinstance(raw, NamedSharding):  # flax also accepts full shardings
    mesh = mesh if mesh is not None else raw.mesh
    raw = raw.spec
  reductions = reductions_of(raw)
  names = as_names(spec_entries(raw) if isinstance(raw, PartitionSpec) else raw)
  rules = local_rules_of(metadata.get('sharding_rules'))
  is_optimizer = issubclass(kind, nnx.OptState)
  if FSM_LOGICAL in metadata:
    return ann_lib.Annotation(
      names,
      bool(metadata[FSM_LOGICAL]),
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


_ABSENT = object()
"""Stands for a metadata key a Variable does not have."""


def annotation_of(kind: type, metadata: dict[str, Any]) -> ann_lib.Annotation | None:
  """:func:`annotation_from_metadata`, made once per distinct annotation.

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
    return _from_key(*key, marker)


def _from_key(
  kind: type,
  raw_type: type,
  raw: Any,
  mesh: Any,
  stored_type: type,
  stored_key: Any,
  marker: Any,
) -> ann_lib.Annotation | None:
  """The annotation of the metadata a cache key stands for."""
  del raw_type  # part of the cache key only
  # Of an FsmRules only its rules are read: one with the same rules stands in.
  stored = FsmRules((), rules=stored_key) if stored_type is FsmRules else stored_key
  metadata = {'out_sharding': raw, 'mesh': mesh, 'sharding_rules': stored}
  if marker is not _ABSENT:
    metadata[FSM_LOGICAL] = marker
  return annotation_from_metadata(kind, metadata)


# Metadata of a kind repeats across a model's Variables: read each key once.
_annotation_cached = functools.lru_cache(maxsize=65536)(_from_key)
