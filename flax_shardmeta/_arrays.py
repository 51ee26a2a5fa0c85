"""Bytes of abstract arrays per device, PRNG key arrays and sub-byte types included.

``np.dtype(dtype).itemsize`` fails on jax's extended dtypes (a key array's
``key<fry>``) and says 1 for ``int4``, which XLA packs two to a byte; every
byte count of the capacity layer goes through :func:`array_bytes` instead.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_key(dtype: Any) -> bool:
  """Whether ``dtype`` is a PRNG key dtype (``jax.random.key``'s ``key<fry>``).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> is_key(jax.random.key(0).dtype), is_key(jnp.uint32)
    (True, False)
  """
  try:
    return bool(jnp.issubdtype(dtype, jax.dtypes.prng_key))
  except TypeError:  # not a dtype jax knows
    return False


@functools.lru_cache(maxsize=64)
def _key_bits(dtype: Any) -> int:
  """Bits of one key: the shape and dtype of its data (two uint32 for threefry)."""
  data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))
  return math.prod(data.shape) * jax.dtypes.itemsize_bits(data.dtype)


def element_bits(dtype: Any) -> int:
  """Bits one element of ``dtype`` takes in device memory.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> element_bits(jnp.bfloat16), element_bits(jnp.int4)
    (16, 4)
    >>> element_bits(jax.random.key(0).dtype)  # threefry: two uint32
    64
  """
  if is_key(dtype):
    return _key_bits(dtype)
  return int(jax.dtypes.itemsize_bits(np.dtype(dtype)))


def array_bytes(shape: tuple[int, ...], dtype: Any) -> int:
  """Bytes of an array of ``shape`` and ``dtype`` (sub-byte types packed).

  Example:
    >>> import jax.numpy as jnp
    >>> array_bytes((3, 5), jnp.int4), array_bytes((2, 2), jnp.float32)
    (8, 16)
  """
  return -(-math.prod(shape) * element_bits(dtype) // 8)


def shard_bytes(shape: tuple[int, ...], dtype: Any, sharding: Any) -> int:
  """Bytes one device holds of an array laid out by ``sharding``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((8,), ('data',))
    >>> sharding = jax.NamedSharding(mesh, jax.P('data'))
    >>> shard_bytes((64, 4), jnp.float32, sharding)
    128
  """
  return array_bytes(tuple(sharding.shard_shape(tuple(shape))), dtype)
