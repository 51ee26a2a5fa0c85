"""Whether a saved leaf can become its target leaf: its shape, and which
casts a restore may make on its own (those that keep every value).

A target dtype other than the saved one makes orbax cast while it reads. A
cast that keeps every value (``bfloat16`` to ``float32``, ``int8`` to
``int32``) is a note; one that can lose values (float to int, a narrower
type, a range the target does not cover, complex to real) needs the user's
``allow_cast=True``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from flax_shardmeta._sharding import leaf_shape

# A cast's reason (a note); a cast that can lose values is a problem unless
# allow_cast=True makes it a note.
CAST = 'saved as '
LOSSY = 'a cast that can lose values: saved as '


def keeps_values(saved: Any, target: Any) -> bool:
  """Whether every value of dtype ``saved`` is exactly one of ``target``.

  Example:
    >>> import jax.numpy as jnp
    >>> keeps_values(jnp.bfloat16, jnp.float32), keeps_values(jnp.float32, jnp.int8)
    (True, False)
    >>> keeps_values(jnp.uint8, jnp.int16), keeps_values(jnp.int8, jnp.uint8)
    (True, False)
  """
  src, dst = np.dtype(saved), np.dtype(target)
  if src == dst or src == np.bool_:
    return True
  if dst == np.bool_:
    return False
  if jnp.issubdtype(src, jnp.complexfloating):
    return jnp.issubdtype(dst, jnp.complexfloating) and _float_in(src, dst)
  if jnp.issubdtype(src, jnp.floating):
    return jnp.issubdtype(dst, jnp.inexact) and _float_in(src, dst)
  if not jnp.issubdtype(src, jnp.integer):
    return False  # an unknown kind: ask rather than guess
  low, high = int(jnp.iinfo(src).min), int(jnp.iinfo(src).max)
  if jnp.issubdtype(dst, jnp.integer):
    return jnp.iinfo(dst).min <= low and high <= jnp.iinfo(dst).max
  if jnp.issubdtype(dst, jnp.inexact):
    # Every integer up to 2**(mantissa bits + 1) is exact in a float.
    bits = max(high.bit_length(), (-low - 1).bit_length())
    return bits <= jnp.finfo(dst).nmant + 1 and bits < jnp.finfo(dst).maxexp
  return False


def _float_in(src: np.dtype, dst: np.dtype) -> bool:
  """Whether float (or complex) ``src``'s values are all ``dst``'s: as many
  mantissa bits, as large and as small numbers (subnormals included)."""
  a, b = jnp.finfo(src), jnp.finfo(dst)
  return (
    b.nmant >= a.nmant
    and b.maxexp >= a.maxexp
    and b.minexp - b.nmant <= a.minexp - a.nmant
  )


def saved_as_target(
  old: Any,
  shape: tuple[int, ...],
  dtype: Any,
  allow_cast: bool,
  add: Callable[[str, str], None],
) -> bool:
  """Whether the saved leaf ``old`` can be restored as ``shape``; its problems
  ``add``ed as (reason, hint): missing, another shape, a cast (a problem when
  it can lose values, unless ``allow_cast``)."""
  if old is None:
    add('not in the checkpoint', 'save it, or drop it from the target')
    return False
  if leaf_shape(old) != shape:
    add(f'saved with shape {leaf_shape(old)}', 'restore into the saved shape')
    return False
  if old.dtype == dtype:
    return True
  if keeps_values(old.dtype, dtype):
    add(f'{CAST}{old.dtype}, restored as {dtype}', 'check the cast is meant')
  elif allow_cast:
    add(
      f'{CAST}{old.dtype}, restored as {dtype}, a cast that can lose values '
      '(allow_cast=True)',
      'check the cast is meant',
    )
  else:
    add(
      f'{LOSSY}{old.dtype}, restored as {dtype}',
      f'restore it as {old.dtype}, or pass allow_cast=True to fsm.restore '
      '(restore-plan --allow-cast) if the cast is meant',
    )
  return True
