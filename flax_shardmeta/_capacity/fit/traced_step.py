"""The step ``fit`` analyses: its mesh, rules, arguments and their layouts.

Shared by the compiled path (``_capacity.fit.fit``) and the estimate
(``_capacity.estimate.estimator``): each argument is planned (a layout problem raises
the plan's ``ShardingError`` before anything is traced), laid out by its
plan, and each array leaf gets a category (parameters, optimizer state,
batch and other inputs).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax.core import meta as flax_meta
from jax.sharding import AbstractMesh, NamedSharding

from flax_shardmeta import _annotation as ann_lib
from flax_shardmeta._arrays import array_bytes, is_key, shard_bytes
from flax_shardmeta._capacity import vocabulary as vocab
from flax_shardmeta._errors import NoMeshError, ShardingError, ShardingProblem
from flax_shardmeta._explicit import explain_sharding_type_errors
from flax_shardmeta._jit_key import own_trace
from flax_shardmeta._paths import argument_names, path_str
from flax_shardmeta._placement import context_mesh
from flax_shardmeta._planning.sharding_plan import plan
from flax_shardmeta._rules import get_logical_axis_rules, logical_axis_rules
from flax_shardmeta._specs import mesh_axes_of, spec_entries
from flax_shardmeta._typing import AnyMesh
from flax_shardmeta._validate import check_spec

# What is being fitted
# ------------------------------------------------------------------------------


@dataclasses.dataclass
class Step:
  """A step with its mesh, rules and argument names.

  Attributes:
    step: the jitted function (a plain one is wrapped in ``jax.jit``).
    mesh: its mesh: the ``fsm.jit`` one, else the context's.
    rules: its logical axis rules: the ``fsm.jit`` ones, else the context's.
    names: the names of its positional parameters, for paths.
    has_in_shardings: whether it lays its arguments out itself.
    in_shardings: its arguments' shardings as its jit was given them (one
      entry per argument, or one sharding for all), None where not given.
  """

  step: Any
  mesh: AnyMesh
  rules: tuple[tuple[str, Any], ...]
  names: tuple[str, ...]
  has_in_shardings: bool
  in_shardings: Any = None

  @classmethod
  def of(cls, step: Callable[..., Any], n_args: int) -> Step:
    mesh = getattr(step, 'mesh', None)
    rules = getattr(step, 'rules', None)
    if mesh is None:
      mesh = context_mesh()
    if mesh is None:
      raise NoMeshError(
        'fit needs a mesh: pass a function from fsm.jit(..., mesh=...), or call '
        'fit inside `with jax.set_mesh(mesh):` (for a pod you do not have: '
        "mesh = fsm.make_mesh(..., topology='v5p:4x4x8')."
      )
    if rules is None:
      rules = get_logical_axis_rules()
    if not hasattr(step, 'lower'):
      step = jax.jit(_explaining(step))
    given = jit_shardings(step, 'in')
    return cls(
      step,
      mesh,
      tuple(rules),
      argument_names(step, n_args),
      given is not None,
      given,
    )

  def lower(self, *args: Any) -> Any:
    return self._stage('lower', args)

  def trace(self, *args: Any) -> Any:
    return self._stage('trace', args)

  def trace_and_lower(self, *args: Any) -> tuple[Any, Any]:
    """The traced step (its jaxpr) and its lowering, from one trace."""
    traced = self.trace(*args)
    with _mesh_context(self.mesh):
      return traced, traced.lower()

  def _stage(self, method: str, args: tuple[Any, ...]) -> Any:
    # fsm.jit enters its own mesh and rules, and explains jax's sharding type
    # errors from inside the trace; for a jax.jit function fit does both.
    if hasattr(self.step, 'context'):
      return getattr(self.step, method)(*args)
    with explain_sharding_type_errors('fsm.fit'):
      with _mesh_context(self.mesh), logical_axis_rules(self.rules):
        return getattr(self.step, method)(*args)


def jit_shardings(step: Any, which: str) -> Any:
  """The ``in_shardings`` or ``out_shardings`` (``which``: ``'in'``/``'out'``)
  ``step``'s jit was given, None where not given: ``fsm.jit`` says them; a
  ``jax.jit`` function keeps them in its jit info, the tree it was given
  (private to jax, so read guarded: without it, arguments are laid out by
  their plans, as for a jit given none)."""
  own = getattr(step, f'{which}_shardings', None)
  if own is not None:
    return own
  info = getattr(step, '_jit_info', None)
  if which == 'in' and not getattr(info, 'user_specified_in_shardings', False):
    return None
  treedef = getattr(info, f'{which}_shardings_treedef', None)
  leaves = getattr(info, f'{which}_shardings_leaves', None)
  if treedef is None or leaves is None:
    return None
  # jax marks a sharding not given with its own placeholder: None here.
  leaves = [s if isinstance(s, jax.sharding.Sharding) else None for s in leaves]
  if not any(s is not None for s in leaves):
    return None
  return jax.tree_util.tree_unflatten(treedef, leaves)


def _explaining(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` raising jax's sharding type errors as ExplicitShardingError, from
  inside the trace where the operation's frames are still known. The jit made
  around it is fit's own, one per call: it needs no cache key for the rules."""

  @functools.wraps(fn)
  def traced(*args: Any, **kwargs: Any) -> Any:
    with explain_sharding_type_errors('fsm.fit'), own_trace():
      return fn(*args, **kwargs)

  return traced


