"""Rule presets: named layouts over named mesh axes, for ``fsm.suggest``.

Each preset says which mesh axes it uses and how the logical names of a
transformer (``batch``, ``embed``, ``vocab``, ``heads``, ``kv_heads``,
``mlp``, or ``hidden`` as the Flax MLP names it, ``expert`` for the experts of
a mixture-of-experts layer, as T5X and ``examples.moe`` name them;
everything else replicated) map onto them:

========== ====================== ==============================================
preset     mesh axes              rules
========== ====================== ==============================================
fsdp       data, fsdp             batch over (data, fsdp); embed over fsdp
fsdp+tp    data, fsdp, model      as fsdp, and heads, kv_heads, mlp, hidden,
                                  vocab over model
tp         data, model            batch over data; heads, kv_heads, mlp,
                                  hidden, vocab over model
t5x-1d     data, model            T5X's rules, model parallelism in 1-D
                                  (``standard_logical_axis_rules(1, 1)``)
t5x-2d     data, model            T5X's 2-D parameter partitioning: embed over
                                  data as well (``(1, 2)``)
ep         data, expert           expert over expert; batch over (data,
                                  expert), batch_no_exp (the routed tokens')
                                  over data (mixture-of-experts models)
ep+tp      data, expert, model    as ep, and heads, kv_heads, mlp, hidden,
                                  vocab over model (model inside a host)
ep+fsdp    data, fsdp, expert     expert over expert; embed over (fsdp,
                                  expert), else over fsdp: the expert axis
                                  shared with FSDP, as MaxText lays out its
                                  MoE models; batch over (data, fsdp, expert),
                                  batch_no_exp over (data, fsdp)
========== ====================== ==============================================

``DEFAULT_PRESETS`` (fsdp, fsdp+tp, tp) are for dense models; ask for ``ep``,
``ep+tp`` and ``ep+fsdp`` by name. ``fsm.suggest`` skips a preset none of whose logical
names (``batch`` aside) the model uses, with a warning: its layout would be
plain data parallelism under another name.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from flax_shardmeta import _annotation as ann_lib
from flax_shardmeta._axis_typos import misspelt_axis
from flax_shardmeta._errors import InvalidRulesError
from flax_shardmeta._rules import normalize_rules, rules_from_lists
from flax_shardmeta._standard_rules import standard_logical_axis_rules

_TP = (
  ('heads', 'model'),
  ('kv_heads', 'model'),
  ('mlp', 'model'),
  ('hidden', 'model'),
  ('vocab', 'model'),
)
# 'hidden' is the MLP dimension of the Flax scale-up notebook's layer
# (examples.linen.DotReluDot); a model names it 'mlp' or 'hidden', not both.

_EP = ('expert', 'expert')
_BATCH_NO_EXP = ('batch_no_exp', 'data')
# The batch of the tokens routed to the experts: over data alone, the expert
# axis being the experts' (MaxText's activation_batch_no_exp).
# T5X's mixture-of-experts name for the experts' dimension, and examples.moe's.


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
    typo = misspelt_axis(self.axes, self.rules)
    if typo is not None:
      raise InvalidRulesError(
        f'preset {self.name!r} shards over mesh axis {typo[0]!r}, which is not '
        f'among its axes {self.axes}: did you mean {typo[1]!r}?'
      )
    used = {a for _, target in self.rules for a in _axes(target)}
    unknown = sorted(used - set(self.axes))
    if unknown:
      raise InvalidRulesError(
        f'rule preset {self.name!r}: its rules use mesh axes {unknown} that are not '
        f'among its axes {self.axes}; add them to axes or change the rules.'
      )

  @staticmethod
  def load(text: str, source: str = '<presets>') -> tuple[RulePreset, ...]:
    """Presets from a presets file's text, TOML or JSON (see :func:`load`);
    ``source`` names it in errors.

    Example:
      >>> import flax_shardmeta as fsm
      >>> (p,) = fsm.RulePreset.load(
      ...     '[presets.dp]\\naxes = ["data"]\\nrules = [["batch", "data"]]')
      >>> p.name, p.rules
      ('dp', (('batch', 'data'),))
    """
    return load(text, source)


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
      (('batch', ('data', 'expert')), _BATCH_NO_EXP, _EP),
      'experts over expert (mixture-of-experts models)',
    ),
    RulePreset(
      'ep+tp',
      ('data', 'expert', 'model'),
      (('batch', ('data', 'expert')), _BATCH_NO_EXP, _EP, *_TP),
      'ep, and heads / mlp / vocab over model',
    ),
    RulePreset(
      'ep+fsdp',
      ('data', 'fsdp', 'expert'),
      (
        ('batch', ('data', 'fsdp', 'expert')),
        ('batch_no_exp', ('data', 'fsdp')),
        # The experts take their axis first (rules apply in order); every
        # other parameter's embed is sharded over it as over fsdp.
        _EP,
        ('embed', ('fsdp', 'expert')),
        ('embed', 'fsdp'),
      ),
      "experts over expert; the rest FSDP over fsdp and expert (MaxText's MoE)",
    ),
  )
}
"""The built-in presets, by name (see the module doc)."""

DEFAULT_PRESETS = ('fsdp', 'fsdp+tp', 'tp')
"""What ``suggest`` tries unless told otherwise (dense models; the
mixture-of-experts presets ``ep``, ``ep+tp`` and ``ep+fsdp`` are asked for by
name)."""


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
    rules = rules_from_lists(body['rules'], f'preset {name!r} in {source}')
    out.append(
      RulePreset(name, tuple(body['axes']), rules, body.get('description', ''))
    )
  return tuple(out)


def rules_text(rules: Sequence[tuple[str, Any]]) -> str:
  """Rules as Python source, to paste into a training script."""
  return '[' + ', '.join(f'({n!r}, {t!r})' for n, t in rules) + ']'


# Which presets a model's names reach
# ------------------------------------------------------------------------------


def model_names(args: Sequence[Any]) -> set[str]:
  """The logical names the annotated leaves of ``args`` carry (a step's
  abstract arguments; leaves annotated with mesh axes, or not at all, add
  none).

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> w = jax.ShapeDtypeStruct((8, 4), jnp.float32)
    >>> sorted(model_names([{'w': fsm.LogicalPartitioned(w, ('embed', 'mlp'))}]))
    ['embed', 'mlp']
  """
  names: set[str] = set()
  for arg in args:
    leaves, _ = ann_lib.walk(arg)
    for leaf in leaves:
      ann = leaf.annotation
      if ann is None or not ann.logical:
        continue
      for name in ann.names:
        names.update(n for n in _flat(name) if isinstance(n, str))
  return names


def _flat(name: Any) -> tuple[Any, ...]:
  return tuple(name) if isinstance(name, (tuple, list)) else (name,)


def unused_presets(presets: Sequence[RulePreset], names: set[str]) -> dict[str, str]:
  """Presets none of whose sharding names (``batch`` aside) the model uses,
  by name, each with why; each is warned about. Nothing is skipped when the
  model's parameters carry no logical names (then nothing can be told).

  Example:
    >>> import warnings
    >>> with warnings.catch_warnings(record=True):
    ...   warnings.simplefilter('always')
    ...   unused = unused_presets([RULE_PRESETS['ep']], {'embed', 'mlp'})
    >>> list(unused)
    ['ep']
  """
  own = names - {'batch'}
  if not own:
    return {}
  unused = {}
  for p in presets:
    mapped = sorted({n for n, target in p.rules if target is not None and n != 'batch'})
    if not mapped or own & set(mapped):
      continue
    hints = []
    for n in mapped:
      close = difflib.get_close_matches(n, sorted(own), n=1)
      if close:
        hints.append(f'{n!r} -> did you mean {close[0]!r}?')
    hint = f' ({"; ".join(hints)})' if hints else ''
    why = (
      f'rule preset {p.name!r} shards logical names {mapped}, none of which '
      f"the model's arguments carry (their names: {sorted(own)}){hint}; "
      'under it every parameter would be replicated, plain data parallelism, '
      f'so it is skipped. Rename the rules of {p.name!r} (fsm.RulePreset) or '
      "the model's annotations to match."
    )
    warnings.warn(why, UserWarning, stacklevel=3)
    unused[p.name] = why
  return unused
