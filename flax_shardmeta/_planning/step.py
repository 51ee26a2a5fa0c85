"""The step ``fit`` analyses: its mesh, rules, arguments and their layouts.

Shared by the compiled path (``_planning.fit``) and the estimate
(``_planning.estimate``): each argument is planned (a layout problem raises
the plan's ``ShardingError`` before anything is traced), laid out by its
plan, and each array leaf gets a category (parameters, optimizer state,
batch and other inputs).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax.core import meta as flax_meta
from jax.sharding import AbstractMesh, NamedSharding

from flax_shardmeta import _annotation as ann_lib
from flax_shardmeta._errors import NoMeshError, ShardingError, ShardingProblem
from flax_shardmeta._explicit import explain_sharding_type_errors
from flax_shardmeta._placement import context_mesh
from flax_shardmeta._planning import report as rep
from flax_shardmeta._planning.plan import plan
from flax_shardmeta._rules import get_logical_axis_rules, logical_axis_rules
from flax_shardmeta._typing import AnyMesh

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
  """

  step: Any
  mesh: AnyMesh
  rules: tuple[tuple[str, Any], ...]
  names: tuple[str, ...]
  has_in_shardings: bool

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
    return cls(
      step,
      mesh,
      tuple(rules),
      _argument_names(step, n_args),
      getattr(step, 'in_shardings', None) is not None,
    )

  def lower(self, *args: Any) -> Any:
    return self._stage('lower', args)

  def trace(self, *args: Any) -> Any:
    return self._stage('trace', args)

  def _stage(self, method: str, args: tuple[Any, ...]) -> Any:
    # fsm.jit enters its own mesh and rules, and explains jax's sharding type
    # errors from inside the trace; for a jax.jit function fit does both.
    if hasattr(self.step, 'context'):
      return getattr(self.step, method)(*args)
    with explain_sharding_type_errors('fsm.fit'):
      with _mesh_context(self.mesh), logical_axis_rules(self.rules):
        return getattr(self.step, method)(*args)


def _explaining(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` raising jax's sharding type errors as ExplicitShardingError, from
  inside the trace where the operation's frames are still known."""

  @functools.wraps(fn)
  def traced(*args: Any, **kwargs: Any) -> Any:
    with explain_sharding_type_errors('fsm.fit'):
      return fn(*args, **kwargs)

  return traced


def _mesh_context(mesh: AnyMesh) -> Any:
  if isinstance(mesh, AbstractMesh):
    return jax.sharding.use_abstract_mesh(mesh)
  return jax.set_mesh(mesh)


def _argument_names(step: Any, n: int) -> tuple[str, ...]:
  fn = inspect.unwrap(step)
  try:
    params = [
      p.name
      for p in inspect.signature(fn).parameters.values()
      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
  except (TypeError, ValueError):
    params = []
  return tuple(params[i] if i < len(params) else f'arg{i}' for i in range(n))


# Arguments: layouts and categories
# ------------------------------------------------------------------------------


@dataclasses.dataclass
class Arguments:
  """The step's arguments as lowered, and what each array leaf is."""

  lowered: tuple[Any, ...]
  categories: list[str]  # per array leaf, in jax.tree.leaves order over all args
  plan_bytes: list[int]  # per array leaf: bytes per device by the plan
  shapes: list[tuple[tuple[int, ...], Any]]  # (shape, dtype) per array leaf


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
  shapes: list[tuple[tuple[int, ...], Any]] = []
  for name, arg in zip(target.names, args):
    top_level_box = _is_box(arg)
    with warnings.catch_warnings():
      # Unmapped-name and fit warnings belong to the plan, shown by fsm.plan.
      warnings.simplefilter('ignore')
      p = plan(arg, target.mesh, target.rules)
    problems += [dataclasses.replace(q, path=_join(name, q.path)) for q in p.problems]
    leaves, _ = ann_lib.walk(arg, every_path=True)
    array_leaves = [lf for lf in leaves if _shape_of(lf.value) is not None]
    if len(array_leaves) != len(p.entries):
      array_leaves = array_leaves[: len(p.entries)]
    for lf, entry in zip(array_leaves, p.entries):
      categories.append(rep.INPUTS if top_level_box else _category(lf, name))
      plan_bytes.append(entry.bytes_per_device)
      shapes.append((entry.shape, entry.dtype))
    if target.has_in_shardings or p.problems:
      lowered.append(_unbox(arg) if top_level_box else arg)
    else:
      lowered.append(_with_shardings(arg, p, target.mesh, top_level_box))
  if problems:
    raise ShardingError(problems, context=' (in the arguments of the step)')
  # Where the step lays an argument out itself, its layout is what it holds.
  for i, sharding in enumerate(input_shardings(target, lowered)):
    if sharding is not None and i < len(shapes):
      shape, dtype = shapes[i]
      shard = sharding.shard_shape(tuple(shape))
      plan_bytes[i] = math.prod(shard) * np.dtype(dtype).itemsize
  return Arguments(tuple(lowered), categories, plan_bytes, shapes)


def input_shardings(target: Step, lowered: Sequence[Any]) -> list[Any]:
  """Each argument leaf's sharding from the step's own in_shardings (None
  where it gives none), in ``jax.tree.leaves`` order over the arguments."""
  given = getattr(target.step, 'in_shardings', None)
  out: list[Any] = []
  for i, arg in enumerate(lowered):
    leaves = [x for x in jax.tree_util.tree_leaves(arg) if _shape_of(x) is not None]
    shardings: list[Any] = [None] * len(leaves)
    if isinstance(given, (tuple, list)) and i < len(given) and given[i] is not None:
      s = given[i]
      if isinstance(s, jax.sharding.Sharding):
        shardings = [s] * len(leaves)
      else:
        flat = jax.tree_util.tree_leaves(
          s, is_leaf=lambda x: x is None or isinstance(x, jax.sharding.Sharding)
        )
        if len(flat) == len(leaves):
          shardings = flat
    out += shardings
  return out


def _join(name: str, path: str) -> str:
  return f'{name}/{path}' if path else name


def _shape_of(value: Any) -> tuple[int, ...] | None:
  shape = getattr(value, 'shape', None)
  return tuple(shape) if shape is not None else None


def _category(lf: ann_lib.Leaf, arg_name: str) -> str:
  mro = {c.__name__ for c in type(lf.leaf).__mro__}
  parts = set(_join(arg_name, lf.path).split('/'))
  ann = lf.annotation
  if (ann is not None and ann.optimizer_state) or 'opt_state' in parts:
    return rep.OPTIMIZER
  if mro & {'OptState', 'OptVariable', 'OptArray'}:
    return rep.OPTIMIZER
  if 'Param' in mro or 'params' in parts or (ann is not None and ann.names):
    return rep.PARAMETERS
  return rep.INPUTS


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
