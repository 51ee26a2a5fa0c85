"""``fsm.jit``: ``jax.jit`` that carries its mesh and logical axis rules.

A logical constraint inside a jitted function needs the mesh and the rules in
force while the function is traced; a caller who forgets the context gets a
constraint that silently does nothing. ``fsm.jit`` enters both whenever it
traces, lowers or runs, and resolves logical shardings up front.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from flax_shardmeta import _annotation as ann_lib
from flax_shardmeta._errors import NnxJitError, NoMeshError, UnmappedNameWarning
from flax_shardmeta._explicit import explain_sharding_type_errors
from flax_shardmeta._frames import warn_at_user_code
from flax_shardmeta._jit.graph import (
  GraphCall,
  check_no_nested_nodes,
  graph_positions,
)
from flax_shardmeta._jit_key import own_trace
from flax_shardmeta._placement import context_mesh
from flax_shardmeta._resolution import logical_to_mesh_axes
from flax_shardmeta._rules import (
  get_logical_axis_rules,
  logical_axis_rules,
  normalize_rules,
)
from flax_shardmeta._sharding import get_sharding
from flax_shardmeta._typing import AnyMesh, LogicalRules


class JitWithContext:
  """A jitted function that runs, traces and lowers inside its mesh and rules.

  Made by :func:`flax_shardmeta.jit`; call it like the function. ``lower``,
  ``trace`` and ``eval_shape`` take the same arguments.

  Shardings given as an annotated abstract tree follow the tree actually
  passed or returned when the two differ only in static fields: a
  ``TrainState`` from ``fsm.sharded_init(init_fn, mesh)`` holds another
  ``tx`` object than ``jax.eval_shape(init_fn, ...)`` when ``init_fn`` builds
  its optimizer, and jax would refuse it ("different pytree metadata").

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
    in_shardings: Any,
    out_shardings: Any,
    jit_kwargs: dict[str, Any],
    given_in_shardings: Any = None,
  ):
    self.mesh, self.rules = mesh, rules
    self._given_ins = given_in_shardings
    self._fn, self._jit_kwargs = fn, jit_kwargs
    self._ins, self._outs = in_shardings, out_shardings
    self._jits: dict[Any, tuple[Any, list[Any]]] = {}
    self._outs_for: dict[Any, Any] = {}  # out_shardings laid out per input structure
    self._graph_calls: dict[tuple[int, ...], GraphCall] = {}
    functools.update_wrapper(self, fn)

  @contextlib.contextmanager
  def context(self) -> Iterator[None]:
    """The mesh and rule context the function is traced and run in."""
    with _mesh_context(self.mesh), logical_axis_rules(self.rules):
      yield

  @property
  def in_shardings(self) -> Any:
    """The arguments' shardings as given to ``jax.jit`` (None: not given)."""
    return None if self._ins is None else _given(self._ins)

  @property
  def given_in_shardings(self) -> Any:
    """The arguments' shardings as passed to :func:`flax_shardmeta.jit`,
    logical names unresolved: what an error about an argument's layout
    names."""
    return self._given_ins

  @property
  def out_shardings(self) -> Any:
    """The outputs' shardings as given to ``jax.jit`` (None: not given)."""
    return None if self._outs is None else _given(self._outs)

  def _jitted(self, ins: Any, outs: Any) -> tuple[Any, list[Any]]:
    """The jax.jit for these shardings, and where its trace records the
    structure of its output."""
    key = (_key(ins), _key(outs))
    if key not in self._jits:
      fn, output = self._fn, [None]

      # jax caches traces per function. fsm's rules are part of its key,
      # flax's are not: a wrapper of our own keeps each fsm.jit's traces
      # apart whatever the rules come from (and whether or not jax honours
      # the key, see flax_shardmeta._jit_key). It also records the output's
      # structure, for shardings that must follow it.
      @functools.wraps(fn)
      def traced(*args: Any, **kw: Any) -> Any:
        # Once per trace: a module inside an argument would be flattened by
        # jax and its updates lost.
        check_no_nested_nodes(args, kw, top_level=False)
        with explain_sharding_type_errors('fsm.jit'), own_trace():
          out = fn(*args, **kw)
        output[0] = jax.tree_util.tree_structure(out)
        return out

      kwargs = dict(self._jit_kwargs)
      if ins is not None:
        kwargs['in_shardings'] = _given(ins)
      if outs is not None:
        kwargs['out_shardings'] = _given(outs)
      self._jits[key] = (jax.jit(traced, **kwargs), output)
    return self._jits[key]

  def _run(self, method: str | None, args: tuple[Any, ...], kwargs: Any) -> Any:
    positions = graph_positions(args)
    if positions:
      with self.context(), _closures_explained():
        return self._graph_call(positions).run(method, args, kwargs)
    with _closures_explained():
      return self._run_trees(method, args, kwargs)

  def _graph_call(self, positions: tuple[int, ...]) -> GraphCall:
    call = self._graph_calls.get(positions)
    if call is None:
      ins = None if self._ins is None else _given(self._ins)
      outs = None if self._outs is None else _given(self._outs)
      call = self._graph_calls[positions] = GraphCall(
        self._traced_fn, positions, self.mesh, self.rules, ins, outs, self._jit_kwargs
      )
    return call

  def _traced_fn(self, *args: Any, **kwargs: Any) -> Any:
    # GraphCall's jax.jit is this fsm.jit's own too (one per graph structure).
    with explain_sharding_type_errors('fsm.jit'), own_trace():
      return self._fn(*args, **kwargs)

  def _run_trees(self, method: str | None, args: tuple[Any, ...], kwargs: Any) -> Any:
    ins = _onto(self._ins, args) if isinstance(self._ins, tuple) else self._ins
    in_key = _key(ins)
    outs = self._outs_for.get(in_key, self._outs)
    with self.context():
      jitted, output = self._jitted(ins, outs)
      try:
        return _stage(jitted, method)(*args, **kwargs)
      except Exception:
        # The output may differ from an abstract out_shardings tree in static
        # fields only; jax says so after tracing, so lay the shardings onto
        # the traced output's structure and try once more.
        laid = _onto_structure(outs, output[0])
        if laid is None:
          raise
        self._outs_for[in_key] = laid
        jitted, _ = self._jitted(ins, laid)
        return _stage(jitted, method)(*args, **kwargs)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    return self._run(None, args, kwargs)

  def lower(self, *args: Any, **kwargs: Any) -> Any:
    """``jax.stages.Lowered`` for these arguments (traced in the context)."""
    return self._run('lower', args, kwargs)

  def trace(self, *args: Any, **kwargs: Any) -> Any:
    """``jax.stages.Traced`` for these arguments (traced in the context)."""
    return self._run('trace', args, kwargs)

  def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
    """Output shapes, dtypes and shardings, without running anything."""
    return self._run('eval_shape', args, kwargs)


