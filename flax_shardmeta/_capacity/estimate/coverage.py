"""What in a step lies outside the models the estimate's error was measured on.

The band an estimate's verdict uses (``estimator.ERROR_BANDS``) is the error
measured in BENCHMARKS.md over a fixed set of training steps: Auto mesh axes,
layers scanned or unrolled, remat none or full, dense and mixture-of-experts
models, everything in device memory. A step that uses what none of them
does may land outside that band, so the estimate names each such feature
rather than claim the band for it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from flax_shardmeta._programs.jaxprs import sub_jaxprs

# Primitives none of the measured steps contains, and what to call them.
_UNMEASURED = {
  'shard_map': 'shard_map (per-device code)',
  'while': 'a while loop (fori_loop / while_loop)',
  'pallas_call': 'a Pallas kernel',
  'custom_call': 'a custom call',
}


def _primitives(jaxpr: Any) -> Iterator[str]:
  for eqn in jaxpr.eqns:
    yield eqn.primitive.name
    for inner, _ in sub_jaxprs(eqn):
      yield from _primitives(inner)


def unmeasured(jaxpr: Any, mesh: Any, on_host: Sequence[bool]) -> tuple[str, ...]:
  """What in the traced step (``jaxpr``), its mesh and its arguments (which
  are in host memory) the band was not measured on; empty when nothing.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AbstractMesh, AxisType
    >>> mesh = AbstractMesh((2,), ('data',), axis_types=(AxisType.Explicit,))
    >>> loop = lambda x: jax.lax.fori_loop(0, jnp.int32(x.sum()), lambda i, c: c, x)
    >>> jaxpr = jax.make_jaxpr(loop)(jnp.ones(4)).jaxpr
    >>> unmeasured(jaxpr, mesh, [True])  # doctest: +NORMALIZE_WHITESPACE
    ('Explicit mesh axes (measured under Auto axes)',
     'a while loop (fori_loop / while_loop)',
     'arguments in host memory')
  """
  found = []
  types = {str(t).split('.')[-1] for t in getattr(mesh, 'axis_types', ())}
  if types - {'Auto'}:
    found.append(
      f'{"/".join(sorted(types - {"Auto"}))} mesh axes (measured under Auto axes)'
    )
  seen = set(_primitives(jaxpr))
  found += [said for name, said in _UNMEASURED.items() if name in seen]
  if any(on_host):
    found.append('arguments in host memory')
  return tuple(found)
