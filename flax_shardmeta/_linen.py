"""The Linen front end's annotation readers: our boxes (``fsm.Partitioned``,
``fsm.LogicalPartitioned``), flax's (``nn.Partitioned``,
``nn.LogicallyPartitioned``) and any other ``AxisMetadata`` (unwrapped to what
it holds), each registered with ``_annotation`` when this module is imported,
as the NNX adapter registers NNX's Variables. ``_annotation`` imports it by name
on the first leaf of such a type.
"""

from __future__ import annotations

from typing import Any

from flax.core import meta as flax_meta
from flax.linen import spmd as flax_linen_spmd

from flax_shardmeta import _annotation as ann_lib
from flax_shardmeta._boxes import Partitioned


def _read_fsm_box(box: Partitioned[Any]) -> tuple[Any, ann_lib.Annotation]:
  return box.value, ann_lib.interned(box.names, box.is_logical, box.rules, box.mesh)


def _read_flax_box(box: Any) -> tuple[Any, ann_lib.Annotation]:
  logical = isinstance(box, flax_linen_spmd.LogicallyPartitioned)
  rules = getattr(box, 'rules', None) if logical else None
  return box.value, ann_lib.interned(tuple(box.names), logical, rules, box.mesh)


def _read_other_box(box: Any) -> tuple[Any, ann_lib.Annotation | None]:
  # Some other AxisMetadata (e.g. a user's): unwrap it and read what it holds.
  inner = box.unbox() if not hasattr(box, 'value') else box.value
  return ann_lib.read(inner)


ann_lib.register_annotation_type(Partitioned, _read_fsm_box)
ann_lib.register_annotation_type(flax_meta.Partitioned, _read_flax_box)
ann_lib.register_annotation_type(flax_meta.AxisMetadata, _read_other_box)
# Every box (ours, flax's, a user's AxisMetadata) can hold a new value.
ann_lib.register_holder(
  flax_meta.AxisMetadata, lambda box, value: box.replace_boxed(value)
)