@contextlib.contextmanager
def _closures_explained() -> Iterator[None]:
  """flax's error for a module the jitted function closes over and updates,
  re-raised with the pattern that works."""
  try:
    yield
  except Exception as e:
    if not _is_closure_error(e):
      raise
    raise NnxJitError(
      'fsm.jit: the function updates an NNX module or optimizer it closes over, '
      'which a compiled function cannot do. Pass the graph nodes as arguments: '
      'step = fsm.jit(train_step, mesh=mesh, rules=rules); '
      'loss = step(model, optimizer, batch) (their updates are written back). '
      f"flax's error: {str(e).splitlines()[0]}"
    ) from e


def _is_closure_error(e: Exception) -> bool:
  """Whether ``e`` is flax's refusal to touch a graph node of another trace:
  its ``TraceContextError`` (mutating a Variable) or the ValueError of NNX
  transforms ("Cannot extract graph node from different trace level"), which
  has no class of its own, so its text is read here and only here."""
  errors = sys.modules.get('flax.errors')
  if errors is not None and isinstance(e, errors.TraceContextError):
    return True
  return type(e) is ValueError and 'different trace level' in str(e)


def _stage(jitted: Any, method: str | None) -> Callable[..., Any]:
  return jitted if method is None else getattr(jitted, method)


