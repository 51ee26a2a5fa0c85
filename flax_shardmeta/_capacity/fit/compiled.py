"""Compiling a step and reading the compiled program's own figures.

XLA's ``memory_analysis()`` and ``cost_analysis()``, the bytes of each input
as the compiled program holds it (its input shardings: an argument the step
never reads is dropped by jax and holds nothing), and the optimised HLO
(collectives, loops, work). When the compiler refuses the program for lack
of memory, its message is the verdict. Figures are cached by the lowered
program (``_capacity.fit.figure_cache``) unless ``fit(..., cache=False)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from flax_shardmeta._arrays import is_key, shard_bytes
from flax_shardmeta._capacity import vocabulary as vocab
from flax_shardmeta._capacity.fit import figure_cache as cache_lib, usable
from flax_shardmeta._capacity.fit.compiled_figures import CompiledFigures
from flax_shardmeta._capacity.fit.host_memory import (
  given_hosts,
  on_host,
  output_leaves,
  split_host,
)
from flax_shardmeta._capacity.fit.traced_step import (
  Arguments,
  Step,
  input_shardings,
  jit_shardings,
  path_category,
)
from flax_shardmeta._capacity.hlo import attribution as hlo_attribution, summary as hlo
from flax_shardmeta._capacity.why.layout_changes import LayoutChange, layout_changes
from flax_shardmeta._capacity.why.traced_lines import TracedLines, lines_of_trace
from flax_shardmeta._errors import FitError, IndivisibleDimensionWarning, message
from flax_shardmeta._frames import source_line
from flax_shardmeta._programs import compiled_text, hlo_text
from flax_shardmeta._programs.memory import memory_fields

_REFUSAL = re.compile(
  r'(?:required for HLO temporaries|Used)\s*\(?([0-9.]+)\s*([KMGT]?)i?B?\)?'
  r'.*?(?:available HBM|of)\s*\(?([0-9.]+)\s*([KMGT]?)i?B?\)?',
  re.S,
)
# Bumped when the cached figures change form: older entries are not read.
_FIGURES_FORMAT = 'figures-8'
_UNIT = {'': 1, 'K': 1 << 10, 'M': 1 << 20, 'G': 1 << 30, 'T': 1 << 40}


def parse_refusal(message: str) -> vocab.Refusal | None:
  """The compiler's required and available bytes from an out-of-memory error.

  Example:
    >>> r = parse_refusal('RESOURCE_EXHAUSTED: Ran out of memory on HBM, the '
    ...   'total memory required for HLO temporaries (115.85G) exceeds available '
    ...   'HBM (95.74G).')
    >>> round(r.required_bytes / 2**30, 2), round(r.available_bytes / 2**30, 2)
    (115.85, 95.74)
  """
  if 'RESOURCE_EXHAUSTED' not in message and 'Ran out of memory' not in message:
    return None
  first = message.strip().split('\n')[0]
  m = _REFUSAL.search(first)
  if m is None:
    return vocab.Refusal(0, 0, first)
  need = float(m.group(1)) * _UNIT[m.group(2)]
  have = float(m.group(3)) * _UNIT[m.group(4)]
  return vocab.Refusal(int(need), int(have), first)


def _compile(
  lowered: Any, limit: int | None
) -> tuple[Any, vocab.Refusal | None, float, dict[str, Any]]:
  """Compiles (for GPUs, for the memory a run hands XLA: ``limit``); the
  compiled program, or the refusal, the seconds, and what the compiler said
  of its own rematerialization and budget."""
  start = time.perf_counter()
  planned: dict[str, Any] = {'budget': limit, 'retargeted': False}
  try:
    with _stderr_lines() as said:
      if limit is None:
        compiled = lowered.compile()
      else:
        compiled, planned['retargeted'], planned['cublas_matmuls'] = (
          usable.compile_for_memory(lowered, limit)
        )
  except Exception as e:  # jax's JaxRuntimeError (XlaRuntimeError before)
    refusal = parse_refusal(str(e))
    if refusal is None:
      raise FitError(
        f'the compiler failed on the step (not for lack of memory): '
        f'{str(e).strip().splitlines()[0]}'
      ) from e
    return None, refusal, time.perf_counter() - start, planned
  planned.update(remat_said(said))
  return compiled, None, time.perf_counter() - start, planned


_REMAT_LINE = re.compile(
  r"Can't reduce memory use below .*?\((\d+) bytes\).*?only reduced to .*?"
  r'\((\d+) bytes\).*?down from .*?\((\d+) bytes\)'
)


# What the report tells itself, so not passed on: rematerialization, and the
# GPU scheduler's complaint when the arguments alone exceed its budget.
_TOLD = re.compile(
  r"Can't reduce memory use below|input/output arguments .* exceeds the base limit"
)


def remat_said(lines: Sequence[str]) -> dict[str, Any]:
  """What XLA's rematerialization logged: the target it missed, what it
  reached and where it started (bytes), when it says so.

  Example:
    >>> remat_said(["W hlo_rematerialization.cc:3231] Can't reduce memory use "
    ...   'below 18.25GiB (19597518118 bytes) by rematerialization; only reduced '
    ...   'to 26.62GiB (28586803392 bytes), down from 45.09GiB (48411443392 '
    ...   'bytes) originally'])['remat_saved_bytes']
    19824640000
  """
  for line in lines:
    m = _REMAT_LINE.search(line)
    if m:
      target, reached, before = (int(g) for g in m.groups())
      return {
        'remat_target_bytes': target,
        'remat_reached_bytes': reached,
        'remat_saved_bytes': before - reached,
        'remat_message': line[line.index("Can't") :].strip(),
      }
  return {}


@contextlib.contextmanager
def _stderr_lines() -> Iterator[list[str]]:
  """What the compiler's C++ logging writes to the process's stderr while
  compiling, as lines; passed on afterwards, but for the lines the report
  itself tells (rematerialization)."""
  lines: list[str] = []
  try:
    sys.stderr.flush()
    saved = os.dup(2)
  except (OSError, ValueError):  # no real stderr (embedded): nothing to read
    yield lines
    return
  with tempfile.TemporaryFile() as sink:
    os.dup2(sink.fileno(), 2)
    try:
      yield lines
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      sink.seek(0)
      text = sink.read().decode(errors='replace')
      lines.extend(text.splitlines())
      rest = [ln for ln in lines if not _TOLD.search(ln)]
      if rest:
        sys.stderr.write('\n'.join(rest) + '\n')


def _memory(compiled: Any) -> dict[str, int]:
  fields = memory_fields(compiled)
  if fields is None:  # no figures is no verdict, not a program of 0 bytes
    raise FitError(
      "this backend's compiler gives no memory analysis of the step; fit it on "
      "a TPU topology (fsm.make_mesh(..., topology='v5p:2x2x1')) or estimate it "
      'on a jax.sharding.AbstractMesh.'
    )
  return fields


def _cost(compiled: Any) -> dict[str, float]:
  try:
    cost = compiled.cost_analysis()
  except Exception:  # some backends have none; the report says so
    cost = None
  if isinstance(cost, (list, tuple)):  # older jax: one dict per program
    cost = cost[0] if cost else {}
  if not cost:
    cost = cost_model(compiled)
  return {str(k): float(v) for k, v in (cost or {}).items()}


def cost_model(compiled: Any) -> dict[str, float]:
  """XLA's cost model over the optimised program, run by the CPU client.

  A program compiled for GPUs this machine does not have gives no
  ``cost_analysis()`` (None): its executable cannot run here. The same
  analysis XLA's clients run (HloCostAnalysis: flops, bytes accessed,
  transcendentals) takes the optimised module from any client, here the CPU
  one. Private jax API, so guarded: without it the report has no flops and
  says so.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    >>> c = jax.jit(lambda a: a @ a).lower(x).compile()
    >>> cost_model(c)['flops']
    524288.0
  """
  try:
    from jax._src import lib as jax_lib, xla_bridge

    _jax = getattr(jax_lib, '_jax')  # noqa: B009 (private: not in its exports)
    module = compiled.runtime_executable().hlo_modules()[0]
    cost = _jax.hlo_module_cost_analysis(xla_bridge.get_backend('cpu'), module)
  except Exception:  # jax moved it: no flops rather than no report
    return {}
  return {str(k): float(v) for k, v in dict(cost).items()}


def input_bytes(compiled: Any) -> list[tuple[str, int, bool, list[int], bool]]:
  """``(path, bytes per device, is a key array, global shape, in host
  memory)`` of each input leaf, as the compiled program holds it, in
  ``jax.tree.leaves`` order over the positional arguments.

  An argument jax dropped because the step never reads it has no sharding
  (``None``) and holds nothing; a key array holds its key data.
  """
  shardings = jax.tree_util.tree_leaves(
    compiled.input_shardings[0], is_leaf=lambda x: x is None
  )
  avals, _ = jax.tree_util.tree_flatten_with_path(compiled.in_avals[0])
  out = []
  for (path, aval), sharding in zip(avals, shardings):
    size = 0 if sharding is None else shard_bytes(aval.shape, aval.dtype, sharding)
    shape = [int(d) for d in getattr(aval, 'shape', ())]
    out.append(
      (jax.tree_util.keystr(path), size, is_key(aval.dtype), shape, on_host(sharding))
    )
  return out


def figures(
  target: Step, arguments: Arguments, use_cache: bool, limit: int | None = None
) -> CompiledFigures:
  """Compiles (or reads the cache) and returns the program's figures.

  The cache keeps XLA's own figures and the optimised HLO text; the HLO is
  read again by this version's reader, so cached collectives and loop counts
  are never those of an older one. Without ``use_cache`` nothing is read
  from or kept in the cache, in memory or on disk. With ``limit`` (GPUs),
  the program is compiled as a real run's compiler would plan it, for that
  much device memory (``usable.compile_for_memory``); each limit is its own
  cache entry. The key is the program without its source locations: a
  second script fitting the same program reads the first one's entry, with
  the cached program's lines moved to its own (``source_map``).
  """
  from flax_shardmeta._programs import source_map

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always', IndivisibleDimensionWarning)
    traced, lowered = target.trace_and_lower(*arguments.lowered)
  for w in caught:  # the rest are the caller's, as if not caught here
    if not issubclass(w.category, IndivisibleDimensionWarning):
      warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
  mesh = target.mesh
  key, lines = None, None
  if use_cache:
    # Without the source locations (jax's name stacks stay): the same program
    # from another script, or moved in its file, is the same entry; its lines
    # are this lowering's, read from it op by op.
    program, lines = source_map.read(lowered.as_text(debug_info=True))
    key = cache_lib.key(program, mesh.devices, extra=f'{_FIGURES_FORMAT} limit={limit}')
  found = cache_lib.load(key, on_disk=True) if key is not None else None
  cached = found is not None
  text = None
  if found is not None and 'refusal' not in found:
    text = cache_lib.load_text(key, on_disk=True) if key is not None else None
    if text is None:  # a cache entry without its program: compile again
      cache_lib.forget(key or '')
      found, cached = None, False
    elif lines is not None:
      # The cached program names the lines of the script that compiled it.
      text = source_map.relocate(text, found.get('lines'), lines)
  computations = None
  if found is None:
    found, text, computations = _compiled_figures(lowered, limit)
    if key is not None:
      if text is not None:
        cache_lib.store_text(key, text, on_disk=True)
        if lines is not None:
          found = dict(found, lines=lines.to_json())
      cache_lib.store(key, found, on_disk=True)
  out = dict(found)
  out.pop('lines', None)  # only the cache reads them
  if text is not None:
    if computations is None:
      computations = hlo_text.parse(text)
    why = attributor(
      text,
      computations,
      arguments,
      out.get('input_bytes', []),
      target.names,
      out.get('outputs'),
      _layout_changes(target, arguments, traced),
      lines_of_trace(traced),
    )
    summary = hlo.summarize_computations(
      computations, mesh.devices, mesh.axis_names, why
    )
    out['summary'] = summary.to_dict()
  if 'memory' in out:
    out['input_bytes'], out['device_memory'], out['host_notes'] = split_host(
      out,
      arguments.on_host,
      given_hosts(jit_shardings(target.step, 'out'), traced),
      hlo_text.output_aliases(text) if text else {},
    )
  out['cached'] = cached
  out['replicated'] = [
    message(w.message)  # without its errors page line: report.why() lists it
    for w in caught
    if issubclass(w.category, IndivisibleDimensionWarning)
  ]
  out['compile_seconds'] = 0.0 if cached else out['seconds']
  return CompiledFigures.of(out)


def attributor(
  text: str,
  computations: dict[str, Any],
  arguments: Arguments,
  inputs: list[list[Any]],
  names: Sequence[str] = (),
  outputs: list[list[Any]] | None = None,
  changes: Sequence[LayoutChange] = (),
  lines: TracedLines | None = None,
) -> hlo_attribution.Attributor:
  """What tells each collective's reason: the program's parameters as plan
  paths and report categories, its source lines, which outputs are the new
  values of which parameters (donated, or at the same path of the step's
  output tree), and the layout changes its constraints ask for."""
  if len(inputs) == len(arguments.categories):
    categories = list(arguments.categories)
  else:
    categories = [path_category(leaf[0], leaf[2]) for leaf in inputs]
  # jax drops arguments the step never reads: they hold nothing and are no
  # parameter of the program.
  kept = [
    (hlo_attribution.plan_path(leaf[0], names), category)
    for leaf, category in zip(inputs, categories)
    if leaf[1] > 0
  ]
  shapes = [tuple(leaf[3]) for leaf in inputs if leaf[1] > 0]
  main = hlo_text.entry(computations)
  n_params = sum(1 for i in main.instructions if i.opcode == 'parameter') if main else 0
  known = len(kept) == n_params
  return hlo_attribution.Attributor(
    computations,
    kept if known else [],
    hlo_text.stack_frames(text),
    hlo_text.output_aliases(text),
    shapes if len(shapes) == n_params else [],
    _new_values(inputs, categories, outputs, main) if known else None,
    changes,
    lines.kept([leaf[1] > 0 for leaf in inputs]) if lines is not None else None,
  )


def _layout_changes(
  target: Step, arguments: Arguments, traced: Any
) -> list[LayoutChange]:
  """The layout changes the step's constraints ask for (from this trace, so
  with this script's lines even when the program came from the cache)."""
  mesh = target.mesh
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  specs = []
  for sharding in input_shardings(target, arguments.lowered):
    spec = getattr(sharding, 'spec', None)
    specs.append(None if spec is None else tuple(spec))
  jaxpr = traced.jaxpr.jaxpr
  if len(specs) != len(jaxpr.invars):
    specs = [None] * len(jaxpr.invars)
  try:
    return layout_changes(
      jaxpr, [_padded(s, v) for s, v in zip(specs, jaxpr.invars)], sizes, source_line
    )
  except Exception:  # a program this reading does not know: no changes told
    return []