def _mesh_context(mesh: AnyMesh) -> Any:
  if isinstance(mesh, AbstractMesh):
    return jax.sharding.use_abstract_mesh(mesh)
  return jax.set_mesh(mesh)


# Arguments: layouts and categories
# ------------------------------------------------------------------------------


@dataclasses.dataclass
class Arguments:
  """The step's arguments as lowered, and what each of their leaves is.

  One entry per leaf jax flattens the arguments into (``jax.tree.leaves``
  over all of them): the order of the compiled program's inputs.

  Attributes:
    lowered: the arguments as the step is lowered with.
    categories: per leaf, the report row it belongs to.
    layout_bytes: per leaf, bytes per device as laid out: by the step's own
      in_shardings, else the leaf's own sharding, else its plan.
    on_host: per leaf, whether that layout puts it in host memory (its
      memory kind, e.g. ``pinned_host``).
  """

  lowered: tuple[Any, ...]
  categories: list[str]
  layout_bytes: list[int]
  on_host: list[bool] = dataclasses.field(default_factory=list)


def _is_box(x: Any) -> bool:
  """A Linen box (fsm's or flax's) given as a whole argument."""
  return isinstance(x, flax_meta.AxisMetadata)


def _unbox(x: Any) -> Any:
  return ann_lib.read(x)[0]


def prepare(target: Step, args: Sequence[Any]) -> Arguments:
  """Lays each argument out by its plan; raises the plans' problems together."""
  problems: list[ShardingProblem] = []
  lowered: list[Any] = []
  categories: list[str] = []
  plan_bytes: list[int] = []
  for name, arg in zip(target.names, args):
    with warnings.catch_warnings():
      # Unmapped-name and fit warnings belong to the plan, shown by fsm.plan.
      warnings.simplefilter('ignore')
      p = plan(arg, target.mesh, target.rules)
    problems += [dataclasses.replace(q, path=_join(name, q.path)) for q in p.problems]
    if target.has_in_shardings or p.problems:
      value = _unbox(arg) if _is_box(arg) else arg
    else:
      value = _with_shardings(arg, p, target.mesh, _is_box(arg))
    lowered.append(value)
    for category, size in _leaves(name, arg, p, value):
      categories.append(category)
      plan_bytes.append(size)
  if problems:
    raise ShardingError(problems, context=' (in the arguments of the step)')
  leaves = jax.tree_util.tree_leaves(lowered)
  layout = input_shardings(target, lowered)
  # A layout the step gives itself (in_shardings), or a leaf brings, is not
  # planned above: checked here, before jax refuses it naming no argument.
  problems = _layout_problems(target, lowered, layout)
  if problems:
    raise ShardingError(problems, context=' (in the arguments of the step)')
  sizes = [
    _leaf_bytes(leaf, sharding) if sharding is not None else planned
    for leaf, sharding, planned in zip(leaves, layout, plan_bytes)
  ]
  hosted = [
    getattr(s, 'memory_kind', None) in ('pinned_host', 'unpinned_host') for s in layout
  ]
  return Arguments(tuple(lowered), categories, sizes, hosted)


