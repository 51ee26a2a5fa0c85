"""Checking arrays against a plan: ``verify`` and ``actual_shardings``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jax.sharding import Sharding

from flax_shardmeta import _annotation as ann_lib
from flax_shardmeta._planning.sharding_plan import ShardingPlan
from flax_shardmeta._sharding import named_sharding
from flax_shardmeta._specs import format_spec, spec_sets
from flax_shardmeta._typing import PyTree


@dataclasses.dataclass(frozen=True)
class Mismatch:
  """An array whose actual sharding differs from its planned one.

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> mesh = jax.make_mesh((2, 4), ('data', 'model'))
    >>> x = jax.device_put(jnp.zeros(8), jax.NamedSharding(mesh, jax.P()))
    >>> (m,) = fsm.verify({'w': x}, {'w': jax.NamedSharding(mesh, jax.P('model'))})
    >>> m.path, m.shape, str(m)
    ('w', (8,), "w: planned P('model'), found P()")
  """

  path: str
  expected: Sharding | None
  actual: Sharding | None
  shape: tuple[int, ...] | None = None

  def __str__(self) -> str:
    return (
      f'{self.path}: planned {_spec_of(self.expected)}, found {_spec_of(self.actual)}'
    )


class Mismatches(list):
  """What :func:`verify` returns: a list of :class:`Mismatch`, printed as a table.

  Compares, iterates and indexes like the list it is; ``str`` (and so
  ``print``) renders the differences as a table like a plan's.

  Attributes:
    checked: how many arrays were compared.

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> mesh = jax.make_mesh((2, 4), ('data', 'model'))
    >>> x = jax.device_put(jnp.zeros(8), jax.NamedSharding(mesh, jax.P('model')))
    >>> found = fsm.verify({'w': x}, {'w': jax.NamedSharding(mesh, jax.P('model'))})
    >>> found == [], found.checked
    (True, 1)
  """

  def __init__(self, mismatches: Sequence[Mismatch] = (), checked: int = 0):
    super().__init__(mismatches)
    self.checked = checked

  def __str__(self) -> str:
    return format_mismatches(self, self.checked)


def verify(arrays: PyTree, plan_or_shardings: ShardingPlan | PyTree) -> Mismatches:
  """The arrays whose actual sharding differs from the planned one.

  Args:
    arrays: the concrete tree (boxes, TrainState, NNX State...).
    plan_or_shardings: a :class:`ShardingPlan`, or a tree of shardings such
      as :func:`flax_shardmeta.get_sharding` returns.

  Returns:
    One :class:`Mismatch` per differing array, with its path; empty when all
    match. Shardings are compared with ``Sharding.is_equivalent_to``.
    ``print`` shows the differences as a table (path, shape, planned spec,
    actual spec).

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> mesh = jax.make_mesh((8,), ('data',))
    >>> x = {'w': jax.device_put(jnp.zeros((8, 2)), jax.NamedSharding(mesh, jax.P()))}
    >>> fsm.verify(x, fsm.plan(x, mesh))
    []
    >>> print(fsm.verify(x, {'w': jax.NamedSharding(mesh, jax.P('data'))}))
    1 of 1 arrays differ from the plan:
    array  shape  planned    actual
    -------------------------------
    w      8x2    P('data')  P()
  """
  if isinstance(plan_or_shardings, ShardingPlan):
    p = plan_or_shardings
    expected = {
      e.path: named_sharding(p.mesh, e.spec) for e in p.entries if e.spec is not None
    }
  else:
    sh_leaves, _ = ann_lib.walk(plan_or_shardings, every_path=True)
    expected = {lf.path: lf.value for lf in sh_leaves if isinstance(lf.value, Sharding)}
  leaves, _ = ann_lib.walk(arrays, every_path=True)
  out: list[Mismatch] = []
  checked = 0
  for lf in leaves:
    shape = getattr(lf.value, 'shape', None)
    if shape is None:
      continue
    checked += 1
    want = expected.get(lf.path)
    have = getattr(lf.value, 'sharding', None)
    if want is None or have is None or not _same(have, want, len(shape)):
      out.append(Mismatch(lf.path, want, have, tuple(shape)))
  return Mismatches(out, checked)


def _same(have: Sharding, want: Sharding, rank: int) -> bool:
  # is_equivalent_to compares device layouts, where unreduced / reduced axes
  # do not show; the plan holds them, so they are compared too.
  sets = (spec_sets(getattr(s, 'spec', None)) for s in (have, want))
  return have.is_equivalent_to(want, rank) and next(sets) == next(sets)


def actual_shardings(tree: PyTree) -> PyTree:
  """Each array's actual sharding, read back from the arrays themselves.

  The inverse of :func:`flax_shardmeta.get_sharding`: where that computes the
  layouts annotations ask for, this reads the layouts arrays have (usually a
  ``NamedSharding``; its ``.spec`` is the PartitionSpec). Host values (NumPy
  arrays, Python scalars) and non-array leaves give None. Boxes and NNX
  Variables are read through, and the result has the structure
  ``get_sharding`` would give, so the two compare leaf by leaf.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, flax_shardmeta as fsm
    >>> mesh = jax.make_mesh((8,), ('data',))
    >>> x = jax.device_put(jnp.zeros((8, 2)), jax.NamedSharding(mesh, jax.P('data')))
    >>> out = fsm.actual_shardings({'x': x, 'host': np.zeros(3), 'step': 1})
    >>> out['x'].spec, out['host'], out['step']
    (P('data',), None, None)
  """
  leaves, build = ann_lib.walk(tree)
  return build([_sharding_of(lf.value) for lf in leaves])


def _sharding_of(value: Any) -> Sharding | None:
  sharding = getattr(value, 'sharding', None)
  return sharding if isinstance(sharding, Sharding) else None


def _spec_text(sharding: Any) -> str:
  if sharding is None:
    return '-'
  spec = getattr(sharding, 'spec', None)
  return format_spec(spec) if spec is not None else type(sharding).__name__


def format_mismatches(mismatches: list[Mismatch], checked: int) -> str:
  """:func:`verify`'s result as a table: path, shape, planned and actual spec.

  ``-`` marks a sharding that is missing (an array the plan does not know,
  or a value without one).
  """
  if not mismatches:
    return f'all {checked} arrays match the plan'
  header = ('array', 'shape', 'planned', 'actual')
  rows = [header] + [
    (
      m.path,
      'x'.join(map(str, m.shape)) or 'scalar' if m.shape is not None else '?',
      _spec_text(m.expected),
      _spec_text(m.actual),
    )
    for m in mismatches
  ]
  widths = [max(len(r[i]) for r in rows) for i in range(len(header))]

  def line(r: tuple[str, ...]) -> str:
    return '  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip()

  lines = [
    f'{len(mismatches)} of {checked} arrays differ from the plan:',
    line(header),
    '-' * len(line(header)),
  ]
  lines += [line(r) for r in rows[1:]]
  return '\n'.join(lines)


def _spec_of(s: Sharding | None) -> str:
  if s is None:
    return 'no sharding'
  spec = getattr(s, 'spec', None)
  return format_spec(spec) if spec is not None else repr(s)
