"""MaxText's own llama3-8b training step through ``fsm.fit`` and ``report.why()``.

The step is MaxText 0.2.5's, built by its own ``train_compile`` functions for
a v5p-128 pod (64 chips, ``v5p:4x4x4``, ``ici_fsdp_parallelism=64``) compiled
on this CPU through libtpu: the topology mesh (``get_topology_mesh``), the
shaped train state and batch (``get_shaped_inputs``), the Zero-1 and data
shardings, and ``train_step`` with its in/out shardings and the state
donated (``get_functional_train_with_signature``), jitted as
``jit_and_compile`` jits it, under the mesh and MaxText's logical axis rules.
``fsm.fit`` compiles it and ``why()`` says why each collective runs. The
script then checks the attribution against the compiled program itself (its
optimised HLO, read here independently of fsm):

- every all-gather of a weight (a buffer of a parameter's per-layer shape)
  is a ``parameter`` row naming that parameter, as many times and bytes per
  step as the program gathers it;
- every gradient reduction (an all-reduce or reduce-scatter of a parameter's
  shape) is a ``gradient`` row naming that parameter, and the gradient rows
  add up to the parameters' sizes in the dtype the program reduces them in;
- no row's source line is in jax, jaxlib, flax, optax or flax_shardmeta
  (MaxText is the model code here: its lines are the user's);

and prints the share of collective bytes per reason and the whole ``why()``
text. Parameters of one per-layer shape (``wi_0`` / ``wi_1``, ``key`` /
``value``, the norm scales) cannot be told apart by the program's shapes: they
are checked together.

The environment is a venv of its own, outside the repository: MaxText needs
Python >= 3.12 and brings jax 0.12 with some two hundred packages. ``pip
install maxtext==0.2.5`` alone installs no dependencies (they are all in its
extras), and ``maxtext[tpu]`` accepts any newer libtpu, so ``jax[tpu]`` of the
jax it resolved to then pins the libtpu that jax was built with. From the
repository's root (any Python >= 3.12)::

  python3.12 -m venv ~/maxtext-venv
  ~/maxtext-venv/bin/pip install 'maxtext[tpu]==0.2.5'
  ~/maxtext-venv/bin/pip install 'jax[tpu]==0.12.0.1'
  ~/maxtext-venv/bin/pip install -e . --no-deps
  PYTHONPATH=. ~/maxtext-venv/bin/python benchmarks/maxtext_why.py \\
    --out /tmp/maxtext_why.json

Written against maxtext 0.2.5, jax and jaxlib 0.12.0.1, libtpu 0.0.50.1, flax
0.12.12, optax 0.2.8 (the run prints the versions it used). Options:
``--per-device-batch-size`` (4) and ``--seq`` (MaxText's
``max_target_length``, 2048).

The first run compiles the step twice, once in ``fsm.fit`` and once for the
program text the checks read: 1.5 to 4 minutes each on a shared 2-core
machine (3.5 minutes in all, 2.6 GB of memory, when it was least busy). Both
are cached: fit's figures in ``~/.cache/flax_shardmeta/fit`` (or
``$FLAX_SHARDMETA_CACHE``), the program text in
``~/.cache/flax_shardmeta/maxtext_why``, keyed by the lowered program and the
versions. A rerun takes about half a minute, most of it building MaxText's
state; fit attributes its cached program afresh, so a change to the
attribution shows without compiling again (unless fit's cache format changed
with it). The exit status is 1 when a check fails. Not part of CI.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

TOPOLOGY = 'v5p-128'
MODEL = 'llama3-8b'
PACKAGES = (
  'maxtext',
  'jax',
  'jaxlib',
  'libtpu',
  'flax',
  'optax',
  'numpy',
  'flax_shardmeta',
)
# Path parts of library code, as the rows' sources write them (MaxText's own
# files are the model's code here, so they are the user's lines).
LIBRARIES = ('jax', 'jaxlib', 'flax', 'optax')
REASONS = ('parameter', 'gradient', 'routing', 'activation', 'other', '')
GATHERS = ('all-gather', 'all-gather-start')
REDUCTIONS = ('all-reduce', 'all-reduce-start', 'reduce-scatter')
COLLECTIVES = (
  *GATHERS,
  *REDUCTIONS,
  'all-to-all',
  'collective-permute',
  'collective-permute-start',
)
ITEMSIZE = {
  **dict.fromkeys(('pred', 's8', 'u8'), 1),
  **dict.fromkeys(('s16', 'u16', 'f16', 'bf16'), 2),
  **dict.fromkeys(('s32', 'u32', 'f32'), 4),
  **dict.fromkeys(('s64', 'u64', 'f64'), 8),
}


def itemsize(dtype: str) -> int:
  """Bytes per element of an HLO element type (``f8e4m3fn``: 1)."""
  return ITEMSIZE.get(dtype, 1 if dtype.startswith('f8') else 4)


# Building MaxText's step
# ------------------------------------------------------------------------------


@dataclasses.dataclass
class Built:
  """MaxText's jitted train step, its abstract arguments and target."""

  config: Any
  mesh: Any
  jitted: Any
  args: tuple[Any, ...]
  compiler_options: dict[str, Any]


