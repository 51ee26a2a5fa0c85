"""MaxText's mixture-of-experts training steps through ``fsm.fit`` and
``report.why()``: Mixtral-8x7B, and DeepSeek-V2-Lite at two expert degrees.

Each step is MaxText 0.2.5's, built by its own ``train_compile`` functions as
``benchmarks/maxtext_why.py`` builds llama3-8b's, for a v5p-64 pod (32
chips, ``compile_topology=v5p-64``) with FSDP and expert parallelism
(``ici_fsdp_parallelism`` x ``ici_expert_parallelism``), compiled on this
CPU through libtpu. MaxText routes with ``jax.lax.ragged_all_to_all`` inside
a ``shard_map`` and computes the experts with its megablox grouped matmul
(``sparse_matmul``). For each step the script checks:

- **fit equals MaxText's compile**: the step compiled as ``jit_and_compile``
  compiles it (outside fsm, with MaxText's XLA flags) has the memory
  analysis fsm.fit reports, field by field;
- **every collective has a reason**: no row of why() is ``unknown``;
- **routing, per layer**: routing rows at MaxText's two exchange lines (the
  dispatch and the combine of ``RoutedMoE``), their count a whole multiple
  of the MoE layers;
- **the permutes**: every collective-permute is a ring over the whole mesh,
  XLA's windowed einsum of a parameter's gather or its gradient's
  reduction, named as such.

It prints why()'s routing and permute rows and publishes a table to
BENCHMARKS.md. Runs in MaxText's venv (see ``benchmarks/maxtext_why.py``)::

  PYTHONPATH=. ~/maxtext-venv/bin/python benchmarks/maxtext_moe.py [--no-write]

Each step compiles twice the first time (once in fsm.fit, once as MaxText
compiles it), 1.5 to 4 minutes each on a shared 2-core machine; both are
cached (fit's figures, and the MaxText compile's memory analysis in
``~/.cache/flax_shardmeta/maxtext_moe``). The exit status is 1 when a check
fails. Not part of CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from _common import machine, machine_line, publish
from maxtext_why import _version, build_step, fit_report, lowered_key

TOPOLOGY = 'v5p-64'
PER_DEVICE_BATCH, SEQ = 1, 2048


@dataclasses.dataclass(frozen=True)
class Case:
  model: str
  fsdp: int
  expert: int
  moe_layers: int  # the decoder layers with routed experts

  @property
  def parallelism(self) -> tuple[str, ...]:
    return (
      f'ici_fsdp_parallelism={self.fsdp}',
      f'ici_expert_parallelism={self.expert}',
    )


CASES = (
  Case('mixtral-8x7b', 8, 4, 32),
  Case('deepseek2-16b', 8, 4, 26),  # 27 layers, the first dense
  Case('deepseek2-16b', 4, 8, 26),
)
MEMORY_FIELDS = (
  'argument_size_in_bytes',
  'output_size_in_bytes',
  'alias_size_in_bytes',
  'temp_size_in_bytes',
  'generated_code_size_in_bytes',
)


def _cache() -> Path:
  base = os.environ.get('XDG_CACHE_HOME') or str(Path.home() / '.cache')
  return Path(base) / 'flax_shardmeta' / 'maxtext_moe'


def maxtext_memory(built: Any) -> dict[str, int]:
  """XLA's memory analysis of the step compiled as MaxText compiles it,
  cached by the lowered program and the versions."""
  lowered, key = lowered_key(built)
  path = _cache() / f'{key}.json'
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    pass
  m = lowered.compile(compiler_options=built.compiler_options).memory_analysis()
  found = {k: int(getattr(m, k)) for k in MEMORY_FIELDS}
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(found))
  return found


def _gib(n: float) -> str:
  return f'{n / 2**30:.2f} GiB'


def check(case: Case) -> tuple[list[str], list[str], bool]:
  """The case's table row, its printed rows, and whether every check held."""
  built = build_step(
    PER_DEVICE_BATCH,
    SEQ,
    (),
    model=case.model,
    topology=TOPOLOGY,
    parallelism=case.parallelism,
  )
  report = fit_report(built)
  own = maxtext_memory(built)
  ours = report.memory_analysis or {}
  same = all(int(ours.get(k, -1)) == own[k] for k in MEMORY_FIELDS)
  rows = report.collectives
  unknown = [r for r in rows if r.reason in ('unknown', '')]
  routing = [r for r in rows if r.reason == 'routing']
  roles = {r.change.split(';')[0] for r in routing}
  sources = sorted({s for r in routing for s in r.sources})
  count = sum(r.count for r in routing)
  per_layer = count / case.moe_layers
  permutes = [r for r in rows if r.kind == 'collective-permute']
  rings = [r for r in permutes if 'windowed einsum' in r.change]
  mesh = dict(built.mesh.shape)
  whole = {a for a, n in mesh.items() if n > 1}
  ringed = all(set(r.axes) == whole for r in permutes)
  checks = {
    'fit equals the compile': same,
    'every collective has a reason': not unknown,
    'routing at dispatch and combine': roles >= {'dispatch', 'combine'},
    'routing per layer': count > 0 and per_layer == int(per_layer),
    'permutes are windowed-einsum rings': len(rings) == len(permutes) and ringed,
  }
  by = {
    k: sum(r.bytes for r in rows if r.reason == k)
    for k in ('parameter', 'gradient', 'routing')
  }
  ring_count = sum(r.count for r in permutes)
  ring_reasons = sorted({r.reason for r in permutes})
  row = (
    f'| {case.model} | fsdp={case.fsdp} expert={case.expert} | '
    f'{_gib(report.total_bytes)} | {"equal" if same else "differs"} | '
    f'{_gib(by["routing"])} ({_gib(by["routing"] / case.moe_layers)}/layer, '
    f'{per_layer:g}/layer) | {_gib(by["parameter"])} | {_gib(by["gradient"])} | '
    f'{ring_count:,} ({", ".join(ring_reasons) or "-"}) | {len(unknown)} |'
  )
  printed = [
    f'{case.model} on {TOPOLOGY} {mesh}: peak {_gib(report.total_bytes)} per chip; '
    f'MaxText compile {own}',
    *(f'  {k}: {"ok" if v else "FAILED"}' for k, v in checks.items()),
    '  routing rows:',
    *(
      f'    {r.kind} over {"+".join(r.axes)} x{r.count}: {_gib(r.bytes)}, {r.change} '
      f'at {", ".join(r.sources)}'
      for r in routing
    ),
    '  permutes:',
    *(
      f'    {r.reason} over {"+".join(r.axes)} x{r.count}: {_gib(r.bytes)}, '
      f'{r.change}, {", ".join(r.parameters[:1])}'
      for r in permutes
    ),
    f'  routing lines: {", ".join(sources)}',
  ]
  return [row], printed, all(checks.values())


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--no-write', action='store_true')
  a = parser.parse_args()
  lines = [
    machine_line(machine()),
    f'Command: `PYTHONPATH=. ~/maxtext-venv/bin/python benchmarks/maxtext_moe.py` '
    f'(MaxText {_version("maxtext")}, jax {_version("jax")}, libtpu '
    f'{_version("libtpu")}; {TOPOLOGY}, per_device_batch_size={PER_DEVICE_BATCH}, '
    f'max_target_length={SEQ}, MaxText defaults otherwise: sparse_matmul, remat '
    'full)',
    '',
    '| model | mesh | peak per chip | fit vs MaxText compile | routing | '
    'parameter gathers | gradients | collective-permutes | unknown rows |',
    '|---|---|---|---|---|---|---|---|---|',
  ]
  ok = True
  for case in CASES:
    row, printed, held = check(case)
    lines += row
    print('\n'.join(printed), file=sys.stderr)
    ok &= held
  lines += [
    '',
    'Bytes are per chip per step, by the reason why() gives each collective.',
    'Reading it:',
    "- Routing is MaxText's two ragged all-to-alls, at RoutedMoE's dispatch and",
    '  combine lines (moe.py:2739 and 3016 in 0.2.5): their bytes are the send',
    "  buffers' (every token leaving), the most a step can move. Per layer: the",
    '  forward exchanges, their rematerialisation and their transposes.',
    "- The collective-permutes are XLA's windowed einsum: each weight sharded",
    "  over both axes (the attention projections, the router; DeepSeek's shared",
    '  experts and dense layers too) is all-gathered (forward) and its gradient',
    '  reduce-scattered (backward) as a ring of permutes over every chip, each',
    '  step overlapped with the matmul. They were once reported over `expert`',
    "  alone (the ring's first pair of neighbours) and are now rows of the",
    '  parameter they move, over the whole ring.',
    '- The experts are laid out over expert and FSDP-sharded over fsdp: their',
    '  gathers and gradient reductions run over fsdp only.',
    '- DeepSeek-V2-Lite at expert 8 against 4 (fsdp 4 against 8): the routing',
    '  bytes grow by 1.8x, the parameter gathers and gradients shrink by 37%.',
  ]
  publish(
    '## MaxText mixture-of-experts steps: routing and permutes', lines, not a.no_write
  )
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
