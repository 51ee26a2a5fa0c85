"""``snapshot``: a step's layout as a JSON-ready record, for golden files.

A snapshot says how a training step lays everything out: each argument
array's spec, by its plan path (the layout ``fit`` lowers the step with), the
layout every sharding constraint in the traced step asks for, and the
collectives ``fit`` attributes to parameters, gradients and activations.
``snapshot_diff`` turns two snapshots into readable lines, so a test can
pin a layout and a reviewer can read what a change did to it.

Everything recorded is stable across runs, processes and machines: mesh axis
names and sizes, spec text, shapes, jax's name stack, byte counts, and the
user's ``file:line`` with the file named from its import root
(``pkg/model.py``), never absolute nor from the working directory; never a
memory address or an HLO instruction number. Lists are kept in one canonical
order. What identifies a constraint or a collective is what it does (scope,
layout, kind, axes, reason, parameters), not its line: code that moves (a
line added above it) is no difference; the lines are kept beside, to read.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.sharding import AbstractMesh, NamedSharding

from flax_shardmeta._capacity.fit.fit import fit
from flax_shardmeta._capacity.fit.traced_step import (
  Arguments,
  Step,
  input_shardings,
  prepare,
)
from flax_shardmeta._errors import NoMeshError, message
from flax_shardmeta._frames import source_line
from flax_shardmeta._planning.sharding_plan import plan
from flax_shardmeta._programs.jaxprs import sub_jaxprs
from flax_shardmeta._snapshot.compare import (
  SECTIONS,
  VERSION,
  line_order,
  merge_collectives,
  scope_text,
)
from flax_shardmeta._specs import format_spec, make_spec, reductions_of, spec_entries
from flax_shardmeta._typing import AnyMesh

_SECTION_OF = {c: name for name, (cats, _) in SECTIONS.items() for c in cats}


def snapshot(
  step: Callable[..., Any], *args: Any, cache: bool = True
) -> dict[str, Any]:
  """A step's layout as a JSON-ready record (dicts, lists, str, int).

  ``step`` and ``args`` are what :func:`flax_shardmeta.fit` takes: a function
  from ``fsm.jit``, or a ``jax.jit`` one called under ``jax.set_mesh(mesh)``,
  and abstract arguments. The record holds:

  * ``mesh``: axis names, sizes and types, and the device kind (None on an
    ``AbstractMesh``);
  * ``parameters``, ``optimizer_state``, ``inputs``: plan path (the step's
    argument name first, e.g. ``state/params/Dense_0/kernel``) -> spec text
    such as ``"P(None, 'model')"``, as the step is lowered with;
  * ``constraints``: the sharding constraints of the traced step, one per
    ``scope`` (jax's name stack), ``shape`` and ``spec``: ``count``, how many
    equations of the traced program ask for it, and ``where``, the user's
    lines asking (``pkg/model.py:40``, the file from its import root;
    ``'(no user line)'`` when none of the traceback is the user's), sorted;
  * ``collectives``: ``fit``'s collective rows, per step and device (kind,
    axes, link, reason, parameters, scope, sources, bytes, count); none when
    ``source`` is ``'estimate'`` (no compiler for the mesh).

  Args:
    step: the training step, as for ``fit``.
    *args: its arguments, abstract.
    cache: reuse ``fit``'s cached figures of the very same program.

  Returns:
    The record; ``json.dumps(record, sort_keys=True)`` is the same text in
    every run and process, from any working directory, wherever the code is
    installed.

  Raises:
    ShardingError: an argument's annotations cannot be laid out on the mesh.
    NoMeshError: no mesh (as for ``fit``).

  Example:
    >>> import jax, jax.numpy as jnp, flax_shardmeta as fsm
    >>> mesh = jax.make_mesh((2, 4), ('data', 'model'))
    >>> params = {'w': fsm.Partitioned(
    ...     jax.ShapeDtypeStruct((16, 8), jnp.float32), (None, 'model'))}
    >>> x = jax.ShapeDtypeStruct((32, 16), jnp.float32)
    >>> def step(params, x):
    ...   return (x @ fsm.unbox(params)['w']).sum()
    >>> with jax.set_mesh(mesh):
    ...   snap = fsm.snapshot(jax.jit(step), params, x, cache=False)
    >>> snap['parameters'], snap['mesh']['axis_names']
    ({'params/w': "P(None, 'model')"}, ['data', 'model'])
  """
  try:
    target = Step.of(step, len(args))
  except NoMeshError as e:
    # The shared step reader speaks of fit; the caller asked for a snapshot.
    raise NoMeshError(message(e).replace('fit', 'snapshot')) from None
  arguments = prepare(target, args)
  report = fit(step, *args, cache=cache)
  traced = target.trace(*arguments.lowered)
  record: dict[str, Any] = {
    'version': VERSION,
    'mesh': _mesh(target.mesh),
    'source': report.source,
  }
  record.update(_arrays(target, args, arguments))
  record['constraints'] = _constraints(traced.jaxpr.jaxpr)
  record['collectives'] = merge_collectives(report.to_dict()['collectives'])
  return record


# Taking a snapshot
# ------------------------------------------------------------------------------


def _mesh(mesh: AnyMesh) -> dict[str, Any]:
  kind = None
  if not isinstance(mesh, AbstractMesh):
    kind = str(mesh.devices.flat[0].device_kind)
  types = getattr(mesh, 'axis_types', None) or ()
  return {
    'axis_names': [str(n) for n in mesh.axis_names],
    'axis_sizes': [int(s) for s in mesh.axis_sizes],
    'axis_types': [getattr(t, 'name', str(t)) for t in types],
    'device_kind': kind,
  }


def _arrays(
  target: Step, args: Sequence[Any], arguments: Arguments
) -> dict[str, dict[str, str]]:
  """Each argument array's spec by plan path, in its section.

  The arguments' jax leaves with a shape are their plans' entries, in order
  (as ``prepare`` pairs them); the spec is the one the step is lowered with:
  its own in_shardings where it gives them, else the plan's.
  """
  sections: dict[str, dict[str, str]] = {name: {} for name in SECTIONS}
  categories = iter(arguments.categories)
  shardings = iter(input_shardings(target, arguments.lowered))
  for name, arg, value in zip(target.names, args, arguments.lowered):
    with warnings.catch_warnings():
      # Unmapped-name and fit warnings belong to the plan, shown by fsm.plan.
      warnings.simplefilter('ignore')
      entries = iter(plan(arg, target.mesh, target.rules).entries)
    for leaf in jax.tree_util.tree_leaves(value):
      category, sharding = next(categories), next(shardings)
      entry = next(entries, None) if getattr(leaf, 'shape', None) is not None else None
      if entry is None:
        continue
      spec = sharding.spec if isinstance(sharding, NamedSharding) else entry.spec
      path = f'{name}/{entry.path}' if entry.path else name
      sections[_SECTION_OF[category]][path] = _spec_text(spec, len(entry.shape))
  return sections


def _spec_text(spec: Any, rank: int) -> str:
  """The spec as text, one entry per dimension: ``P('data')`` and
  ``P('data', None)`` lay a matrix out alike, and must read alike."""
  entries = spec_entries(spec)
  padded = (*entries, *(None,) * (rank - len(entries)))
  return format_spec(make_spec(padded, reductions_of(spec)))


def _constraints(jaxpr: Any) -> list[dict[str, Any]]:
  """Every sharding constraint of ``jaxpr`` and its sub-programs, counted by
  scope and layout, with the user's lines that ask for it beside."""
  found: collections.Counter[tuple[Any, ...]] = collections.Counter()
  lines: dict[tuple[Any, ...], set[str]] = collections.defaultdict(set)
  for eqn in _equations(jaxpr):
    if eqn.primitive.name != 'sharding_constraint':
      continue
    shape = tuple(int(d) for d in eqn.invars[0].aval.shape)
    sharding = eqn.params.get('sharding')
    spec = getattr(sharding, 'spec', None)
    text = _spec_text(spec, len(shape)) if spec is not None else str(sharding)
    key = (scope_text(eqn.source_info.name_stack), shape, text)
    found[key] += 1
    lines[key].add(_where(eqn.source_info))
  return [
    {
      'scope': scope,
      'shape': list(shape),
      'spec': text,
      'count': n,
      'where': sorted(lines[scope, shape, text], key=line_order),
    }
    for (scope, shape, text), n in sorted(found.items())
  ]


def _equations(jaxpr: Any) -> Iterator[Any]:
  """The equations of ``jaxpr`` and, depth first, of every sub-program
  (jit, scan, remat, custom_vjp, ...): as many times as each is called."""
  for eqn in jaxpr.eqns:
    yield eqn
    for inner, _ in sub_jaxprs(eqn):
      yield from _equations(inner)


def _where(source_info: Any) -> str:
  """The user's ``file:line`` for an equation (``_frames.source_line``)."""
  return source_line(source_info)