def jit(
  fn: Callable[..., Any],
  *,
  mesh: AnyMesh | None,
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
  :func:`get_sharding`; a tree passed or returned that differs from it only
  in static fields, such as a ``TrainState``'s ``tx``, is accepted); ``None``
  leaves are left to the compiler. On Explicit mesh axes, jax's
  ``ShardingTypeError`` while tracing becomes an
  :class:`ExplicitShardingError` naming the operation and the fixes.

  Args:
    fn: the function to compile.
    mesh: the mesh it runs on; an ``AbstractMesh`` (e.g. a pod planned from
      a laptop) gives a function that traces and lowers abstractly, for
      :func:`flax_shardmeta.fit`, but cannot run. None takes the context
      mesh (``jax.set_mesh``) at the time ``jit`` is called, and keeps it.
    rules: logical axis rules; None takes the context rules at the time
      ``jit`` is called, and keeps them.
    in_shardings: shardings of the arguments (see above), as for ``jax.jit``.
    out_shardings: shardings of the outputs.
    static_argnums: as for ``jax.jit``.
    donate_argnums: as for ``jax.jit``.

  Returns:
    A :class:`JitWithContext`, called like ``fn``.

  Raises:
    NoMeshError: ``mesh=None`` with no context mesh.

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
  if mesh is None:
    mesh = context_mesh()  # like rules=None: the context's, kept
    if mesh is None:
      raise NoMeshError(
        'fsm.jit(mesh=None) takes the context mesh, and none is set: pass '
        'mesh=... or call fsm.jit inside `with jax.set_mesh(mesh):`.'
      )
  rules_t = normalize_rules(rules) if rules is not None else get_logical_axis_rules()
  if rules is None and not rules_t:
    _warn_if_logical(in_shardings, out_shardings)
  with _mesh_context(mesh), logical_axis_rules(rules_t):
    ins = _resolve_top(in_shardings, mesh, rules_t)
    outs = _resolve_top(out_shardings, mesh, rules_t)
  jit_kwargs = {'static_argnums': static_argnums, 'donate_argnums': donate_argnums}
  return JitWithContext(fn, mesh, rules_t, ins, outs, jit_kwargs, in_shardings)


def _warn_if_logical(*shardings: Any) -> None:
  """Logical shardings with no rules given or set are replicated: say so
  (once per line of the user's code and set of names)."""
  names: set[str] = set()
  for leaf in jax.tree_util.tree_leaves(shardings, is_leaf=_is_spec_leaf):
    if _is_names(leaf):
      names.update(n for n in leaf if isinstance(n, str))
  for lf in ann_lib.walk(shardings)[0]:  # annotated abstract trees
    ann = lf.annotation
    if ann is not None and ann.logical and not (ann.rules or ann.keep_mesh_names):
      names.update(n for n in ann.names if isinstance(n, str))
  if names:
    warn_at_user_code(
      f'fsm.jit was given logical shardings ({", ".join(map(repr, sorted(names)))}) '
      'but no logical axis rules (rules=None, and neither fsm.logical_axis_rules '
      "nor flax's nn.logical_axis_rules is active), so they are replicated. Pass "
      'rules=[...] to fsm.jit; rules=() replicates on purpose.',
      UnmappedNameWarning,
    )


def _mesh_context(mesh: AnyMesh) -> contextlib.AbstractContextManager[Any]:
  # An AbstractMesh (a pod planned from a laptop) traces and lowers
  # abstractly: the step can be analysed (fsm.fit), not run.
  if isinstance(mesh, AbstractMesh):
    return jax.sharding.use_abstract_mesh(mesh)
  return jax.set_mesh(mesh)


@dataclasses.dataclass(frozen=True, eq=False)
class _FromAbstract:
  """Shardings resolved from an annotated abstract tree, kept with that tree's
  key paths so they can be laid onto a tree that differs in static fields."""

  shardings: Any  # as get_sharding gives them (boxes unwrapped: a prefix tree)
  treedef: Any  # the structure they are laid out for
  paths: tuple[Any, ...]  # the key paths of the abstract tree's leaves
  leaves: tuple[Any, ...]  # the sharding (or None) of each of those leaves

  @classmethod
  def of(cls, abstract: Any, shardings: Any) -> _FromAbstract:
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    by_path = dict(
      jax.tree_util.tree_flatten_with_path(shardings, is_leaf=lambda x: x is None)[0]
    )
    paths = tuple(p for p, _ in flat)
    return cls(shardings, treedef, paths, tuple(_at(by_path, p) for p in paths))

  def onto(self, treedef: Any, paths: Any) -> _FromAbstract | None:
    """The same shardings for ``treedef``; None unless only static fields differ."""
    if tuple(paths) != self.paths:
      return None  # a real mismatch: jax's own error says where
    laid = jax.tree_util.tree_unflatten(treedef, self.leaves)
    return _FromAbstract(laid, treedef, self.paths, self.leaves)


def _at(by_path: dict[Any, Any], path: tuple[Any, ...]) -> Any:
  """The entry of the longest prefix of ``path`` (a box's value is below it)."""
  for n in range(len(path), -1, -1):
    if path[:n] in by_path:
      return by_path[path[:n]]
  return None


def _given(shardings: Any) -> Any:
  """What jax.jit is given: resolved shardings, abstract entries unwrapped."""
  return jax.tree_util.tree_map(
    lambda s: s.shardings if isinstance(s, _FromAbstract) else s,
    shardings,
    is_leaf=lambda s: isinstance(s, _FromAbstract),
  )


def _key(shardings: Any) -> Any:
  """A cache key: the structure each abstract entry is laid out for."""
  if isinstance(shardings, tuple):
    return tuple(_key(s) for s in shardings)
  return shardings.treedef if isinstance(shardings, _FromAbstract) else None


def _onto(shardings: tuple[Any, ...], args: tuple[Any, ...]) -> tuple[Any, ...]:
  """Per argument: an abstract entry laid onto the argument's structure."""
  out = list(shardings)
  for i, (s, arg) in enumerate(zip(shardings, args)):
    if not isinstance(s, _FromAbstract):
      continue
    treedef = jax.tree_util.tree_structure(arg)
    if treedef == s.treedef:
      continue
    flat = jax.tree_util.tree_flatten_with_path(arg)[0]
    out[i] = s.onto(treedef, (p for p, _ in flat)) or s
  return tuple(out)


def _onto_structure(shardings: Any, treedef: Any) -> Any:
  """Output shardings laid onto the traced output's structure, or None when
  that changes nothing."""
  if treedef is None:
    return None
  if isinstance(shardings, _FromAbstract):
    outs: Any = [shardings]
    structures = [treedef]
  elif isinstance(shardings, tuple) and treedef.num_nodes > 1:
    outs = list(shardings)
    structures = treedef.children()
    if len(structures) != len(outs):
      return None
  else:
    return None
  changed = False
  for i, (s, structure) in enumerate(zip(outs, structures)):
    if isinstance(s, _FromAbstract) and structure != s.treedef:
      laid = s.onto(structure, _paths_of(structure))
      if laid is not None:
        outs[i], changed = laid, True
  if not changed:
    return None
  return outs[0] if isinstance(shardings, _FromAbstract) else tuple(outs)


def _paths_of(treedef: Any) -> list[Any]:
  """The key paths of ``treedef``'s leaves."""
  dummy = jax.tree_util.tree_unflatten(treedef, [0] * treedef.num_leaves)
  return [p for p, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]


def _is_names(x: Any) -> bool:
  # Plain tuples only: optax states are NamedTuples (some empty).
  return type(x) is tuple and all(
    e is None or isinstance(e, str) or e is PartitionSpec.UNCONSTRAINED for e in x
  )


def _is_spec_leaf(x: Any) -> bool:
  return isinstance(x, (NamedSharding, PartitionSpec)) or _is_names(x)


def _resolve_top(
  shardings: Any, mesh: AnyMesh, rules: tuple[tuple[str, Any], ...]
) -> Any:
  """A tuple or list holds one entry per argument (or output), as for jax.jit."""
  if isinstance(shardings, (tuple, list)) and not _is_names(shardings):
    return tuple(_resolve(x, mesh, rules) for x in shardings)
  return _resolve(shardings, mesh, rules)


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
    return _FromAbstract.of(shardings, get_sharding(shardings, mesh, rules))
  if isinstance(shardings, (tuple, list)):  # one entry per argument or output
    return type(shardings)(_resolve(x, mesh, rules) for x in shardings)
  if isinstance(shardings, dict):
    return {k: _resolve(v, mesh, rules) for k, v in shardings.items()}
  return jax.tree_util.tree_map(
    lambda x: _resolve(x, mesh, rules), shardings, is_leaf=_is_spec_leaf
  )
