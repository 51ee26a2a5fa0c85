"""What holds the peak: ``FitReport.peak()`` on the fit benchmark's steps.

For Llama-3-8B (batch 32 x 2048) on v5p:4x4x8 (data=32 x model=4) and on
h100:4x8 (data=4 x model=8), without and with remat full:

* the rows add up to fit's total, exactly;
* the share of the temporaries' bytes that is named (at least 90%);
* the three largest rows, with what their size should be by hand (shape x
  dtype / shards);
* without against with remat: the diff adds up, and which activations went;
* the cost: ``fit`` again from its cache, then ``peak()``, in one process (no
  second compile; the target is under 10 s on 2 cores).

Needs libtpu and jax's CUDA plugin (``pip install '.[tpu,gpu]'``). Usage:
``python benchmarks/peak.py [--no-write]``. Each configuration compiles once
(about 3 minutes for 8B on 2 cores) unless the figure cache has it.
"""

from __future__ import annotations

import math
import sys
import time

from _common import machine, machine_line, publish

CONFIGS = [
  ('v5p:4x4x8', (32, 4)),
  ('h100:4x8', (4, 8)),
]
BATCH, SEQ = 32, 2048


def _fit(topology: str, sizes: tuple[int, int], remat: str) -> tuple[object, float]:
  import jax

  import flax_shardmeta as fsm
  from flax_shardmeta.examples import train

  auto = (jax.sharding.AxisType.Auto,) * 2
  mesh = fsm.make_mesh(sizes, ('data', 'model'), topology=topology, axis_types=auto)
  step, state, batch = train.train_step(
    'llama3-8b', mesh, batch=BATCH, seq=SEQ, remat=remat
  )
  start = time.perf_counter()
  report = fsm.fit(step, state, batch)
  return report, time.perf_counter() - start


def largest_rows(peak: object, n: int = 3) -> list[str]:
  """The ``n`` largest rows, each with its size worked out by hand from the
  buffer's shape as XLA holds it on a chip (shape x dtype: already a shard)."""
  from flax_shardmeta._programs.hlo_text import array_shapes, itemsize
  from flax_shardmeta._units import format_bytes

  out = []
  for r in peak.largest(n):  # type: ignore[attr-defined]
    stacked = f' x {r.layers} layers' if r.layers else ''
    where = f' at {r.where}' if r.where else ''
    line = f'    - {r.kind}: {r.what}{stacked}{where}: {format_bytes(r.bytes)}'
    arrays = array_shapes(r.shape) if r.shape else []
    if arrays:
      dtype, dims = arrays[0]
      each = math.prod(dims) * itemsize(dtype)
      line += (
        f'; by hand: one buffer of {dtype}{list(dims)} per chip is '
        f'{math.prod(dims):,} x {itemsize(dtype):g} B = {format_bytes(int(each))}, '
        f'so the row is {r.bytes / each:.2f} such buffers'
      )
    out.append(line)
  return out


def main(write: bool) -> None:
  import flax_shardmeta as fsm

  fsm.cpu_only_jax()
  lines = [
    machine_line(machine()),
    f'Command: `python benchmarks/peak.py` (llama3-8b, batch {BATCH} x {SEQ}, '
    'bf16 parameters, adamw; Auto axes)',
    '',
  ]
  for topology, sizes in CONFIGS:
    peaks = {}
    for remat in ('none', 'full'):
      report, first = _fit(topology, sizes, remat)
      again, cached = _fit(topology, sizes, remat)  # from the figure cache
      start = time.perf_counter()
      peak = again.peak()
      cached += time.perf_counter() - start
      peaks[remat] = peak
      total = sum(r.bytes for r in peak.rows)
      lines += [
        f'- {topology} data={sizes[0]} x model={sizes[1]}, remat {remat}: '
        f'total {report.total_bytes:,} B; rows add up: {total == report.total_bytes}; '
        f'temporaries named: {peak.named_fraction:.1%}; peak in the {peak.phase}, '
        f'at {peak.at}',
        f'  - fit compiled in {first:.0f} s; fit from the cache + peak(): '
        f'{cached:.1f} s',
        '  - the three largest rows:',
        *largest_rows(peak),
      ]
    diff = peaks['none'].diff(peaks['full'])
    went = [
      r for r in diff.rows if r.kind in ('activation', 'backward') and r.change < 0
    ][:3]
    lines += [
      f'  - remat none -> full: {diff.change:+,} B; rows add up: '
      f'{sum(r.change for r in diff.rows) == diff.change}; activations that went: '
      + '; '.join(f'{r.what} at {r.where} ({r.change:+,} B)' for r in went),
      '',
    ]
  lines += [
    'Reading it:',
    "- Figures are unchanged. The totals are the fit benchmark's. Dumping the buffer",
    "  assignment during fit's one compile changes nothing XLA reports.",
    "- The three largest rows were checked by hand. Each row's shape is one buffer as",
    "  XLA holds it on a chip, so its bytes are the shape's elements times the",
    "  dtype's size. A row that adds up several values of the same kind, line and",
    '  layer count is that many such buffers.',
    '- On v5p, `memory_analysis()` counts more temporary memory than the buffer',
    "  assignment places (the `compiler scratch` row). XLA's dump does not say what",
    '  that memory is, and the report names it only as that difference. In these runs',
    "  it is within 0.1 MiB of the heap's fragmentation at the peak. That is an",
    '  observation, not a rule the code relies on.',
    "- MaxText's own llama3-8b step is in the next section",
    "  (`benchmarks/maxtext_peak.py`, in MaxText's venv).",
  ]
  publish('## What holds the peak (`fsm.fit(...).peak()`)', lines, write)


if __name__ == '__main__':
  main(write='--no-write' not in sys.argv)