def _padded(spec: tuple[Any, ...] | None, var: Any) -> tuple[Any, ...] | None:
  rank = len(getattr(var.aval, 'shape', ()))
  if spec is None or len(spec) > rank:
    return None
  return spec + (None,) * (rank - len(spec))


def _new_values(
  inputs: list[list[Any]],
  categories: Sequence[str],
  outputs: list[list[Any]] | None,
  main: Any,
) -> dict[int, int] | None:
  """Output position -> entry parameter number, for outputs at the path of a
  parameter or optimizer-state argument (``[0].params['w']`` returned as
  ``[0].params['w']``, or as ``.params['w']`` by a step returning only its
  state), of the same shape; None when the outputs cannot be told."""
  root = main.instructions[-1] if main is not None and main.instructions else None
  arity = len(root.operands) if root is not None and root.opcode == 'tuple' else 1
  if outputs is None or len(outputs) != arity:
    return None
  numbers: dict[tuple[str, tuple[int, ...]], list[int]] = {}
  number = 0
  for leaf, category in zip(inputs, categories):
    if leaf[1] <= 0:
      continue
    if category in (vocab.PARAMETERS, vocab.OPTIMIZER, vocab.INPUTS):
      numbers.setdefault((_tail(leaf[0]), tuple(leaf[3])), []).append(number)
    number += 1
  found = {}
  for position, (path, shape) in enumerate(outputs):
    match = numbers.get((_tail(path), tuple(shape)), [])
    if len(match) == 1:
      found[position] = match[0]
  return found


