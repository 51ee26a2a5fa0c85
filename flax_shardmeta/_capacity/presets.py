"""Rule presets: named layouts over named mesh axes, for ``fsm.suggest``.

Each preset says which mesh axes it uses and how the logical names of a
transformer (``batch``, ``embed``, ``vocab``, ``heads``, ``kv_heads``,
``mlp``, ``experts``; everything else replicated) map onto them:

========== ====================== ==============================================
preset     mesh axes              rules
========== ====================== ==============================================
fsdp       data, fsdp             batch over (data, fsdp); embed over fsdp
fsdp+tp    data, fsdp, model      as fsdp, and heads, kv_heads, mlp, vocab over
                                  model
tp         data, model            batch over data; heads, kv_heads, mlp, vocab
                                  over model
t5x-1d     data, model            T5X's rules, model parallelism in 1-D
                                  (``standard_logical_axis_rules(1, 1)``)
t5x-2d     data, model            T5X's 2-D parameter partitioning: embed over
                                  data as well (``(1, 2)``)
ep         data, expert           experts over expert; batch over (data,
                                  expert) (mixture-of-experts models)
========== ====================== ==============================================
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from collections.abc import Iterable, Sequence
from typing import Any

from flax_shardmeta._errors import InvalidRulesError
from flax_shardmeta._rules import normalize_rules
from flax_shardmeta._standard_rules import standard_logical_axis_rules

_TP = (('heads', 'model'), ('kv_heads', 'model'), ('mlp', 'model'), ('vocab', 'model'))


@dataclasses.dataclass(frozen=True)
class RulePreset:
  """A named rule set over named mesh axes.

  Attributes:
    name: e.g. ``'fsdp+tp'``.
    axes: the mesh axes the rules use, in mesh order (slowest first).
    rules: logical axis rules over those axes.
    description: one line, for tables.

  Example:
    >>> import flax_shardmeta as fsm
    >>> mine = fsm.RulePreset('dp', ('data',), [('batch', 'data')])
    >>> mine.axes, mine.rules
    (('data',), (('batch', 'data'),))
  """

  name: str
  axes: tuple[str, ...]
  rules: Any  # LogicalRules; stored normalised, as a tuple of pairs
  description: str = ''

  def __post_init__(self) -> None:
    object.__setattr__(self, 'axes', tuple(self.axes))
    object.__setattr__(self, 'rules', normalize_rules(self.rules))
    used = {a for _, target in self.rules for a in _axes(target)}
    unknown = sorted(used - set(self.axes))
    if unknown:
      raise InvalidRulesError(
        f'rule preset {self.name!r}: its rules use mesh axes {unknown} that are not '
        f'among its axes {self.axes}; add them to axes or change the rules.'
      )


def _axes(target: Any) -> tuple[str, ...]:
  if target is None:
    return ()
  if isinstance(target, str):
    return (target,)
  return tuple(target)


RULE_PRESETS: dict[str, RulePreset] = {
  p.name: p
  for p in (
    RulePreset(
      'fsdp',
      ('data', 'fsdp'),
      (('batch', ('data', 'fsdp')), ('embed', 'fsdp')),
      "parameters' embed over fsdp, batch over data and fsdp",
    ),
    RulePreset(
      'fsdp+tp',
      ('data', 'fsdp', 'model'),
      (('batch', ('data', 'fsdp')), ('embed', 'fsdp'), *_TP),
      'fsdp, and heads / mlp / vocab over model',
    ),
    RulePreset(
      'tp',
      ('data', 'model'),
      (('batch', 'data'), *_TP),
      'heads / mlp / vocab over model, batch over data',
    ),
    RulePreset(
      't5x-1d',
      ('data', 'model'),
      standard_logical_axis_rules(1, 1),
      "T5X's rules, 1-D model parallelism",
    ),
    RulePreset(
      't5x-2d',
      ('data', 'model'),
      standard_logical_axis_rules(1, 2),
      "T5X's rules, parameters' embed over data too",
    ),
    RulePreset(
      'ep',
      ('data', 'expert'),
      (('batch', ('data', 'expert')), ('experts', 'expert')),
      'experts over expert (mixture-of-experts models)',
    ),
  )
}
"""The built-in presets, by name (see the module doc)."""

DEFAULT_PRESETS = ('fsdp', 'fsdp+tp', 'tp')
"""What ``suggest`` tries unless told otherwise (dense models)."""


def resolve(presets: Iterable[str | RulePreset]) -> tuple[RulePreset, ...]:
  """Names and presets -> presets; unknown names list the known ones.

  Example:
    >>> [p.name for p in resolve(['fsdp', 'tp'])]
    ['fsdp', 'tp']
  """
  out = []
  for p in presets:
    if isinstance(p, RulePreset):
      out.append(p)
    elif isinstance(p, str) and p in RULE_PRESETS:
      out.append(RULE_PRESETS[p])
    else:
      raise InvalidRulesError(
        f'unknown rule preset {p!r}; choose from {", ".join(RULE_PRESETS)} or pass a '
        'fsm.RulePreset(name, axes, rules).'
      )
  names = [p.name for p in out]
  if len(set(names)) != len(names):
    raise InvalidRulesError(f'rule presets {names} name one preset twice.')
  return tuple(out)


def load(text: str, source: str = '<presets>') -> tuple[RulePreset, ...]:
  """Presets from TOML (``[presets.NAME] axes = [...]; rules = [[n, t], ...]``)
  or JSON (``{"NAME": {"axes": [...], "rules": [[n, t], ...]}}``).

  An empty list target means replicated (TOML has no null).

  Example:
    >>> (p,) = load('[presets.dp]\\naxes = ["data"]\\nrules = [["batch", "data"]]')
    >>> p.name, p.rules
    ('dp', (('batch', 'data'),))
  """
  try:
    data = json.loads(text) if text.lstrip().startswith('{') else tomllib.loads(text)
  except ValueError as e:
    raise InvalidRulesError(f'cannot parse presets in {source}: {e}') from None
  table = data.get('presets', data) if isinstance(data, dict) else None
  if not isinstance(table, dict) or not table:
    raise InvalidRulesError(
      f'{source} holds no presets; write [presets.NAME] tables with axes and rules.'
    )
  out = []
  for name, body in table.items():
    if not isinstance(body, dict) or 'axes' not in body or 'rules' not in body:
      raise InvalidRulesError(f'preset {name!r} in {source} needs axes and rules.')
    rules = [
      (r[0], None if r[1] == [] else r[1]) if isinstance(r, list) and len(r) == 2 else r
      for r in body['rules']
    ]
    out.append(
      RulePreset(name, tuple(body['axes']), rules, body.get('description', ''))
    )
  return tuple(out)


def rules_text(rules: Sequence[tuple[str, Any]]) -> str:
  """Rules as Python source, to paste into a training script."""
  return '[' + ', '.join(f'({n!r}, {t!r})' for n, t in rules) + ']'