def _layout_problems(
  target: Step, lowered: Sequence[Any], layout: Sequence[Any]
) -> list[ShardingProblem]:
  """What is wrong with each leaf's sharding in ``layout`` (one per leaf of
  ``lowered``, in ``jax.tree.leaves`` order), by the plan's own checks."""
  given = getattr(target.step, 'given_in_shardings', None)
  shardings = iter(layout)
  out = []
  for i, (name, arg) in enumerate(zip(target.names, lowered)):
    names = _given_names(given, i)
    for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
      sharding = next(shardings, None)
      shape = _shape_of(leaf)
      if shape is None or not isinstance(sharding, NamedSharding):
        continue
      spec = sharding.spec
      for reason, hint, dims in check_spec(shape, spec_entries(spec), sharding.mesh):
        divides = _divides_hint(shape, spec, sharding.mesh, dims, names)
        out.append(
          ShardingProblem(
            _join(name, path_str(path)),
            shape,
            names,
            spec,
            reason,
            divides or hint,
            dims,
          )
        )
  return out


def _given_names(given: Any, i: int) -> tuple[Any, ...] | None:
  """The logical names argument ``i`` was given in ``fsm.jit``'s in_shardings,
  when given as names (a tuple of them for all arguments, or one per argument)."""
  entry = given
  if isinstance(given, (tuple, list)) and not _is_names(given):
    entry = given[i] if i < len(given) else None
  return entry if _is_names(entry) else None


def _is_names(x: Any) -> bool:
  # Plain tuples only: optax states are NamedTuples.
  return type(x) is tuple and all(
    e is None or isinstance(e, str) or e is jax.sharding.PartitionSpec.UNCONSTRAINED
    for e in x
  )


