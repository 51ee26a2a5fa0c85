"""What holds the peak of MaxText's own llama3-8b step: ``FitReport.peak()``
on a real client's program, without and with remat.

The step is the one ``benchmarks/maxtext_why.py`` builds (MaxText 0.2.5's
``train_compile`` functions, v5p-128 as ``v5p:4x4x4``, ``ici_fsdp_parallelism=64``,
its logical axis rules, the state donated), once with MaxText's
``remat_policy=minimal`` and once with its default, ``full``. For each:

* the rows add up to fit's total, exactly;
* the share of the temporaries' bytes that is named (at least 90%);
* the three largest rows, with their size worked out by hand (shape x dtype,
  as the buffer lies on a chip);
* rows that carry MaxText's ``checkpoint_name``s;

then the diff ``minimal -> full``: it adds up, and which activations went.

Runs in MaxText's venv (see ``benchmarks/maxtext_why.py`` for making it)::

  PYTHONPATH=. ~/maxtext-venv/bin/python benchmarks/maxtext_peak.py [--no-write]

Each policy compiles once (2 to 4 minutes on 2 cores) unless fit's figure
cache has it. Not part of CI.
"""

from __future__ import annotations

import sys
import time

from _common import machine, machine_line, publish
from maxtext_why import MODEL, TOPOLOGY, build_step, fit_report
from peak import largest_rows

POLICIES = ('minimal', 'full')
PER_DEVICE_BATCH, SEQ = 4, 2048


def _peak(policy: str) -> tuple[object, object, float]:
  built = build_step(PER_DEVICE_BATCH, SEQ, (f'remat_policy={policy}',))
  start = time.perf_counter()
  report = fit_report(built)
  seconds = time.perf_counter() - start
  start = time.perf_counter()
  peak = report.peak()
  return report, peak, seconds + (time.perf_counter() - start)


def main(write: bool) -> None:
  import flax_shardmeta as fsm

  fsm.cpu_only_jax()
  lines = [
    machine_line(machine()),
    f'Command: `python benchmarks/maxtext_peak.py` (MaxText 0.2.5, {MODEL}, '
    f'{TOPOLOGY}, per-device batch {PER_DEVICE_BATCH} x {SEQ}, ici_fsdp=64; '
    "MaxText's mesh: Auto axes)",
    '',
  ]
  peaks = {}
  for policy in POLICIES:
    report, peak, seconds = _peak(policy)
    peaks[policy] = peak
    total = sum(r.bytes for r in peak.rows)  # type: ignore[attr-defined]
    named = sorted(
      {
        n
        for r in peak.rows  # type: ignore[attr-defined]
        for n in r.checkpoint.split(', ')
        if n
      }
    )
    lines += [
      f'- remat_policy={policy}: total {report.total_bytes:,} B '
      f'({fsm.format_bytes(report.total_bytes)}); rows add up: '
      f'{total == report.total_bytes}; temporaries named: '
      f'{peak.named_fraction:.1%}; peak in the {peak.phase}, at {peak.at}',
      f'  - fit + peak(): {seconds:.0f} s',
      f"  - MaxText's checkpoint names on rows: {', '.join(named) or 'none'}",
      '  - the three largest rows:',
      *largest_rows(peak),
    ]
  diff = peaks['minimal'].diff(peaks['full'])  # type: ignore[attr-defined]
  went = [r for r in diff.rows if r.kind in ('activation', 'backward') and r.change < 0]
  lines += [
    f'- remat_policy minimal -> full: {diff.change:+,} B; rows add up: '
    f'{sum(r.change for r in diff.rows) == diff.change}; activations that went: '
    + '; '.join(
      f'{r.what}{f" [{r.checkpoint}]" if r.checkpoint else ""} at {r.where} '
      f'({r.change:+,} B)'
      for r in went[:5]
    ),
  ]
  lines += [
    '',
    'Reading it:',
    "- The rows add up to fit's total for both policies, and every temporary at the",
    '  peak is named. The times are fit from its figure cache plus `peak()`; each',
    "  policy's one compile took 2 to 3 minutes.",
    "- The largest row under `minimal` is MaxText's two MLP input projections",
    '  (`mlpwi_0`, `mlpwi_1`), saved for all 32 layers: two bf16 buffers of',
    '  `[32, 4, 2048, 14336]` per chip, 7 GiB each. The line is the one inside',
    "  MaxText's dense helper that runs every projection; the checkpoint names",
    '  tell its rows apart (a name is kept only on a value of the shape it was',
    '  given to).',
    "- `full` drops them, and the diff names what went with the policy's names.",
  ]
  publish("## What holds the peak: MaxText's llama3-8b", lines, write)


if __name__ == '__main__':
  main(write='--no-write' not in sys.argv)
