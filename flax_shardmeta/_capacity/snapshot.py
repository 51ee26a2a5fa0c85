"""``snapshot``: a step's layout as a JSON-ready record, for golden files.

A snapshot says how a training step lays everything out: each argument
array's spec, by its plan path (the layout ``fit`` lowers the step with), the
layout every sharding constraint in the traced step asks for, and the
collectives ``fit`` attributes to parameters, gradients and activations.
``snapshot_diff`` turns two snapshots into readable lines, so a test can
pin a layout and a reviewer can read what a change did to it.

Everything recorded is stable across runs and processes: mesh axis names and
sizes, spec text, shapes, the user's ``file:line`` and jax's name stack, byte
counts; never a memory address or an HLO instruction number. Lists are kept
in one canonical order.
"""

from __future__ import annotations

import collections
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.sharding import AbstractMesh, NamedSharding

from flax_shardmeta._capacity import report as rep
from flax_shardmeta._capacity.fit import fit
from flax_shardmeta._capacity.propagate import sub_jaxprs
from flax_shardmeta._capacity.step import Arguments, Step, input_shardings, prepare
from flax_shardmeta._errors import FitError
from flax_shardmeta._frames import in_dirs, library_dirs
from flax_shardmeta._planning.format import format_bytes
from flax_shardmeta._planning.plan import plan
from flax_shardmeta._specs import format_spec, make_spec, reductions_of, spec_entries
from flax_shardmeta._typing import AnyMesh

VERSION = 1
"""The snapshot format; a snapshot of another version is re-recorded."""

# Snapshot section -> the report categories it holds, and how a diff names one.
_SECTIONS = {
  'parameters': ((rep.PARAMETERS,), 'parameter'),
  'optimizer_state': ((rep.OPTIMIZER,), 'optimizer state'),
  'inputs': ((rep.INPUTS, rep.RNG), 'input'),
}
_SECTION_OF = {c: name for name, (cats, _) in _SECTIONS.items() for c in cats}

# What a collective row is matched by between two snapshots.
_ROW_KEY = ('kind', 'axes', 'reason', 'parameters', 'sources')

# Byte changes smaller than this share of the old figure are not differences.
_BYTES_TOLERANCE = 0.01


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
  * ``constraints``: each sharding constraint of the traced step (``where``:
    the user's ``file:line``, relative to the current directory when under
    it; ``scope``: jax's name stack; ``shape``; ``spec``; ``count``: how many
    equations of the traced program ask for it);
  * ``collectives``: ``fit``'s collective rows, per step and device (kind,
    axes, link, reason, parameters, sources, bytes, count); none when
    ``source`` is ``'estimate'`` (no compiler for the mesh).

  Args:
    step: the training step, as for ``fit``.
    *args: its arguments, abstract.
    cache: reuse ``fit``'s cached figures of the very same program.

  Returns:
    The record; ``json.dumps(record, sort_keys=True)`` is the same text in
    every run and process.

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
  target = Step.of(step, len(args))
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
  record['collectives'] = _collectives(report.to_dict()['collectives'])
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
  sections: dict[str, dict[str, str]] = {name: {} for name in _SECTIONS}
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
  """Every sharding constraint of ``jaxpr`` and its sub-programs, counted."""
  found: collections.Counter[tuple[Any, ...]] = collections.Counter()
  for eqn in _equations(jaxpr):
    if eqn.primitive.name != 'sharding_constraint':
      continue
    shape = tuple(int(d) for d in eqn.invars[0].aval.shape)
    sharding = eqn.params.get('sharding')
    spec = getattr(sharding, 'spec', None)
    text = _spec_text(spec, len(shape)) if spec is not None else str(sharding)
    scope = str(eqn.source_info.name_stack)
    found[(_where(eqn.source_info), scope, shape, text)] += 1
  return [
    {'where': w, 'scope': s, 'shape': list(shape), 'spec': t, 'count': n}
    for (w, s, shape, t), n in sorted(found.items())
  ]


def _equations(jaxpr: Any) -> Iterator[Any]:
  """The equations of ``jaxpr`` and, depth first, of every sub-program
  (jit, scan, remat, custom_vjp, ...): as many times as each is called."""
  for eqn in jaxpr.eqns:
    yield eqn
    for inner, _ in sub_jaxprs(eqn):
      yield from _equations(inner)


def _where(source_info: Any) -> str:
  """The user's ``file:line`` for an equation: the innermost frame outside
  jax, flax, optax and this package (the example models count as the user's).

  jax records the traceback of each equation, but reads it only through its
  private ``source_info_util``; without it the line is ``'?'``.
  """
  try:
    from jax._src import source_info_util

    frames = list(source_info_util.user_frames(source_info.traceback))
  except (ImportError, AttributeError):
    return '?'
  dirs = library_dirs()
  frame = next((f for f in frames if not in_dirs(f.file_name, dirs)), None)
  frame = frame or (frames[0] if frames else None)
  if frame is None:
    return '?'
  return f'{_relative(frame.file_name)}:{frame.start_line}'


