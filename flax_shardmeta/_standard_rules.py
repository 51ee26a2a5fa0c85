"""T5X's standard logical axis rules over a ``('data', 'model')`` mesh."""

from __future__ import annotations

from flax_shardmeta._errors import InvalidRulesError
from flax_shardmeta._rules import normalize_rules
from flax_shardmeta._typing import LogicalRules, MeshAxes

_T5X_REPLICATED = (
  ('relpos_buckets', None),
  ('abspos_buckets', None),
  ('length', None),
  ('layers', None),
  ('stack', None),
  ('mlp_activations', None),
)


def standard_logical_axis_rules(
  activation_partitioning_dims: int = 1,
  parameter_partitioning_dims: int = 1,
  additional_rules: LogicalRules | None = None,
) -> tuple[tuple[str, MeshAxes], ...]:
  """The T5X default rules over a ``('data', 'model')`` mesh.

  Args:
    activation_partitioning_dims: 1, or 2 to also shard activations' embed
      dimension over 'model'.
    parameter_partitioning_dims: 1, or 2 to also shard parameters' embed
      dimension over 'data' (2-D parameter sharding).
    additional_rules: appended after the standard rules (lower priority).

  Returns:
    The priority-ordered rules.

  Example:
    >>> import flax_shardmeta as fsm
    >>> rules = fsm.standard_logical_axis_rules(1, 2)
    >>> fsm.logical_to_mesh_axes(('embed', 'mlp'), rules)
    P('data', 'model')
  """
  base = (
    ('batch', 'data'),
    ('vocab', 'model'),
    ('mlp', 'model'),
    ('heads', 'model'),
    ('kv', None),
    ('joined_kv', 'model'),
  )
  dims = (activation_partitioning_dims, parameter_partitioning_dims)
  if dims == (1, 1):
    embed = (('embed', None),)
  elif dims == (2, 1):
    embed = (('embed', 'model'),)
  elif dims == (1, 2):
    embed = (('embed', 'data'),)
  elif dims == (2, 2):
    embed = (('embed', 'model'), ('embed', 'data'))
  else:
    raise InvalidRulesError(
      f'activation_partitioning_dims={activation_partitioning_dims}, '
      f'parameter_partitioning_dims={parameter_partitioning_dims} is not '
      'supported; each must be 1 or 2.'
    )
  rules = base + embed + _T5X_REPLICATED
  return rules + normalize_rules(additional_rules)