def _divides_hint(
  shape: tuple[int, ...],
  spec: Any,
  mesh: AnyMesh,
  dims: tuple[int, ...],
  names: tuple[Any, ...] | None,
) -> str | None:
  """How to fix a dimension its mesh axes do not divide, for a layout the
  step's in_shardings give (there is no plan to replicate it); None for any
  other problem."""
  entries = spec_entries(spec)
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  for d in dims:
    axes = mesh_axes_of(entries[d]) if d < len(entries) else ()
    if not axes or any(a not in sizes for a in axes):
      continue
    factor = math.prod(sizes[a] for a in axes)
    if shape[d] % factor == 0:
      continue
    multiple = -(-shape[d] // factor) * factor
    name = names[d] if names is not None and d < len(names) else None
    if isinstance(name, str):
      elsewhere = (
        f'map {name!r} to mesh axes that divide it in the rules (None replicates it)'
      )
    else:
      elsewhere = (
        'lay the argument out with shardings whose mesh axes divide it '
        '(fsm.get_sharding(..., replicate_indivisible=True) replicates what '
        'does not)'
      )
    return (
      f'make dimension {d} a multiple of {factor} (e.g. {multiple}), or {elsewhere}'
    )
  return None


def _leaves(name: str, arg: Any, p: Any, value: Any) -> list[tuple[str, int]]:
  """``(category, bytes per device by the plan)`` of each jax leaf of ``value``
  (``arg`` as lowered); leaves that are not arrays count as inputs."""
  walked, _ = ann_lib.walk(arg, every_path=True)
  planned = iter(
    zip([lf for lf in walked if _shape_of(lf.value) is not None], p.entries)
  )
  out = []
  for leaf in jax.tree_util.tree_leaves(value):
    found = next(planned, None) if _shape_of(leaf) is not None else None
    if found is None:
      out.append((vocab.INPUTS, _leaf_bytes(leaf, None)))
      continue
    lf, entry = found
    category = vocab.INPUTS if _is_box(arg) else _category(lf, name)
    out.append((category, entry.bytes_per_device))
  return out


def _leaf_bytes(leaf: Any, sharding: Any) -> int:
  """Bytes per device of one leaf laid out by ``sharding`` (None: whole)."""
  shape = _shape_of(leaf)
  dtype = getattr(leaf, 'dtype', None)
  if shape is None or dtype is None:  # a Python scalar: jax makes it an array
    shape, dtype = (), jax.dtypes.canonicalize_dtype(np.result_type(leaf))
  if sharding is None:
    return array_bytes(shape, dtype)
  return shard_bytes(shape, dtype, sharding)


def input_shardings(target: Step, lowered: Sequence[Any]) -> list[Any]:
  """Each argument leaf's sharding, in ``jax.tree.leaves`` order over the
  arguments: the step's own in_shardings where it gives them, else the
  leaf's own (a ``ShapeDtypeStruct`` laid out by its plan or by the caller),
  else None."""
  given = target.in_shardings
  if isinstance(given, jax.sharding.Sharding):  # one for every argument
    given = (given,) * len(lowered)
  out: list[Any] = []
  for i, arg in enumerate(lowered):
    leaves = jax.tree_util.tree_leaves(arg)
    own = [_own_sharding(x) for x in leaves]
    if isinstance(given, (tuple, list)) and i < len(given) and given[i] is not None:
      out += [s or o for s, o in zip(_broadcast(given[i], arg, len(leaves)), own)]
    else:
      out += own
  return out


def _own_sharding(x: Any) -> Any:
  sharding = getattr(x, 'sharding', None)
  return sharding if isinstance(sharding, jax.sharding.Sharding) else None


def _broadcast(shardings: Any, arg: Any, n: int) -> list[Any]:
  """A sharding per leaf of ``arg`` from in_shardings given as a prefix of it."""
  if isinstance(shardings, jax.sharding.Sharding):
    return [shardings] * n

  def leaf(x: Any) -> bool:
    return x is None or isinstance(x, jax.sharding.Sharding)

  try:
    per_subtree = jax.tree_util.tree_map(
      lambda s, sub: [s] * len(jax.tree_util.tree_leaves(sub)),
      shardings,
      arg,
      is_leaf=leaf,
    )
  except (ValueError, TypeError):  # not a prefix of the argument
    return [None] * n
  flat = [
    s
    for group in jax.tree_util.tree_leaves(
      per_subtree, is_leaf=lambda x: isinstance(x, list)
    )
    for s in group
  ]
  flat = [s if isinstance(s, jax.sharding.Sharding) else None for s in flat]
  return flat if len(flat) == n else [None] * n


def _join(name: str, path: str) -> str:
  return f'{name}/{path}' if path else name


def _shape_of(value: Any) -> tuple[int, ...] | None:
  shape = getattr(value, 'shape', None)
  return tuple(shape) if shape is not None else None


# Variable types of RNG streams (flax.nnx) and path parts that name them.
_RNG_TYPES = frozenset({'RngState', 'RngKey', 'RngCount'})
_RNG_PARTS = frozenset({'rngs', 'rng'})


def _category(lf: ann_lib.Leaf, arg_name: str) -> str:
  mro = {c.__name__ for c in type(lf.leaf).__mro__}
  parts = set(_join(arg_name, lf.path).split('/'))
  ann = lf.annotation
  # RNG streams first: NNX keeps them under the module's path, and a stream
  # named 'params' (`rngs/params/key`) holds no parameters.
  if mro & _RNG_TYPES or parts & _RNG_PARTS or is_key(getattr(lf.value, 'dtype', None)):
    return vocab.RNG
  if (ann is not None and ann.optimizer_state) or 'opt_state' in parts:
    return vocab.OPTIMIZER
  if mro & {'OptState', 'OptVariable', 'OptArray'}:
    return vocab.OPTIMIZER
  if 'Param' in mro or 'params' in parts or (ann is not None and ann.names):
    return vocab.PARAMETERS
  return vocab.INPUTS


def path_category(path: str, key_array: bool = False) -> str:
  """The category of a leaf known only by its path (``"[0]['params']['w']"``,
  as ``jax.tree_util.keystr`` writes it): by the same names as
  :func:`prepare`, without the Variable types and annotations it also reads.

  Example:
    >>> path_category("[0]['rngs']['params']['key']"), path_category("[1]['x']")
    (<Category.RNG: 'RNG state'>, <Category.INPUTS: 'batch and other inputs'>)
  """
  parts = set(re.findall(r"\['([^']*)'\]|\.(\w+)", path))
  names = {a or b for a, b in parts}
  if names & _RNG_PARTS or key_array:
    return vocab.RNG
  if 'opt_state' in names:
    return vocab.OPTIMIZER
  if 'params' in names:
    return vocab.PARAMETERS
  return vocab.INPUTS


def _with_shardings(arg: Any, p: Any, mesh: AnyMesh, unbox: bool) -> Any:
  """``arg`` with each array leaf a ShapeDtypeStruct carrying its planned layout.

  Boxes and Variables stay around their values, so the step sees what it
  sees in training; a leaf that already has a sharding keeps it.
  """
  specs = iter([e.spec for e in p.entries])

  def attach(x: Any) -> Any:
    shape = _shape_of(x)
    if shape is None:
      return x
    spec = next(specs, None)
    if getattr(x, 'sharding', None) is not None or spec is None:
      return x
    sharding = NamedSharding(mesh, spec)
    return jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)

  value = _unbox(arg) if unbox else arg
  return jax.tree_util.tree_map(attach, value)
