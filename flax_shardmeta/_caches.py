"""One switch for the caches flax_shardmeta keeps; a pause of the collector.

Resolution, validation, layouts and ``NamedSharding`` objects are memoized per
distinct (names, rules, shape, mesh), and eager per-shard generators keep
their compiled programs, because models repeat a few patterns thousands of
times. Those caches hold meshes and compiled programs alive; a long-running
process that goes through many meshes clears them here.

Walking a tree of 200,000 leaves allocates a few objects per leaf; Python's
cyclic garbage collector then runs again and again, each full pass over the
whole heap (the user's tree included), which made a plan's time grow faster
than its size. :func:`paused_gc` keeps it off while a tree is walked.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
  """The cyclic garbage collector off inside, back as it was afterwards.

  Walks create no reference cycles that must be freed before they end;
  anything left is collected by the next pass after.

  Example:
    >>> import gc
    >>> with paused_gc():
    ...   gc.isenabled()
    False
    >>> gc.isenabled()
    True
  """
  enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if enabled:
      gc.enable()


def clear_caches() -> None:
  """Empties every cache flax_shardmeta keeps (not jax's own).

  Results stay the same afterwards, only slower the first time. To also drop
  jax's compiled programs, call ``jax.clear_caches()``.

  Example:
    >>> import flax_shardmeta as fsm
    >>> fsm.logical_to_mesh_axes(('mlp',), [('mlp', 'model')])
    P('model',)
    >>> fsm.clear_caches()
  """
  for name, module in list(sys.modules.items()):
    if module is None or not name.startswith('flax_shardmeta'):
      continue
    for obj in list(vars(module).values()):
      clear = getattr(obj, 'cache_clear', None)
      # Only this package's caches: modules import jax's cached functions too.
      if callable(clear) and getattr(obj, '__module__', '') == name:
        clear()
