"""Compiling a step and reading the compiled program's own figures.

XLA's ``memory_analysis()`` and ``cost_analysis()``, the bytes of each input
as the compiled program holds it (its input shardings: an argument the step
never reads is dropped by jax and holds nothing), and the optimised HLO
(collectives, loops, work). When the compiler refuses the program for lack
of memory, its message is the verdict. Figures are cached by the lowered
program (``_capacity.fit.figure_cache``) unless ``fit(..., cache=False)``.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Sequence
from typing import Any

import jax

from flax_shardmeta._arrays import is_key, shard_bytes
from flax_shardmeta._capacity import vocabulary as vocab
from flax_shardmeta._capacity.fit import figure_cache as cache_lib
from flax_shardmeta._capacity.fit.compiled_figures import CompiledFigures
from flax_shardmeta._capacity.fit.compiling import compile_step
from flax_shardmeta._capacity.fit.host_memory import (
  given_hosts,
  on_host,
  output_leaves,
  split_host,
)
from flax_shardmeta._capacity.fit.offload import OffloadAsks, offload_asks
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

# Bumped when the cached figures change form: older entries are not read.
_FIGURES_FORMAT = 'figures-9'


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
  found, text, peak_text = _from_cache(key, lines)
  cached = found is not None
  computations = None
  if found is None:
    found, text, computations, peak_text = _compiled_figures(lowered, limit)
    if key is not None:
      if text is not None:
        cache_lib.store_text(key, text, on_disk=True)
        if peak_text is not None:
          cache_lib.store_text(f'{key}-buffers', peak_text, on_disk=True)
        if lines is not None:
          found = dict(found, lines=lines.to_json())
      cache_lib.store(key, found, on_disk=True)
  out = dict(found)
  out.pop('lines', None)  # only the cache reads them
  if text is not None:
    if computations is None:
      computations = hlo_text.parse(text)

    def reader(program: str, parsed: dict[str, Any]) -> hlo_attribution.Attributor:
      changes = _layout_changes(target, arguments, traced)
      inputs, outputs = out.get('input_bytes', []), out.get('outputs')
      return attributor(
        program, parsed, arguments, inputs, target.names, outputs, changes,
        lines_of_trace(traced), _input_specs(target, arguments),
      )  # fmt: skip

    why = reader(text, computations)
    summary = hlo.summarize_computations(
      computations, mesh.devices, mesh.axis_names, why
    )
    out['summary'] = summary.to_dict()
    # What holds the peak reads the program as why does: the program the
    # buffer assignment is of, where that is not as_text()'s.
    out['attributor'] = (
      why if peak_text is None else reader(peak_text, hlo_text.parse(peak_text))
    )
    out['aliases'] = hlo_text.output_aliases(text)
  if 'memory' in out:
    out['input_bytes'], out['device_memory'], out['host_notes'] = split_host(
      out,
      arguments.on_host,
      given_hosts(jit_shardings(target.step, 'out'), traced),
      hlo_text.output_aliases(text) if text else {},
    )
  out['offload'] = _offload_asks(traced)
  out['cached'] = cached
  out['replicated'] = [
    message(w.message)  # without its errors page line: report.why() lists it
    for w in caught
    if issubclass(w.category, IndivisibleDimensionWarning)
  ]
  out['compile_seconds'] = 0.0 if cached else out['seconds']
  return CompiledFigures.of(out)


def _offload_asks(traced: Any) -> OffloadAsks | None:
  """What the traced step's remat policies offload (None: unreadable)."""
  try:
    return offload_asks(traced.jaxpr.jaxpr)
  except Exception:  # noqa: BLE001 - only the offload check is lost
    return None


def _from_cache(
  key: str | None, lines: Any
) -> tuple[dict[str, Any] | None, str | None, str | None]:
  """A cached compile: its figures, its program and the dumped program its
  buffer assignment is of (where that is another), moved to this script's
  lines; ``(None, None, None)`` when there is none to read."""
  from flax_shardmeta._programs import source_map

  found = cache_lib.load(key, on_disk=True) if key is not None else None
  if found is None or key is None or 'refusal' in found:
    return found, None, None
  text = cache_lib.load_text(key, on_disk=True)
  if text is None:  # a cache entry without its program: compile again
    cache_lib.forget(key)
    return None, None, None
  peak_text = None
  if found.get('buffers_program'):
    peak_text = cache_lib.load_text(f'{key}-buffers', on_disk=True)
  if lines is not None:  # the cached program names the lines of its script
    text = source_map.relocate(text, found.get('lines'), lines)
    if peak_text is not None:
      peak_text = source_map.relocate(peak_text, found.get('lines'), lines)
  return found, text, peak_text


def attributor(
  text: str,
  computations: dict[str, Any],
  arguments: Arguments,
  inputs: list[list[Any]],
  names: Sequence[str] = (),
  outputs: list[list[Any]] | None = None,
  changes: Sequence[LayoutChange] = (),
  lines: TracedLines | None = None,
  specs: Sequence[Any] = (),
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
    [s for s, leaf in zip(specs, inputs) if leaf[1] > 0]
    if len(specs) == len(inputs)
    else [],
  )


def _input_specs(target: Step, arguments: Arguments) -> list[Any]:
  """Per input of the step, the mesh axes of each dimension of its layout
  (None where it has no ``PartitionSpec``)."""
  out = []
  for sharding in input_shardings(target, arguments.lowered):
    spec = getattr(sharding, 'spec', None)
    if spec is None:
      out.append(None)
      continue
    dims = []
    for entry in tuple(spec):
      named = entry if isinstance(entry, tuple) else (entry,)
      dims.append(tuple(a for a in named if isinstance(a, str)))
    out.append(tuple(dims))
  return out


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
) -> tuple[dict[str, Any], str | None, dict[str, Any] | None, str | None]:
  """Compiles: the figures to cache, the HLO text and its parse (None when
  the compiler refused the program), and the dumped program its buffer
  assignment is of where that is another text (None where it is the same)."""
  made = compile_step(lowered, limit)
  compiled, refusal, seconds, planned, buffers = (
    made.program,
    made.refusal,
    made.seconds,
    made.planned,
    made.buffers,
  )
  if refusal is not None:
    found = {'refusal': dataclasses.asdict(refusal), 'seconds': seconds}
    return dict(found, planned=planned), None, None, None
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
    'buffers': None if buffers is None else buffers.to_dict(),
  }
  names = {i.name for c in computations.values() for i in c.instructions}
  elsewhere = buffers is not None and any(v.name not in names for v in buffers.at_peak)
  peak_text = made.dumped if elsewhere else None
  found['buffers_program'] = peak_text is not None
  return found, text, computations, peak_text