def maxtext_argv(
  per_device_batch: int,
  seq: int,
  extra: Sequence[str] = (),
  model: str = MODEL,
  topology: str = TOPOLOGY,
  parallelism: Sequence[str] = ('ici_fsdp_parallelism=64',),
) -> list[str]:
  """``train_compile``'s command line for the step checked here (``extra``:
  more ``key=value`` settings, e.g. ``remat_policy=minimal``; another
  ``model``, ``topology`` and its ``ici_*_parallelism`` settings)."""
  from maxtext.configs import pyconfig

  out = os.path.join(tempfile.gettempdir(), 'maxtext_why')
  return [
    'train_compile',
    os.path.join(os.path.dirname(pyconfig.__file__), 'base.yml'),
    f'model_name={model}',
    f'compile_topology={topology}',
    'compile_topology_num_slices=1',
    *parallelism,
    f'per_device_batch_size={per_device_batch}',
    f'max_target_length={seq}',
    f'base_output_directory={out}',
    'run_name=maxtext_why',
    # jax's persistent cache cannot read back an executable compiled for a
    # topology without a client: it only writes files and warns.
    'jax_cache_dir=',
    *extra,
  ]


def build_step(
  per_device_batch: int, seq: int, extra: Sequence[str] = (), **step: Any
) -> Built:
  """The step as ``train_compile.main`` builds it, jitted but not compiled
  (``step``: :func:`maxtext_argv`'s model, topology and parallelism)."""
  import jax
  from maxtext.configs import pyconfig
  from maxtext.trainers.pre_train import train, train_compile
  from maxtext.utils import max_utils, maxtext_utils, sharding

  # As train_compile.main sets them before anything else.
  jax.config.update('jax_default_prng_impl', 'unsafe_rbg')
  os.environ['LIBTPU_INIT_ARGS'] = (
    os.environ.get('LIBTPU_INIT_ARGS', '')
    + ' --xla_tpu_spmd_rng_bit_generator_unsafe=true'
  )
  config = pyconfig.initialize(maxtext_argv(per_device_batch, seq, extra, **step))
  train_compile.validate_config(config)
  mesh = train_compile.get_topology_mesh(config)
  args, kwargs, state_shardings, _, model = train_compile.get_shaped_inputs(
    mesh, config
  )
  if kwargs:
    raise SystemExit(f'train_step takes keyword arguments here: {sorted(kwargs)}')
  params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(
    config, state_shardings
  )
  input_shardings = sharding.build_zero1_input_state_mesh_shardings(
    config, state_shardings, params_shardings
  )
  data_sharding = sharding.get_input_data_sharding(config, mesh)
  func, in_shard, out_shard, static_argnums, donate_argnums = (
    maxtext_utils.get_functional_train_with_signature(
      train.train_step,
      data_sharding,
      input_shardings,
      model,
      config,
      params_shardings,
    )
  )
  with maxtext_context(config, mesh):  # as train_compile.jit_and_compile
    jitted = jax.jit(
      func,
      in_shardings=in_shard,
      out_shardings=out_shard,
      static_argnums=static_argnums,
      donate_argnums=donate_argnums,
    )
  options = max_utils.parse_libtpu_flags_to_dict(config.compile_xla_flags)
  return Built(config, mesh, jitted, tuple(args), options)


@contextlib.contextmanager
def maxtext_context(config: Any, mesh: Any) -> Iterator[None]:
  """The mesh and logical axis rules ``jit_and_compile`` lowers under."""
  import jax
  from flax.core.spmd import logical_axis_rules

  with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
    yield