def _tail(keystr: str) -> str:
  """A leaf's path without the argument (or output) it is in:
  ``"[0].params['w']"`` -> ``".params['w']"``."""
  return re.sub(r'^\[\d+\]', '', keystr)


def output_paths(compiled: Any) -> list[list[Any]]:
  """``(path, global shape)`` of each output leaf of a compiled step."""
  try:
    leaves, _ = jax.tree_util.tree_flatten_with_path(compiled.out_info)
  except Exception:  # an older jax without out_info: outputs unknown
    return []
  return [
    [jax.tree_util.keystr(path), [int(d) for d in getattr(info, 'shape', ())]]
    for path, info in leaves
  ]


def _compiled_figures(
  lowered: Any, limit: int | None
) -> tuple[dict[str, Any], str | None, dict[str, Any] | None]:
  """Compiles: the figures to cache, the HLO text and its parse (None when
  the compiler refused the program)."""
  compiled, refusal, seconds, planned = _compile(lowered, limit)
  if refusal is not None:
    found = {'refusal': dataclasses.asdict(refusal), 'seconds': seconds}
    return dict(found, planned=planned), None, None
  text = compiled_text.program_text(compiled)
  computations = hlo_text.parse(text)
  planned['remat_instructions'] = compiled_text.rematerialized(text)
  found = {
    'memory': _memory(compiled),
    'cost': _cost(compiled),
    'input_bytes': input_bytes(compiled),
    'outputs': output_paths(compiled),
    'output_bytes': output_leaves(compiled),
    'seconds': seconds,
    # Where the text reader disagrees with XLA's own module objects: kept with
    # the figures, so a cached report says so too.
    'reader': compiled_text.disagreements(computations, compiled),
    'planned': planned,
  }
  return found, text, computations
