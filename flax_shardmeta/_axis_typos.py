"""A mesh axis misspelt in the mesh or in the rules, said once.

When the rules shard over a mesh axis the mesh lacks, and the mesh has an
axis spelled like it that no rule uses (``'modle'`` for ``'model'``), the
cause is one typo, not a problem per array: every such problem's fix says
"did you mean". The command line checks its ``--mesh`` with the same
function before anything is built.

Nothing here imports jax.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable, Sequence
from typing import Any

from flax_shardmeta._problem import ShardingProblem


def _rule_axes(target: Any) -> tuple[str, ...]:
  if isinstance(target, str):
    return (target,)
  if not isinstance(target, (tuple, list)):
    return ()
  return tuple(a for a in target if isinstance(a, str))


def misspelt_axis(
  axes: Sequence[str], rules: Iterable[Sequence[Any]]
) -> tuple[str, str] | None:
  """``(in_rules, in_axes)``: a mesh axis the rules shard over that ``axes``
  lacks, spelled like one of ``axes`` that no rule uses; else None.

  ``fsm.plan`` and the others put it in every problem it causes; the command
  line checks its ``--mesh`` with it first, and so can a launcher.

  Example:
    >>> import flax_shardmeta as fsm
    >>> fsm.misspelt_axis(('data', 'modle'), [('batch', 'data'), ('mlp', 'model')])
    ('model', 'modle')
    >>> fsm.misspelt_axis(('data', 'model'), [('mlp', 'model')]) is None
    True
  """
  rules = [
    tuple(r)
    for r in rules
    if isinstance(r, Sequence) and not isinstance(r, str) and len(r) == 2
  ]
  used = {a for _, target in rules for a in _rule_axes(target)}
  unused = [a for a in axes if a not in used]
  for _, target in rules:
    for axis in _rule_axes(target):
      close = difflib.get_close_matches(axis, unused, n=1) if axis not in axes else []
      if close:
        return axis, close[0]
  return None


def typo_hint(in_rules: str, in_mesh: str) -> str:
  """The fix of every problem one misspelt mesh axis causes: the typo may be
  in the rules or in the mesh, so both spellings are named.

  Example:
    >>> print(typo_hint('model', 'modle'))
    the rules shard over mesh axis 'model', which the mesh lacks, and no rule
    uses the mesh's axis 'modle', spelled like it: one is a typo; did you mean
    'model' (name the mesh axis so) or 'modle' (write it in the rules)?
  """
  return (
    f"the rules shard over mesh axis '{in_rules}', which the mesh lacks, and no "
    f"rule uses the mesh's axis '{in_mesh}', spelled like it: one is a typo; "
    f"did you mean '{in_rules}' (name the mesh axis so) or '{in_mesh}' (write it "
    'in the rules)?'
  )


def with_typo_hint(
  problems: Sequence[ShardingProblem],
  axes: Sequence[str],
  rules: Iterable[Sequence[Any]],
) -> list[ShardingProblem]:
  """``problems``, each about a mesh axis the mesh lacks with a "did you
  mean" fix in place of the general one, where a mesh axis is spelled like
  it: the rules' typo (:func:`misspelt_axis`) first, else (an annotation
  naming mesh axes itself) the closest axis of the mesh."""
  axes = tuple(axes)
  typo = misspelt_axis(axes, rules)
  out = []
  for p in problems:
    missing = _MISSING.match(p.reason)
    if missing is None:
      out.append(p)
      continue
    axis = missing.group(1)
    if typo is not None and typo[0] == axis:
      hint = typo_hint(*typo)
    else:
      close = difflib.get_close_matches(axis, axes, n=1)
      hint = (
        f"did you mean the mesh's axis '{close[0]}'? Otherwise: {p.hint}"
        if close
        else ''
      )
    out.append(dataclasses.replace(p, hint=hint) if hint else p)
  return out


# The reason _validate gives a mesh axis the mesh lacks.
_MISSING = re.compile(r"mesh axis '([^']*)' \(dimension \d+\) is not in the mesh")
