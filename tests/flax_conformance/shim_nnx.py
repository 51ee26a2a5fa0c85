"""``flax.nnx`` with its sharding-metadata names replaced by fsm's.

Replaced: ``with_partitioning`` (``fsm.nnx.with_partitioning``),
``get_partition_spec`` and ``get_named_sharding`` (``fsm.get_partition_spec``,
``fsm.get_sharding``), ``eval_shape`` and ``as_abstract`` (``fsm.nnx``'s; also
under flax's old name ``abstract_with_sharding``), ``logical_axis_rules`` and
``PARTITION_NAME`` (fsm's). Not adapted, so a call using flax's other
parameters fails visibly: ``fsm.nnx.eval_shape(create, *, mesh, rules)`` takes
no arguments for ``create``; ``fsm.nnx.as_abstract(tree, mesh=None, ...)``
takes a mesh where flax's takes ``graph``. Kept as flax's: everything else,
e.g. ``with_metadata``, ``get_abstract_model``, ``use_eager_sharding``,
``transform_metadata``, ``spmd`` and ``bridge`` (no fsm counterparts).
"""

from typing import Any

from flax import nnx as _flax_nnx

import flax_shardmeta as fsm
import flax_shardmeta.nnx as fsm_nnx

from ._reexport import fallback, public_namespace

globals().update(public_namespace(_flax_nnx))
__getattr__ = fallback(_flax_nnx)

get_partition_spec = fsm.get_partition_spec
get_named_sharding = fsm.get_sharding
eval_shape = fsm_nnx.eval_shape
as_abstract = fsm_nnx.as_abstract
abstract_with_sharding = fsm_nnx.as_abstract
logical_axis_rules = fsm.logical_axis_rules
PARTITION_NAME = fsm.PARTITION_NAME


def with_partitioning(
  initializer: Any, sharding: Any, mesh: Any = None, **metadata: Any
) -> Any:
  """``fsm.nnx.with_partitioning``; renaming only: flax's ``initializer`` /
  ``sharding`` / ``optimizer_sharding`` are fsm's ``init`` / ``names`` /
  ``optimizer_names``, and fsm takes ``mesh`` by keyword. Other Variable
  metadata (flax's ``**metadata``) is passed on, for fsm to refuse."""
  if 'optimizer_sharding' in metadata:
    metadata['optimizer_names'] = metadata.pop('optimizer_sharding')
  return fsm_nnx.with_partitioning(initializer, sharding, mesh=mesh, **metadata)
