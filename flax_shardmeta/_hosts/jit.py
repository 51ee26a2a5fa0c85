"""``fsm.jit``: ``jax.jit`` that carries its mesh and logical axis rules.

A logical constraint inside a jitted function needs the mesh and the rules in
force while the function is traced; a caller who forgets the context gets a
constraint that silently does nothing. ``fsm.jit`` enters both whenever it
traces, lowers or runs, and resolves logical shardings up front.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from flax_shardmeta._rules import (
  get_logical_axis_rules,
  logical_axis_rules,
  logical_to_mesh_axes,
  normalize_rules,
)
from flax_shardmeta._sharding import get_sharding
from flax_shardmeta._typing import AnyMesh, LogicalRules


class JitWithContext:
  """A jitted function that runs, traces and lowers inside its mesh and rules.

  Made by :func:`flax_shardmeta.jit`; call it like the function. ``lower`` and
  ``eval_shape`` take the same arguments.

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> mesh = jax.make_mesh((2, 4), ('data', 'model'))
    >>> double = fsm.jit(lambda x: 2 * x, mesh=mesh, out_shardings=('batch',),
    ...                  rules=[('batch', 'data')])
    >>> double.lower(jnp.ones(8)).compile().output_shardings.spec
    P('data',)
  """

  def __init__(
    self,
    fn: Callable[..., Any],
    mesh: AnyMesh,
    rules: tuple[tuple[str, Any], ...],
    jitted: Any,
    in_shardings: Any = None,
    out_shardings: Any = None,
  ):
    self.mesh, self.rules, self._jitted = mesh, rules, jitted
    # The resolved NamedSharding trees (None: left to the compiler), read by
    # fsm.fit to know which arguments already have a layout.
    self.in_shardings, self.out_shardings = in_shardings, out_shardings
    functools.update_wrapper(self, fn)

  @contextlib.contextmanager
  def context(self) -> Iterator[None]:
    """The mesh and rule context the function is traced and run in."""
    with _mesh_context(self.mesh), logical_axis_rules(self.rules):
      yield

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    with self.context():
      return self._jitted(*args, **kwargs)

  def lower(self, *args: Any, **kwargs: Any) -> Any:
    """``jax.stages.Lowered`` for these arguments (traced in the context)."""
    with self.context():
      return self._jitted.lower(*args, **kwargs)

  def trace(self, *args: Any, **kwargs: Any) -> Any:
    """``jax.stages.Traced`` for these arguments (traced in the context)."""
    with self.context():
      return self._jitted.trace(*args, **kwargs)

  def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
    """Output shapes, dtypes and shardings, without running anything."""
    with self.context():
      return self._jitted.eval_shape(*args, **kwargs)


def jit(
  fn: Callable[..., Any],
  *,
  mesh: AnyMesh,
  rules: LogicalRules | None = None,
  in_shardings: Any = None,
  out_shardings: Any = None,
  static_argnums: int | Sequence[int] = (),
  donate_argnums: int | Sequence[int] = (),
) -> JitWithContext:
  """``jax.jit`` that enters ``mesh`` and the logical rules whenever it traces,
  lowers or runs ``fn``.

  Shardings may be given as ``NamedSharding``, as ``PartitionSpec`` (mesh
  axes), as tuples of logical names (resolved through the rules), or as an
  annotated abstract tree (``jax.eval_shape`` output, resolved by
  :func:`get_sharding`); ``None`` leaves are left to the compiler.

  Args:
    fn: the function to compile.
    mesh: the mesh it runs on; an ``AbstractMesh`` (e.g. a pod planned from
      a laptop) gives a function that traces and lowers abstractly, for
      :func:`flax_shardmeta.fit`, but cannot run.
    rules: logical axis rules; None takes the context rules at the time
      ``jit`` is called, and keeps them.
    in_shardings: shardings of the arguments (see above), as for ``jax.jit``.
    out_shardings: shardings of the outputs.
    static_argnums: as for ``jax.jit``.
    donate_argnums: as for ``jax.jit``.

  Returns:
    A :class:`JitWithContext`, called like ``fn``.

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> mesh = jax.make_mesh((2, 4), ('data', 'model'))
    >>> def f(x):
    ...   return fsm.with_logical_constraint(x * 2, ('batch', 'embed'))
    >>> g = fsm.jit(f, mesh=mesh, rules=[('batch', 'data'), ('embed', 'model')],
    ...             out_shardings=('batch', 'embed'))
    >>> g(jnp.ones((8, 4))).sharding.spec
    P('data', 'model')
  """
  rules_t = normalize_rules(rules) if rules is not None else get_logical_axis_rules()
  with _mesh_context(mesh), logical_axis_rules(rules_t):
    ins = _resolve(in_shardings, mesh, rules_t)
    outs = _resolve(out_shardings, mesh, rules_t)
  kwargs: dict[str, Any] = {}
  if in_shardings is not None:
    kwargs['in_shardings'] = ins
  if out_shardings is not None:
    kwargs['out_shardings'] = outs

  # jax caches traces per function. fsm's rules are part of its key, flax's
  # are not: a wrapper of our own keeps each fsm.jit's traces apart whatever
  # the rules come from.
  @functools.wraps(fn)
  def traced(*args: Any, **kw: Any) -> Any:
    return fn(*args, **kw)

  jitted = jax.jit(
    traced, static_argnums=static_argnums, donate_argnums=donate_argnums, **kwargs
  )
  return JitWithContext(
    fn,
    mesh,
    rules_t,
    jitted,
    ins if in_shardings is not None else None,
    outs if out_shardings is not None else None,
  )


def _mesh_context(mesh: AnyMesh) -> contextlib.AbstractContextManager[Any]:
  # An AbstractMesh (a pod planned from a laptop) traces and lowers
  # abstractly: the step can be analysed (fsm.fit), not run.
  if isinstance(mesh, AbstractMesh):
    return jax.sharding.use_abstract_mesh(mesh)
  return jax.set_mesh(mesh)


def _is_names(x: Any) -> bool:
  # Plain tuples only: optax states are NamedTuples (some empty).
  return type(x) is tuple and all(
    e is None or isinstance(e, str) or e is PartitionSpec.UNCONSTRAINED for e in x
  )


def _is_spec_leaf(x: Any) -> bool:
  return isinstance(x, (NamedSharding, PartitionSpec)) or _is_names(x)


def _resolve(shardings: Any, mesh: AnyMesh, rules: tuple[tuple[str, Any], ...]) -> Any:
  """Every accepted form -> NamedSharding (None stays None)."""
  if shardings is None or isinstance(shardings, NamedSharding):
    return shardings
  if isinstance(shardings, PartitionSpec):
    return NamedSharding(mesh, shardings)
  if _is_names(shardings):
    return NamedSharding(mesh, logical_to_mesh_axes(shardings, rules))
  leaves = jax.tree_util.tree_leaves(shardings, is_leaf=_is_spec_leaf)
  if not any(_is_spec_leaf(x) for x in leaves):
    # An annotated abstract tree (jax.eval_shape output, a TrainState, ...).
    return get_sharding(shardings, mesh, rules)
  if isinstance(shardings, (tuple, list)):  # one entry per argument or output
    return type(shardings)(_resolve(x, mesh, rules) for x in shardings)
  if isinstance(shardings, dict):
    return {k: _resolve(v, mesh, rules) for k, v in shardings.items()}
  return jax.tree_util.tree_map(
    lambda x: _resolve(x, mesh, rules), shardings, is_leaf=_is_spec_leaf
  )
