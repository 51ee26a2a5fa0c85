"""A step's arguments as the audit traces them: arrays (abstract or not) and
Python numbers are traced, as ``jax.jit`` traces them; anything else (a
string, a config object, a function) is passed through as it is, fixed for
the trace, as ``jax.jit``'s ``static_argnums`` would pass it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from flax_shardmeta._errors import FlaxShardmetaError, ShardingError, ShardingProblem
from flax_shardmeta._paths import path_str
from flax_shardmeta._specs import format_spec, mesh_axes_of, spec_entries


class AuditInputError(FlaxShardmetaError):
  """``audit_explicit`` given what it cannot audit: a step that is not
  callable, or keyword arguments for the step.

  Example:
    >>> import flax_shardmeta as fsm
    >>> fsm.audit_explicit(None)
    Traceback (most recent call last):
    ...
    flax_shardmeta._audit.arguments.AuditInputError: audit_explicit(step, ...): ...
  """


def check_step(step: Any, keywords: dict[str, Any]) -> None:
  """Raises :class:`AuditInputError` for a step that cannot be called, or
  keyword arguments meant for it (the audit passes positional ones only)."""
  if not callable(step):
    raise AuditInputError(
      f'audit_explicit(step, ...): step={_short(step)} ({type(step).__name__}) '
      'is not callable: pass the training step (a plain function, jax.jit or '
      'fsm.jit), then its arguments: fsm.audit_explicit(step, *args)'
    )
  if keywords:
    names = ', '.join(f'{k}=' for k in keywords)
    raise AuditInputError(
      f'audit_explicit got keyword arguments {names} for the step: it passes '
      'the step positional arguments only (and takes mesh= and rules= '
      'itself). Pass arrays positionally, or bind the others first: '
      'fsm.audit_explicit(functools.partial(step, name=value), *args)'
    )


def _short(x: Any) -> str:
  text = repr(x)
  return text if len(text) <= 60 else text[:57] + '...'


@dataclasses.dataclass(frozen=True)
class Arguments:
  """A step's arguments split into traced leaves and leaves passed through.

  Attributes:
    leaves: every leaf of the positional arguments, in order.
    treedef: their structure (a tuple of the arguments).
    traced: the indices of the leaves jax traces.
  """

  leaves: tuple[Any, ...]
  treedef: Any
  traced: tuple[int, ...]

  @classmethod
  def of(cls, args: Sequence[Any], static: frozenset[int] = frozenset()) -> Arguments:
    """Splits ``args``; the positional arguments ``static`` (a jitted step's
    ``static_argnums``) are passed through whole."""
    leaves, traced = [], []
    for n, arg in enumerate(args):
      for x in jax.tree.leaves(arg):
        if n not in static and is_traced(x):
          traced.append(len(leaves))
        leaves.append(x)
    treedef = jax.tree.structure(tuple(args))
    return cls(tuple(leaves), treedef, tuple(traced))

  def values(self) -> list[Any]:
    """The traced leaves."""
    return [self.leaves[i] for i in self.traced]

  def closed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a function of the traced leaves only (the rest fixed)."""

    def call(*values: Any) -> Any:
      full = list(self.leaves)
      for i, v in zip(self.traced, values):
        full[i] = v
      return fn(*self.treedef.unflatten(full))

    return call

  def structs(self, mesh: Any, specs: Sequence[PartitionSpec]) -> list[Any]:
    """The traced leaves as abstract values laid out by ``specs`` on ``mesh``."""
    return [struct(x, NamedSharding(mesh, s)) for x, s in zip(self.values(), specs)]

  def given_specs(self, compiled: Sequence[PartitionSpec]) -> list[PartitionSpec]:
    """Each traced leaf's own layout where it has one, else XLA's choice
    (``compiled``): an argument the step never reads keeps the layout the
    user gave it, not the replicated one XLA reports for it."""
    out = []
    for x, chosen in zip(self.values(), compiled):
      sharding = getattr(x, 'sharding', None)
      out.append(sharding.spec if isinstance(sharding, NamedSharding) else chosen)
    return out

  def traced_of(self, args: Sequence[Any]) -> list[Any]:
    """The traced leaves of another call's ``args`` (same structure)."""
    leaves = jax.tree.leaves(tuple(args))
    return [leaves[i] for i in self.traced]


def is_traced(x: Any) -> bool:
  """Whether ``jax.jit`` traces ``x``: an array, abstract or not, or a number."""
  if hasattr(x, 'shape') and hasattr(x, 'dtype'):
    return True
  return isinstance(x, (bool, int, float, complex, np.generic))


def struct(x: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
  """``x``'s abstract value (a Python number's weak type kept) on ``sharding``."""
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  return jax.ShapeDtypeStruct(
    tuple(aval.shape),
    aval.dtype,
    sharding=sharding,
    weak_type=bool(getattr(aval, 'weak_type', False)),
  )


def check_divisible(
  args: Sequence[Any], sizes: dict[str, int], given: Any = None
) -> None:
  """Raises a ``ShardingError`` naming each argument whose sharding (its own,
  else the jitted step's ``in_shardings``, ``given``) does not divide its
  shape, or names an axis the mesh lacks: jax would raise later, naming no
  argument."""
  problems = []
  for path, x, sharding in _with_shardings(args, given):
    if not isinstance(sharding, NamedSharding) or not hasattr(x, 'shape'):
      continue
    for dim, entry in enumerate(spec_entries(sharding.spec)):
      unknown = [a for a in mesh_axes_of(entry) if a not in sizes]
      if unknown:
        problems.append(ShardingProblem(
          path_str(path), tuple(x.shape), None, sharding.spec,
          f'mesh axis {unknown[0]!r} (dimension {dim}) is not in the mesh '
          f'({", ".join(f"{a}={n}" for a, n in sizes.items())})',
          'give mesh= the mesh the arguments are laid out on, or lay them out '
          'on this one', (dim,),
        ))  # fmt: skip
        continue
      ways = int(np.prod([sizes.get(a, 1) for a in mesh_axes_of(entry)]))
      if dim < len(x.shape) and ways > 1 and x.shape[dim] % ways:
        size = x.shape[dim]
        problems.append(ShardingProblem(
          path_str(path), tuple(x.shape), None, sharding.spec,
          f'dimension {dim} of size {size} is not divisible by '
          f'{format_spec(PartitionSpec(entry))[2:-1]} ({ways} ways)',
          f'make the size a multiple of {ways} (e.g. {size + (-size) % ways}), '
          'or lay that dimension out over fewer devices',
          (dim,),
        ))  # fmt: skip
  if problems:
    raise ShardingError(problems, ' for audit_explicit (a step argument)')


def _with_shardings(args: Sequence[Any], given: Any) -> list[tuple[Any, Any, Any]]:
  """``(path, leaf, sharding)`` of every leaf; a leaf's own sharding first."""
  out = []
  given = tuple(given) if isinstance(given, (tuple, list)) else ()
  for n, arg in enumerate(args):
    flat = jax.tree_util.tree_flatten_with_path(arg)[0]
    of_arg = given[n] if n < len(given) else None
    shardings = jax.tree.leaves(of_arg)
    if isinstance(of_arg, NamedSharding):
      shardings = [of_arg] * len(flat)
    if len(shardings) != len(flat):
      shardings = [None] * len(flat)  # not matched leaf by leaf: not checked
    for (path, x), s in zip(flat, shardings):
      own = getattr(x, 'sharding', None)
      out.append(((jax.tree_util.SequenceKey(n), *path), x, own or s))
  return out
