"""Reading NNX Variables for the core: values, annotations, results put back.

Two readings give the same results. The reference reading goes through
flax's public accessors: ``variable.get_value()``, the annotation of
``variable.get_metadata()`` and ``variable.replace(result)``. The fast path
(:func:`fast_path`) reads plain Variables from their private fields, which
holds only while flax's Variable is what it expects: a probe, run once on
first use, checks that and falls back to the reference reading otherwise.
``nnx.bridge``'s boxes and hijax Variables are read through the accessors.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import tracers as nnx_tracers, variablelib
from flax.nnx.bridge import variables as bridge_variables
from jax.sharding import NamedSharding, PartitionSpec

from flax_shardmeta import _annotation as ann_lib
from flax_shardmeta._nnx.metadata import (
  FSM_LOGICAL,
  annotation_from_metadata,
  annotation_of,
)


class Reading(NamedTuple):
  """One way of reading Variables: its name, reader and rebuild."""

  name: str
  read: ann_lib.Reader
  rebuild: ann_lib.Rebuild


# The reference reading
# ------------------------------------------------------------------------------


def reference_read(variable: nnx.Variable[Any]) -> tuple[Any, Any]:
  """A Variable's value and annotation, through flax's public accessors."""
  metadata = variable.get_metadata()
  return variable.get_value(), annotation_from_metadata(type(variable), metadata)


def reference_rebuild(variable: nnx.Variable[Any], result: Any) -> Any:
  """``result`` in a Variable of ``variable``'s class and metadata."""
  return variable.replace(result)


REFERENCE = Reading('reference', reference_read, reference_rebuild)
"""The fallback: correct on any flax whose public accessors are as today."""


# The fast path
# ------------------------------------------------------------------------------

_VARIABLE_SLOTS = ('_raw_value', '_trace_state', '_var_metadata')
"""The fields ``nnx.Variable._new`` sets (flax 0.12.8 to 0.12.12)."""
_VARIABLE_METHODS = ('get_value', 'copy', 'replace', 'from_metadata', '_new')
"""Methods a class must inherit from ``nnx.Variable`` to be read by its fields."""
_LEAF_RESULTS = frozenset({NamedSharding, PartitionSpec, type(None)})
"""Results ``variable.replace`` keeps as they are (pytree leaves, not Refs)."""


def fast_path() -> Reading:
  """The reading that relies on flax's internals; no other code does.

  Why: reading and rebuilding Variables is most of the work of
  ``fsm.get_sharding`` on NNX state, and flax's accessors copy the metadata
  and map the value on every call. A Variable of a class that reads and
  copies as ``nnx.Variable`` does, holding a plain value (no Ref, no tracer)
  and no get-value hooks, is read from its fields ``_raw_value`` and
  ``_var_metadata``. Its result Variable gets the fields ``variable.replace``
  would give it, set as ``nnx.Variable._new`` sets them: the result, one copy
  of the metadata, and a ``TraceState`` of the current trace (shared by the
  Variables made under that trace: one never changes once made, and flax
  compares them by their trace). Everything else goes through flax's methods.
  :func:`probe` checks all this holds for the flax installed.
  """

  @functools.cache
  def direct(kind: type) -> bool:
    return all(
      next((k for k in kind.__mro__ if name in vars(k)), None) is nnx.Variable
      for name in _VARIABLE_METHODS
    )

  last_state: list[Any] = [None]

  def trace_state() -> Any:
    current = nnx_tracers.current_jax_trace()
    state = last_state[0]
    if state is None or state.jax_trace != current:
      state = last_state[0] = nnx_tracers.TraceState()
    return state

  def read(variable: nnx.Variable[Any]) -> tuple[Any, Any]:
    kind = type(variable)
    if not direct(kind):
      return variable.get_value(), annotation_of(kind, variable.get_metadata())
    metadata = variable._var_metadata
    value = variable._raw_value
    if 'on_get_value' in metadata or not _plain_value(type(value)):
      value = variable.get_value()
    return value, annotation_of(kind, metadata)

  def rebuild(variable: nnx.Variable[Any], result: Any) -> Any:
    kind = type(variable)
    if direct(kind) and type(result) in _LEAF_RESULTS:
      metadata = variable._var_metadata
      # replace() wraps the result of a ref=True Variable in a Ref and makes
      # hijax Variables: those are left to it.
      if not (metadata.get('hijax', True) or metadata.get('ref', True)):
        out = object.__new__(kind)
        object.__setattr__(out, '_trace_state', trace_state())
        object.__setattr__(out, '_var_metadata', dict(metadata))
        object.__setattr__(out, '_raw_value', result)
        return out
    return variable.replace(result)

  return Reading('fast', read, rebuild)


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


# Choosing a reading
# ------------------------------------------------------------------------------


