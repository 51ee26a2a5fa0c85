"""How flax's own NNX functions see names laid out by flax_shardmeta.

flax renames a Variable's ``out_sharding`` through its ``sharding_rules``
metadata; flax_shardmeta stores an :class:`FsmRules` there. The Linen boxes
also give it to ``nnx.bridge`` (``LogicalPartitioned.to_nnx_metadata``), so
this module sits below them and does not import ``flax.nnx``.
"""

from __future__ import annotations

from typing import Any

from flax.core import spmd as flax_core_spmd

from flax_shardmeta._resolution import resolve
from flax_shardmeta._rules import (
  composite_rules,
  get_logical_axis_rules,
  normalize_rules,
)
from flax_shardmeta._specs import format_spec, unassigned_to_none


class FsmRules:
  """flax's view of logical names laid out by flax_shardmeta.

  flax's own NNX functions (``nnx.get_partition_spec``,
  ``nnx.get_named_sharding``, ``nnx.eval_shape`` under a mesh,
  ``nnx.get_abstract_model``) read a Variable's ``out_sharding`` and rename
  each name through the Variable's ``sharding_rules`` metadata and flax's rule
  context. flax_shardmeta stores an ``FsmRules`` there: iterated, it gives
  each name's mesh axes as flax_shardmeta's resolution gives them under the
  rules in force (``fsm.logical_axis_rules``, else flax's
  ``nn.logical_axis_rules``, composed with the per-variable ``rules``), a
  name no rule maps as None (replicated). So flax's functions lay the
  Variable out exactly as ``fsm.get_sharding`` does.

  A name a transform adds later (``nnx.vmap`` / ``nnx.scan`` with
  ``transform_metadata={nnx.PARTITION_NAME: 'layers'}``) is resolved as if
  added to ``names`` (where flax's own rule context is not set: flax renames
  it itself then). The view never changes once made: Variable metadata is
  part of the pytree structure, so it is compared and hashed by content.

  Example:
    >>> import flax_shardmeta as fsm
    >>> from flax_shardmeta._flax_adapter import FsmRules
    >>> view = FsmRules(('embed', 'mlp'))
    >>> with fsm.logical_axis_rules([('mlp', 'model')]):
    ...   print(dict(view))
    {'embed': None, 'mlp': 'model'}
  """

  __slots__ = ('names', 'optimizer_names', 'rules')

  def __init__(
    self,
    names: tuple[Any, ...],
    optimizer_names: tuple[Any, ...] | None = None,
    rules: tuple[tuple[str, Any], ...] | None = None,
  ):
    self.names = tuple(names)
    self.optimizer_names = optimizer_names
    self.rules = rules

  def _key(self) -> tuple[Any, ...]:
    return (self.names, self.optimizer_names, self.rules)

  def __eq__(self, other: object) -> bool:
    return type(other) is type(self) and self._key() == other._key()  # type: ignore[attr-defined]

  def __hash__(self) -> int:
    return hash((type(self).__name__, self._key()))

  def __reduce__(self) -> tuple[Any, ...]:
    return (type(self), self._key())

  def __repr__(self) -> str:
    extra = ''.join(
      f', {k}={v!r}'
      for k, v in (('optimizer_names', self.optimizer_names), ('rules', self.rules))
      if v is not None
    )
    return f'FsmRules({format_spec(self.names)}{extra})'

  def __bool__(self) -> bool:
    return True  # present: flax must rename through it, even with no names

  def __iter__(self) -> Any:
    return iter(self.pairs().items())

  def with_names(self, names: tuple[Any, ...]) -> FsmRules:
    """The same view for the Variable's current names."""
    return FsmRules(names, self.optimizer_names, self.rules)

  def pairs(self) -> dict[str, Any]:
    """``{name: mesh axes}`` under the rules in force now."""
    rules = composite_rules(get_logical_axis_rules(), self.rules)
    out: dict[str, Any] = {}
    for names in (self.names, self.optimizer_names or ()):
      resolved = unassigned_to_none(resolve(names, rules))
      for n, r in zip(names, resolved):
        if isinstance(n, str):
          out.setdefault(n, r)
    # flax merges its own context rules with these and refuses disagreements,
    # so names only a transform may add are given only where it has none.
    if not flax_core_spmd.get_logical_axis_rules():
      for name, _ in rules:
        if name not in out:
          out[name] = unassigned_to_none(resolve(self.names + (name,), rules))[-1]
    return out


def local_rules_of(stored: Any) -> tuple[tuple[str, Any], ...] | None:
  """Per-variable rules from ``sharding_rules`` metadata (an FsmRules or flax's)."""
  if isinstance(stored, FsmRules):
    return stored.rules
  return normalize_rules(stored) if stored else None
