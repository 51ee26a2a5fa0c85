"""A step's arguments by name, split into those that carry annotations.

``fit``, ``why`` and plans of a step name an argument's leaves by the step's
parameter names (``state/params/w``, ``batch``); only arguments with
annotations have a layout to plan, the others (a batch, a PRNG key) are laid
out by the step's ``in_shardings``. The command line plans a factory's step
this way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flax_shardmeta import _annotation as ann_lib
from flax_shardmeta._paths import argument_names


def step_arguments(
  step: Any, args: Sequence[Any]
) -> tuple[dict[str, Any], tuple[str, ...]]:
  """``(annotated, others)``: the arguments of ``step`` holding at least one
  annotated leaf, by parameter name, and the names of the rest.

  Pass ``annotated`` to :func:`flax_shardmeta.plan`: its paths then begin
  with the names ``fsm.fit`` gives the same leaves.

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> w = fsm.LogicalPartitioned(jax.ShapeDtypeStruct((8, 4), jnp.float32),
    ...                            ('embed', 'mlp'))
    >>> batch = jax.ShapeDtypeStruct((2, 8), jnp.float32)
    >>> annotated, others = fsm.step_arguments(lambda params, x: x,
    ...                                        [{'w': w}, batch])
    >>> list(annotated), others
    (['params'], ('x',))
  """
  names = argument_names(step, len(args))

  def annotated(arg: Any) -> bool:
    return any(lf.annotation is not None for lf in ann_lib.walk(arg)[0])

  chosen = {n: a for n, a in zip(names, args) if annotated(a)}
  return chosen, tuple(n for n in names if n not in chosen)