def _relative(path: str) -> str:
  """``path`` relative to the current directory when under it."""
  here = os.getcwd() + os.sep
  return path[len(here) :] if path.startswith(here) else path


def _collectives(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """``fit``'s rows, merged by what a diff matches them by, in a canonical order.

  The attribution fields (reason, parameters, sources) are read with
  defaults: reports that do not attribute collectives have none.
  """
  merged: dict[tuple[Any, ...], dict[str, Any]] = {}
  for row in rows:
    out = {
      'kind': str(row['kind']),
      'axes': [str(a) for a in row.get('axes') or ()],
      'reason': row.get('reason') or None,
      'parameters': sorted(str(p) for p in row.get('parameters') or ()),
      'sources': sorted(str(s) for s in row.get('sources') or ()),
      'link': row.get('link'),
      'bytes': int(row.get('bytes') or 0),
      'count': int(row.get('count') or 0),
    }
    key = _row_key(out)
    if key not in merged:
      merged[key] = out
      continue
    into = merged[key]
    into['bytes'] += out['bytes']
    into['count'] += out['count']
    links = {*(into['link'] or '').split('+'), out['link'] or ''} - {''}
    into['link'] = '+'.join(sorted(links)) or None
  return [merged[k] for k in sorted(merged, key=_sort_key)]


def _row_key(row: dict[str, Any]) -> tuple[Any, ...]:
  return tuple(
    tuple(row.get(k) or ()) if k in ('axes', 'parameters', 'sources') else row.get(k)
    for k in _ROW_KEY
  )


def _sort_key(key: tuple[Any, ...]) -> tuple[Any, ...]:
  # No reason (None) sorts first, as ''; the other fields are str or tuples.
  return tuple('' if v is None else v for v in key)


# Comparing two snapshots
# ------------------------------------------------------------------------------


def snapshot_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
  """What changed from snapshot ``old`` to ``new``, one readable line each.

  Specs are compared by plan path and constraints by their user line and
  scope. Collective rows are matched by kind, mesh axes, reason, parameters
  and sources; a change in bytes of less than 1% is not a difference (XLA's
  buffer sizes move a little between versions), a change in count is.

  Args:
    old: a snapshot (:func:`snapshot`, or one read back from JSON).
    new: another.

  Returns:
    The lines, in a fixed order (mesh, specs, constraints, collectives);
    empty when the snapshots are equal.

  Raises:
    FitError: ``old`` or ``new`` is not a snapshot of this format.

  Example:
    >>> import flax_shardmeta as fsm
    >>> old = {'version': 1, 'parameters': {'params/w': "P(None, 'model')"}}
    >>> new = {'version': 1, 'parameters': {'params/w': "P('model', None)",
    ...                                     'params/b': "P('model',)"}}
    >>> for line in fsm.snapshot_diff(old, new):
    ...   print(line)
    new parameter params/b: P('model',)
    params/w: P(None, 'model') -> P('model', None)
    >>> fsm.snapshot_diff(new, new)
    []
  """
  _check(old, 'old')
  _check(new, 'new')
  lines = _mesh_lines(old, new)
  for section, (_, label) in _SECTIONS.items():
    lines += _spec_lines(old.get(section) or {}, new.get(section) or {}, label)
  lines += _constraint_lines(old.get('constraints') or [], new.get('constraints') or [])
  lines += _collective_lines(old.get('collectives') or [], new.get('collectives') or [])
  return lines


def _check(snap: Any, which: str) -> None:
  if not isinstance(snap, dict) or 'version' not in snap:
    raise FitError(
      f'{which} is not a layout snapshot (a dict with a "version", from '
      f'fsm.snapshot); got {type(snap).__name__}.'
    )
  if snap['version'] != VERSION:
    raise FitError(
      f'{which} is a snapshot of version {snap["version"]!r}; this '
      f'flax_shardmeta reads version {VERSION}: record it again '
      '(FLAX_SHARDMETA_UPDATE_SNAPSHOTS=1 with fsm.testing.assert_snapshot).'
    )
  kinds: dict[str, type] = dict.fromkeys([*_SECTIONS, 'mesh'], dict)
  kinds.update(constraints=list, collectives=list)
  for section, kind in kinds.items():
    if not isinstance(snap.get(section, kind()), kind):
      raise FitError(f'{which}[{section!r}] should be a {kind.__name__}.')
  for section, needed in (('constraints', 'spec'), ('collectives', 'kind')):
    if not all(isinstance(r, dict) and needed in r for r in snap.get(section, ())):
      raise FitError(f'{which}[{section!r}] should hold dicts with a {needed!r}.')


def _mesh_lines(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
  lines = []
  if (old.get('mesh') or {}) != (new.get('mesh') or {}):
    lines.append(f'mesh: {_mesh_text(old)} -> {_mesh_text(new)}')
  if old.get('source') != new.get('source'):
    lines.append(f'collectives from: {old.get("source")} -> {new.get("source")}')
  return lines


def _mesh_text(snap: dict[str, Any]) -> str:
  """``data=2, model=4 (Auto, cpu)``."""
  mesh = snap.get('mesh') or {}
  axes = ', '.join(
    f'{n}={s}' for n, s in zip(mesh.get('axis_names', ()), mesh.get('axis_sizes', ()))
  )
  types = '/'.join(sorted(set(mesh.get('axis_types') or ()))) or '?'
  return f'{axes or "no axes"} ({types}, {mesh.get("device_kind") or "abstract"})'


def _spec_lines(old: dict[str, str], new: dict[str, str], label: str) -> list[str]:
  lines = []
  for path in sorted(old.keys() | new.keys()):
    before, after = old.get(path), new.get(path)
    if before is None:
      lines.append(f'new {label} {path}: {after}')
    elif after is None:
      lines.append(f'removed {label} {path}: {before}')
    elif before != after:
      lines.append(f'{path}: {before} -> {after}')
  return lines


def _constraint_lines(
  old: list[dict[str, Any]], new: list[dict[str, Any]]
) -> list[str]:
  """Constraints matched by user line and scope; within one, by spec and shape
  (a helper constraining several values has one line and scope for all)."""
  before, after = _by_place(old), _by_place(new)
  lines = []
  for place in sorted(before.keys() | after.keys()):
    where = f'constraint at {place[0]}' + (f' ({place[1]})' if place[1] else '')
    was, now = before.get(place, {}), after.get(place, {})
    for key in sorted(was.keys() & now.keys()):
      if was[key] != now[key]:
        lines.append(f'{where}: {_layout(key)}: {was[key]} -> {now[key]} times')
    gone = sorted(was.keys() - now.keys())
    came = sorted(now.keys() - was.keys())
    if len(gone) == 1 and len(came) == 1:
      (a,), (b,) = gone, came
      if a[1] == b[1]:  # the same shape: only the spec changed
        lines.append(f'{where}: {a[0]} -> {b[0]}')
      else:
        lines.append(f'{where}: {_layout(a)} -> {_layout(b)}')
      continue
    lines += [f'removed {where}: {_layout(k)}' for k in gone]
    lines += [f'new {where}: {_layout(k)}' for k in came]
  return lines


def _by_place(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[Any, int]]:
  """``(where, scope) -> {(spec, shape): count}``."""
  out: dict[tuple[str, str], dict[Any, int]] = collections.defaultdict(dict)
  for row in rows:
    place = (str(row.get('where', '?')), str(row.get('scope', '')))
    key = (str(row.get('spec')), tuple(row.get('shape') or ()))
    out[place][key] = out[place].get(key, 0) + int(row.get('count', 1))
  return out


def _layout(key: tuple[str, tuple[int, ...]]) -> str:
  spec, shape = key
  return f'{spec} on {list(shape)}'


def _collective_lines(
  old: list[dict[str, Any]], new: list[dict[str, Any]]
) -> list[str]:
  before = {_row_key(r): r for r in _collectives(old)}
  after = {_row_key(r): r for r in _collectives(new)}
  lines = []
  for key in sorted(before.keys() | after.keys(), key=_sort_key):
    was, now = before.get(key), after.get(key)
    if was is None:
      lines.append(f'new {_described(after[key])}')
      continue
    if now is None:
      lines.append(f'removed {_described(was)}')
      continue
    label = _label(now)
    if _bytes_changed(was['bytes'], now['bytes']):
      b, a = format_bytes(was['bytes']), format_bytes(now['bytes'])
      lines.append(f'{label}: {b} -> {a} per step')
    if was['count'] != now['count']:
      lines.append(f'{label}: {was["count"]} -> {now["count"]} times per step')
    if was.get('link') != now.get('link'):
      lines.append(f'{label}: link {was.get("link")} -> {now.get("link")}')
  return lines


def _bytes_changed(before: int, after: int) -> bool:
  return abs(after - before) >= _BYTES_TOLERANCE * max(abs(before), 1)


def _over(row: dict[str, Any]) -> str:
  return f'{row["kind"]} over {"+".join(row["axes"]) or "?"}'


def _label(row: dict[str, Any]) -> str:
  """``all-reduce over model (gradient, params/w, model.py:40)``."""
  told = _told(row)
  return f'{_over(row)} ({", ".join(told)})' if told else _over(row)


def _described(row: dict[str, Any]) -> str:
  """``all-gather over data, 1.20 GiB/step, reason activation, model.py:88``."""
  told = _told(row)
  if row.get('reason'):
    told[0] = f'reason {told[0]}'
  return ', '.join([_over(row), f'{format_bytes(row["bytes"])}/step', *told])


def _told(row: dict[str, Any]) -> list[str]:
  """A row's attribution: its reason, parameters (the first few) and sources."""
  params = list(row.get('parameters') or ())
  if len(params) > 3:
    params = [*params[:3], f'{len(params) - 3} more']
  reason = [row['reason']] if row.get('reason') else []
  return [*reason, *params, *(row.get('sources') or ())]