def probe(fast: Reading) -> bool:
  """Whether ``fast`` reads and rebuilds as the reference reading does here.

  ``nnx.Variable`` must have exactly the fields and methods the fast path
  knows, and a known Variable read and rebuilt by it must give what the
  reference reading gives (value, annotation, class, every field, tree
  structure). Any error counts as a difference.
  """
  try:
    return _probe(fast)
  except Exception:  # noqa: BLE001 - whatever broke, the reference reading holds
    return False


def _probe(fast: Reading) -> bool:
  if tuple(getattr(nnx.Variable, '__slots__', ())) != _VARIABLE_SLOTS:
    return False
  if not all(name in vars(nnx.Variable) for name in _VARIABLE_METHODS):
    return False
  variable = nnx.Param(
    jax.ShapeDtypeStruct((4, 2), jnp.float32),
    out_sharding=('embed', None),
    sharding_rules=(('embed', 'data'),),
    eager_sharding=False,
    hijax=False,
    ref=False,
    **{FSM_LOGICAL: True},
  )
  (value, annotation), want = fast.read(variable), REFERENCE.read(variable)
  if value != want[0] or annotation is None or annotation != want[1]:
    return False
  result = PartitionSpec('data', None)
  out, expected = fast.rebuild(variable, result), REFERENCE.rebuild(variable, result)
  same = (
    type(out) is type(expected)
    and all(getattr(out, slot) == getattr(expected, slot) for slot in _VARIABLE_SLOTS)
    and jax.tree.structure(out) == jax.tree.structure(expected)
    and out.get_value() == result
  )
  out.set_metadata('probe', True)  # a copy of the metadata, not the input's
  return same and 'probe' not in variable.get_metadata()


_chosen: list[Reading] = []
"""The reading :func:`chosen_reading` picked, once probed."""


def chosen_reading() -> Reading:
  """The fast path if :func:`probe` passes on this flax, else the reference
  reading (probed once)."""
  if not _chosen:
    fast = fast_path()
    _chosen.append(fast if probe(fast) else REFERENCE)
  return _chosen[0]


def _read_first(variable: nnx.Variable[Any]) -> tuple[Any, Any]:
  reading = chosen_reading()
  _install(reading)
  return reading.read(variable)


def _rebuild_first(variable: nnx.Variable[Any], result: Any) -> Any:
  reading = chosen_reading()
  _install(reading)
  return reading.rebuild(variable, result)


_FIRST_USE = Reading('first use', _read_first, _rebuild_first)
_installed: list[Reading] = [_FIRST_USE]


def _install(reading: Reading) -> None:
  _installed[0] = reading
  ann_lib.swap_reader(nnx.Variable, reading.read, reading.rebuild)


def installed_reading() -> str:
  """The name of the reading Variables get now: 'fast', 'reference', or
  'first use' (not chosen yet)."""
  return _installed[0].name


@contextlib.contextmanager
def use_reference_reading() -> Iterator[None]:
  """Variables are read through flax's public accessors inside the block.

  Forces the fallback the probe would choose, e.g. to test it on a flax where
  the fast path holds.

  Example:
    >>> from flax_shardmeta._nnx import reading
    >>> with reading.use_reference_reading():
    ...   reading.installed_reading()
    'reference'
  """
  previous = _installed[0]
  _install(REFERENCE)
  try:
    yield
  finally:
    _install(previous)


# Other NNX leaves
# ------------------------------------------------------------------------------


def _read_bridged(
  box: bridge_variables.NNXMeta,
) -> tuple[Any, ann_lib.Annotation | None]:
  # `nnx.bridge.to_linen` hands Linen an NNX Variable as this box: its value
  # and the Variable's metadata (fsm's or flax's own annotation) as they were.
  return box.value, annotation_of(box.var_type, box.metadata)


def _read_hijax(variable: Any) -> tuple[Any, ann_lib.Annotation | None]:
  # A Variable made with hijax=True is a HijaxVariable: not a subclass of
  # nnx.Variable (only isinstance says so) and a pytree leaf of its own, so
  # the result takes its place in the output tree, and an abstract tree keeps
  # it holding its struct.
  return variable.get_value(), annotation_of(variable.var_type, variable.get_metadata())


ann_lib.register_annotation_type(nnx.Variable, _read_first, _rebuild_first)
ann_lib.register_annotation_type(bridge_variables.NNXMeta, _read_bridged)
HIJAX_VARIABLE: type | None = getattr(variablelib, 'HijaxVariable', None)
if HIJAX_VARIABLE is not None:  # flax 0.12.8 and later
  ann_lib.register_annotation_type(HIJAX_VARIABLE, _read_hijax)
  ann_lib.register_holder(
    HIJAX_VARIABLE, lambda variable, value: variable.replace(value)
  )