def fit_report(built: Built) -> Any:
  """``fsm.fit`` of the jitted step, under MaxText's mesh and rules."""
  import flax_shardmeta as fsm

  with maxtext_context(built.config, built.mesh):
    return fsm.fit(built.jitted, *built.args)


def _cache_dir() -> Path:
  base = os.environ.get('XDG_CACHE_HOME') or str(Path.home() / '.cache')
  return Path(base) / 'flax_shardmeta' / 'maxtext_why'


def lowered_key(built: Built) -> tuple[Any, str]:
  """The step lowered as ``jit_and_compile`` lowers it, and a cache key of it,
  the versions and MaxText's XLA flags."""
  with maxtext_context(built.config, built.mesh):
    lowered = built.jitted.lower(*built.args)
  h = hashlib.sha256(lowered.as_text().encode())
  for package in ('jax', 'jaxlib', 'libtpu', 'maxtext'):
    h.update(_version(package).encode())
  h.update(repr(sorted(built.compiler_options.items())).encode())
  return lowered, h.hexdigest()


def program_text(built: Built) -> tuple[str, bool]:
  """The compiled step's optimised HLO (compiled here as ``jit_and_compile``
  compiles it, not through fsm), cached by the lowered program and versions;
  and whether it came from the cache."""
  lowered, key = lowered_key(built)
  path = _cache_dir() / f'{key}.hlo.gz'
  try:
    return gzip.decompress(path.read_bytes()).decode(), True
  except (OSError, EOFError, gzip.BadGzipFile):
    pass
  text = lowered.compile(compiler_options=built.compiler_options).as_text()
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix('.tmp')
    tmp.write_bytes(gzip.compress(text.encode()))
    tmp.replace(path)
  except OSError:
    pass
  return text, False


def _version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return '-'


# The parameters
# ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Param:
  """One parameter of the train state: its plan path (as fsm names it: the
  step's argument name first), its shape and the shape of one layer's slice
  (the shape for parameters outside the scanned layers)."""

  path: str
  shape: tuple[int, ...]
  dtype: str
  layer_shape: tuple[int, ...]

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def layer_size(self) -> int:
    return math.prod(self.layer_shape)


def parameters(built: Built) -> list[Param]:
  """The model's ``nnx.Param`` leaves of the state argument."""
  import jax
  from flax import nnx

  state = built.args[0]
  scan_axis = int(built.config.param_scan_axis)
  layers = int(built.config.num_decoder_layers)
  flat = jax.tree_util.tree_flatten_with_path(
    state, is_leaf=lambda x: isinstance(x, nnx.Variable)
  )[0]
  out = []
  for keys, leaf in flat:
    if not isinstance(leaf, nnx.Param):
      continue
    parts = [_key_name(k) for k in keys]
    if parts[:1] != ['model']:
      continue
    value = leaf.get_value() if hasattr(leaf, 'get_value') else leaf.value
    shape = tuple(int(d) for d in value.shape)
    layer_shape = shape
    if 'layers' in parts and len(shape) > scan_axis and shape[scan_axis] == layers:
      layer_shape = shape[:scan_axis] + shape[scan_axis + 1 :]
    out.append(Param('/'.join(['state', *parts]), shape, str(value.dtype), layer_shape))
  return out


def _key_name(k: Any) -> str:
  for attr in ('key', 'name', 'idx'):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


# The compiled program, read independently of fsm
# ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Buffer:
  """One buffer one collective instruction moves: its kind, dtype, dims (the
  full side: a gather's result, a reduction's operand), runs per step."""

  kind: str
  name: str
  dtype: str
  dims: tuple[int, ...]
  runs: int
  op_name: str

  @property
  def bytes(self) -> int:
    return math.prod(self.dims) * itemsize(self.dtype)


_HEADER = re.compile(r'^(?:ENTRY\s+)?%?([^\s(]+)\s*\(')
_INSTRUCTION = re.compile(r'^\s+(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$')
_OP = re.compile(r'\s([a-z][\w\-]*)\(')
_ARRAY = re.compile(r'\b(pred|[suf]\d+|bf16|f8\w*)\[([\d,]*)\]')
_CALLS = re.compile(
  r'\b(body|calls|to_apply|branch_computations|condition)=(\{[^}]*\}|%?[\w.\-]+)'
)


def collective_buffers(text: str) -> list[Buffer]:
  """Every buffer of every collective in the program, with runs per step:
  instructions in a while loop's body run its trip count times (the s32
  bound of its condition), through nested loops and calls."""
  computations: dict[str, list[tuple[str, str]]] = {}
  entry = ''
  current: list[tuple[str, str]] | None = None
  for line in text.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith('{'):
      m = _HEADER.match(line)
      if m:
        current = computations.setdefault(m.group(1), [])
        if line.startswith('ENTRY'):
          entry = m.group(1)
      continue
    m = _INSTRUCTION.match(line)
    if m and current is not None:
      current.append((m.group(1), m.group(2)))
  runs: dict[str, int] = {}

  def visit(name: str, times: int) -> None:
    runs[name] = runs.get(name, 0) + times
    for _, rhs in computations.get(name, ()):
      called = dict(
        (kind, re.findall(r'%?([\w.\-]+)', target.strip('{}')))
        for kind, target in _CALLS.findall(rhs)
      )
      trip = _trip_count(computations, called.get('condition', [''])[0])
      for kind, names in called.items():
        if kind in ('condition', 'to_apply'):
          continue
        for callee in names:
          if callee in computations:
            visit(callee, times * (trip if kind == 'body' else 1))

  visit(entry, 1)
  out = []
  for comp, instructions in computations.items():
    if comp not in runs:
      continue
    for name, rhs in instructions:
      m = _OP.search(' ' + rhs)
      if not m or m.group(1) not in COLLECTIVES:
        continue
      kind = m.group(1)
      result_type = (' ' + rhs)[: m.start()]
      operands = _operands(' ' + rhs, m.end())
      op_name = re.search(r'op_name="([^"]*)"', rhs)
      arrays = _ARRAY.findall(operands if kind == 'reduce-scatter' else result_type)
      if kind.endswith('-start') and len(arrays) > 1:
        arrays = arrays[len(arrays) // 2 :]  # (operands, results): the results
      for dtype, dims in arrays:
        out.append(
          Buffer(
            kind.removesuffix('-start'),
            name,
            dtype,
            tuple(int(d) for d in dims.split(',') if d),
            runs[comp],
            op_name.group(1) if op_name else '',
          )
        )
  return out


def _operands(rhs: str, start: int) -> str:
  depth = 1
  for i in range(start, len(rhs)):
    depth += {'(': 1, ')': -1}.get(rhs[i], 0)
    if depth == 0:
      return rhs[start:i]
  return rhs[start:]


def _trip_count(computations: dict[str, list[tuple[str, str]]], cond: str) -> int:
  bounds = [
    int(m.group(1))
    for _, rhs in computations.get(cond, ())
    for m in [re.match(r's32\[\][^ ]* constant\((\d+)\)', rhs)]
    if m
  ]
  return bounds[0] if len(bounds) == 1 else 1


def shape_class(dims: Sequence[int], params: Sequence[Param]) -> tuple[str, ...]:
  """The parameters whose per-layer shape the buffer has (size-1 dimensions
  aside): in order if any, else in any order; () when none."""
  squeezed = tuple(d for d in dims if d != 1)
  exact = tuple(
    p.path for p in params if tuple(d for d in p.layer_shape if d != 1) == squeezed
  )
  if exact:
    return exact
  return tuple(
    p.path
    for p in params
    if sorted(d for d in p.layer_shape if d != 1) == sorted(squeezed)
  )


# Checks
# ------------------------------------------------------------------------------


@dataclasses.dataclass
class Check:
  name: str
  passed: bool | None  # None: the check itself failed to run
  summary: str
  details: list[str] = dataclasses.field(default_factory=list)
  numbers: dict[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def status(self) -> str:
    return {True: 'PASS', False: 'FAIL', None: 'ERROR'}[self.passed]


def _row_params(row: Any) -> tuple[str, ...]:
  return tuple(getattr(row, 'parameters', ()) or ())


def _row_where(row: Any) -> str:
  sources = ', '.join(getattr(row, 'sources', ()) or ()) or '?'
  scope = getattr(row, 'scope', '') or ''
  return f'{sources} (scope {scope!r})' if scope else f'{sources} (no scope)'


def _row_line(row: Any) -> str:
  what = ', '.join(_row_params(row)) or getattr(row, 'change', '') or '-'
  return (
    f'{row.kind} over {"+".join(row.axes) or "?"}: {row.count} runs, '
    f'{_gib(row.bytes)}, reason {row.reason or "unattributed"!r}, {what}, at '
    f'{_row_where(row)}, {getattr(row, "instructions", "?")} instruction(s)'
  )


def _gib(n: float) -> str:
  return f'{n / 2**30:,.3f} GiB'


def _classes(
  buffers: Sequence[Buffer], params: Sequence[Param], kinds: Sequence[str]
) -> dict[tuple[str, ...], dict[str, Any]]:
  """Per parameter shape class, what the program moves of that shape:
  bytes and runs per step, instructions, dtypes."""
  out: dict[tuple[str, ...], dict[str, Any]] = {}
  for b in buffers:
    if b.kind not in kinds:
      continue
    cls = shape_class(b.dims, params)
    if not cls:
      continue
    entry = out.setdefault(
      cls, {'bytes': 0, 'runs': 0, 'instructions': set(), 'dtypes': set()}
    )
    entry['bytes'] += b.bytes * b.runs
    entry['runs'] += b.runs
    entry['instructions'].add(b.name)
    entry['dtypes'].add(b.dtype)
  return out


def _class_of(paths: Sequence[str], classes: Sequence[tuple[str, ...]]) -> Any:
  for cls in classes:
    if paths and set(paths) <= set(cls):
      return cls
  return None


def _compare_classes(
  name: str,
  reason: str,
  kinds: Sequence[str],
  rows: Sequence[Any],
  buffers: Sequence[Buffer],
  params: Sequence[Param],
) -> tuple[list[str], list[str], dict[str, Any]]:
  """Rows of ``kinds`` against the program's buffers of parameter shapes:
  per class, the bytes and runs the ``reason`` rows give it and those the
  program moves; the rows that name a parameter of another shape; the rows
  of another reason that move a parameter-shaped buffer."""
  by_path = {p.path: p for p in params}
  program = _classes(buffers, params, kinds)
  row_kinds = {k.removesuffix('-start') for k in kinds}
  ours = [r for r in rows if r.reason == reason and r.kind in row_kinds]
  problems, lines = [], []
  told: dict[Any, dict[str, float]] = {}
  for r in ours:
    paths = _row_params(r)
    cls = _class_of(paths, list(program))
    unknown = [p for p in paths if p not in by_path]
    if not paths or unknown:
      problems.append(
        f'{_row_line(r)}: names {"no parameter" if not paths else unknown} '
        '(not a parameter of the state)'
      )
      continue
    if cls is None:
      problems.append(
        f'{_row_line(r)}: the program moves no buffer of the named '
        "parameter's shape with this kind of collective"
      )
      continue
    per_run = r.bytes / max(r.count, 1)
    sizes = {
      by_path[p].layer_size * itemsize(d) for p in paths for d in program[cls]['dtypes']
    }
    if not any(abs(per_run - s) <= 0.001 * s for s in sizes):
      problems.append(
        f'{_row_line(r)}: {per_run:,.0f} bytes per run, but one layer of the '
        f'named parameter is {sorted(sizes)} bytes in {sorted(program[cls]["dtypes"])}'
      )
    entry = told.setdefault(cls, {'bytes': 0.0, 'runs': 0})
    entry['bytes'] += r.bytes
    entry['runs'] += r.count
  for cls, entry in sorted(program.items(), key=lambda kv: -kv[1]['bytes']):
    got = told.get(cls, {'bytes': 0.0, 'runs': 0})
    ok = abs(got['bytes'] - entry['bytes']) <= 0.001 * entry['bytes'] and (
      got['runs'] == entry['runs']
    )
    short = ' / '.join(p.removeprefix('state/model/') for p in cls)
    lines.append(
      f'{"ok  " if ok else "BAD "} {short}: {reason} rows {got["runs"]} runs '
      f'{_gib(got["bytes"])}; the program {entry["runs"]} runs '
      f'{_gib(entry["bytes"])} ({len(entry["instructions"])} instructions, '
      f'{"/".join(sorted(entry["dtypes"]))})'
    )
    if not ok:
      problems.append(
        f'{short}: {reason} rows give {got["runs"]} runs, {_gib(got["bytes"])} per '
        f'step; the program {name}s it {entry["runs"]} times, {_gib(entry["bytes"])}'
      )
  # What rows of another reason carry: no buffer of a parameter's size, and
  # no more than the program moves in buffers of no parameter's shape.
  sizes = {
    p.layer_size * itemsize(d)
    for cls, entry in program.items()
    for p in params
    if p.path in cls
    for d in entry['dtypes']
  }
  others = [r for r in rows if r.kind in row_kinds and r.reason != reason]
  for r in others:
    per_run = r.bytes / max(r.count, 1)
    if any(abs(per_run - s) <= 0.001 * s for s in sizes):
      problems.append(
        f'{_row_line(r)}: {per_run / 2**20:,.2f} MiB per run, one layer of a '
        f'parameter, but not {reason!r}'
      )
  rest = sum(
    b.bytes * b.runs
    for b in buffers
    if b.kind in kinds and not shape_class(b.dims, params)
  )
  carried = sum(r.bytes for r in others)
  lines.append(
    f'rows of {"/".join(sorted(row_kinds))} of other reasons: {_gib(carried)}; the '
    f"program's buffers of these kinds of no parameter's shape: {_gib(rest)}"
  )
  if carried > rest * 1.001 + 1024:
    problems.append(
      f'rows of other reasons carry {_gib(carried - rest)} more than the program '
      "moves in buffers of no parameter's shape: parameter buffers among them: "
      + '; '.join(_row_line(r) for r in sorted(others, key=lambda r: -r.bytes)[:4])
    )
  numbers = {
    'program_bytes': sum(e['bytes'] for e in program.values()),
    'program_runs': sum(e['runs'] for e in program.values()),
    'rows_bytes': sum(r.bytes for r in ours),
    'rows_runs': sum(r.count for r in ours),
  }
  return problems, lines, numbers


def check_parameters(
  rows: Sequence[Any], buffers: Sequence[Buffer], params: Sequence[Param]
) -> Check:
  problems, lines, numbers = _compare_classes(
    'gather', 'parameter', GATHERS, rows, buffers, params
  )
  named = {p for r in rows if r.reason == 'parameter' for p in _row_params(r)}
  sharded = {
    p.path
    for p in params
    for cls in _classes(buffers, params, GATHERS)
    if p.path in cls
  }
  missing = sorted(sharded - named)
  if missing:
    problems.append(f'gathered by the program but named by no parameter row: {missing}')
  summary = (
    f'weight all-gathers: parameter rows {numbers["rows_runs"]} runs '
    f'{_gib(numbers["rows_bytes"])}; the program gathers weights '
    f'{numbers["program_runs"]} times, {_gib(numbers["program_bytes"])}'
  )
  return Check(
    'weight all-gathers are parameter rows of the right path',
    not problems,
    summary,
    lines + [f'problem: {p}' for p in problems],
    numbers,
  )


def check_gradients(
  rows: Sequence[Any], buffers: Sequence[Buffer], params: Sequence[Param]
) -> Check:
  problems, lines, numbers = _compare_classes(
    'reduce', 'gradient', REDUCTIONS, rows, buffers, params
  )
  program = _classes(buffers, params, REDUCTIONS)
  dtypes = {p: entry['dtypes'] for cls, entry in program.items() for p in cls}
  reduced = [p for p in params if p.path in dtypes]
  not_reduced = [p for p in params if p.path not in dtypes]
  mixed = {p.path: sorted(dtypes[p.path]) for p in reduced if len(dtypes[p.path]) > 1}
  if mixed:
    lines.append(f'reduced in more than one dtype (counted at the widest): {mixed}')
  named = {p for r in rows if r.reason == 'gradient' for p in _row_params(r)}
  missing = sorted(p.path for p in reduced if p.path not in named)
  if missing:
    problems.append(f'reduced by the program but named by no gradient row: {missing}')
  expected = sum(p.size * max(itemsize(d) for d in dtypes[p.path]) for p in reduced)
  dominant = max(
    (d for p in reduced for d in dtypes[p.path]),
    key=lambda d: sum(p.size for p in reduced if d in dtypes[p.path]),
    default='f32',
  )
  everything = expected + sum(p.size * itemsize(dominant) for p in not_reduced)
  got = numbers['rows_bytes']
  ratio = got / expected if expected else float('nan')
  if not (0.999 <= ratio <= 1.001):
    problems.append(
      f'gradient rows {got:,.0f} B against {expected:,.0f} B of the reduced '
      f'parameters (ratio {ratio:.4f})'
    )
  lines += [
    f'gradient rows: {got:,.0f} B ({_gib(got)}) per chip per step',
    f'parameters whose gradient the program reduces ({len(reduced)} of '
    f'{len(params)}), each at the dtype it is reduced in '
    f'({", ".join(sorted({d for s in dtypes.values() for d in s}))}): '
    f'{expected:,.0f} B ({_gib(expected)}); ratio {ratio:.4f}',
    f'all {len(params)} parameters at {dominant}: {everything:,.0f} B '
    f'({_gib(everything)}); ratio {got / everything if everything else 0:.4f}',
  ]
  if not_reduced:
    lines.append(
      'no all-reduce or reduce-scatter of their shape in the program (their '
      'gradient needs none): ' + ', '.join(f'{p.path} {p.shape}' for p in not_reduced)
    )
  numbers = dict(
    numbers,
    gradient_rows_bytes=got,
    reduced_parameter_bytes=expected,
    all_parameter_bytes=everything,
    ratio=ratio,
    reduced_dtypes={p: sorted(d) for p, d in dtypes.items()},
    not_reduced=[p.path for p in not_reduced],
  )
  summary = (
    f'gradient rows {_gib(got)} vs reduced parameters at their reduced dtype '
    f'{_gib(expected)} (ratio {ratio:.4f})'
  )
  return Check(
    'gradient reductions are gradient rows of the right path, bytes add up',
    not problems,
    summary,
    lines + [f'problem: {p}' for p in problems],
    numbers,
  )


def library_source(source: str) -> bool:
  """Whether a ``file:line`` is in jax, jaxlib, flax, optax or flax_shardmeta's
  own modules (its examples are user code)."""
  parts = source.rsplit(':', 1)[0].replace(os.sep, '/').split('/')
  if any(p in LIBRARIES for p in parts):
    return True
  for i, p in enumerate(parts[:-1]):
    if p == 'flax_shardmeta' and (
      parts[i + 1].startswith('_') or parts[i + 1] == 'cli'
    ):
      return True
  return False


def check_sources(rows: Sequence[Any]) -> Check:
  bad = [r for r in rows if any(library_source(s) for s in r.sources)]
  none = [r for r in rows if not r.sources]
  lines = [f'library line: {_row_line(r)}' for r in bad]
  lines += [f'no source: {_row_line(r)}' for r in none]
  files = sorted({s.rsplit(':', 1)[0] for r in rows for s in r.sources})
  lines.append(f'source files named: {", ".join(files)}')
  summary = (
    f'{len(bad)} of {len(rows)} rows name a library line; '
    f'{len(none)} rows have no source'
  )
  return Check(
    'no row names a jax/flax/optax/flax_shardmeta line',
    not bad,
    summary,
    lines,
    {'library_rows': len(bad), 'rows_without_source': len(none)},
  )


def run_check(fn: Callable[..., Check], *args: Any) -> Check:
  """A check; one that raises (the report changed form) is an ERROR, not a crash."""
  try:
    return fn(*args)
  except Exception as e:  # noqa: BLE001 (reported, the other checks still run)
    return Check(
      fn.__name__, None, f'{type(e).__name__}: {e}', traceback.format_exc().splitlines()
    )


# Output
# ------------------------------------------------------------------------------


def shares(rows: Sequence[Any]) -> list[dict[str, Any]]:
  total = sum(r.bytes for r in rows) or 1
  out = []
  for reason in REASONS:
    mine = [r for r in rows if r.reason == reason]
    if not mine and reason == '':
      continue
    out.append(
      {
        'reason': reason or 'unattributed',
        'bytes': int(sum(r.bytes for r in mine)),
        'share': sum(r.bytes for r in mine) / total,
        'collectives': sum(r.count for r in mine),
        'rows': len(mine),
      }
    )
  others = [r for r in rows if r.reason not in REASONS]
  if others:
    out.append(
      {
        'reason': 'other reasons: ' + ', '.join(sorted({r.reason for r in others})),
        'bytes': int(sum(r.bytes for r in others)),
        'share': sum(r.bytes for r in others) / total,
        'collectives': sum(r.count for r in others),
        'rows': len(others),
      }
    )
  return out


def share_table(table: Sequence[dict[str, Any]]) -> str:
  lines = [
    '| reason | bytes per chip per step | share | collectives per step | rows |',
    '| --- | ---: | ---: | ---: | ---: |',
  ]
  for t in table:
    lines.append(
      f'| {t["reason"]} | {_gib(t["bytes"])} | {100 * t["share"]:.1f}% | '
      f'{t["collectives"]:,} | {t["rows"]} |'
    )
  total = sum(t['bytes'] for t in table)
  lines.append(
    f'| all | {_gib(total)} | 100% | {sum(t["collectives"] for t in table):,} | '
    f'{sum(t["rows"] for t in table)} |'
  )
  return '\n'.join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', help='write the results as JSON to this file')
  parser.add_argument('--per-device-batch-size', type=int, default=4)
  parser.add_argument('--seq', type=int, default=2048, help='max_target_length')
  a = parser.parse_args(argv)
  start = time.perf_counter()
  timings: dict[str, float] = {}

  def lap(name: str, since: float) -> float:
    now = time.perf_counter()
    timings[name] = round(now - since, 1)
    return now

  t = time.perf_counter()
  built = build_step(a.per_device_batch_size, a.seq)
  t = lap('build', t)
  report = fit_report(built)
  t = lap('fit', t)
  text, hlo_cached = program_text(built)
  t = lap('program_text', t)
  params = parameters(built)
  buffers = collective_buffers(text)
  rows = list(report.collectives)
  versions = {p: _version(p) for p in PACKAGES}
  versions['python'] = platform.python_version()

  mesh = {k: v for k, v in report.mesh.items() if v > 1}
  compiled = (
    'cached figures' if report.cached else f'compiled in {report.compile_seconds:.0f} s'
  )
  print(
    f'MaxText {versions["maxtext"]} {MODEL} train step on {TOPOLOGY} '
    f'({report.devices}), mesh {mesh}, '
    f'per_device_batch_size={a.per_device_batch_size}, max_target_length={a.seq}, '
    f'remat_policy={built.config.remat_policy}'
  )
  print('versions: ' + ', '.join(f'{k} {v}' for k, v in versions.items()))
  print(
    f'fsm.fit: {compiled}'
    f'; program read {"from the cache" if hlo_cached else "after compiling it again"}; '
    f'{len(params)} parameters, {len(buffers)} collective buffers in the program, '
    f'{len(rows)} report rows'
  )
  print(f'peak per chip {_gib(report.total_bytes)} of {_gib(report.hbm_bytes or 0)}')
  print()
  why = report.why(top=max(8, len(rows)))
  print(why)
  print()
  table = shares(rows)
  print('Share of collective bytes per reason (per chip, per step):')
  print()
  print(share_table(table))
  print()
  checks = [
    run_check(check_parameters, rows, buffers, params),
    run_check(check_gradients, rows, buffers, params),
    run_check(check_sources, rows),
  ]
  for c in checks:
    print(f'{c.status}: {c.name}: {c.summary}')
    for line in c.details:
      print(f'  {line}')
  lap('checks', t)
  timings['total'] = round(time.perf_counter() - start, 1)
  print()
  print(
    'seconds: '
    + ', '.join(f'{k} {v}' for k, v in timings.items())
    + f' (fit compiled for {report.compile_seconds:.0f} s)'
  )
  if a.out:
    result = {
      'model': MODEL,
      'topology': TOPOLOGY,
      'maxtext_argv': maxtext_argv(a.per_device_batch_size, a.seq)[2:],
      'versions': versions,
      'machine': {'nproc': os.cpu_count(), 'load': os.getloadavg()},
      'seconds': timings,
      'fit_compile_seconds': report.compile_seconds,
      'fit_cached': report.cached,
      'program_cached': hlo_cached,
      'why': why,
      'shares': table,
      'share_table': share_table(table),
      'checks': [
        {
          'name': c.name,
          'status': c.status,
          'summary': c.summary,
          'details': c.details,
          'numbers': c.numbers,
        }
        for c in checks
      ],
      'parameters': [dataclasses.asdict(p) for p in params],
      'program_collectives': [
        dict(dataclasses.asdict(b), bytes=b.bytes) for b in buffers
      ],
      'report': report.to_dict(),
    }
    Path(a.out).write_text(json.dumps(result, indent=1, default=_jsonable))
    print(f'wrote {a.out}')
  return 0 if all(c.passed for c in checks) else 1


def _jsonable(x: Any) -> Any:
  if isinstance(x, (set, frozenset, tuple)):
    return sorted(x) if isinstance(x, (set, frozenset)) else list(x)
  return str(x)


if __name__ == '__main__':
  sys.exit(main())
